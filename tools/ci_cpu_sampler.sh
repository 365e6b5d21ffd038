#!/usr/bin/env bash
# Every INTERVAL seconds, one line to LOG: seconds since the start, the cores busy on average over the
# interval (from /proc/stat: user+nice+system+irq+softirq jiffies, over the interval's seconds times CLK_TCK) and the load
# averages. `.ci/run` starts it and stops it by its PID.
# usage: tools/ci_cpu_sampler.sh LOG [INTERVAL] [START_EPOCH_S]  (seconds counted from START_EPOCH_S, default now)
set -u
log=$1; interval=${2:-30}
hz=$(getconf CLK_TCK)
start=${3:-$(date +%s)}
read -r _ u n s _ _ q sq _ < /proc/stat; busy0=$((u + n + s + q + sq)); t0=$(date +%s%N)
echo "# seconds  busy-cores  load(1m 5m 15m)   ($(nproc) cores)" >>"$log"
while sleep "$interval"; do
  read -r _ u n s _ _ q sq _ < /proc/stat; busy1=$((u + n + s + q + sq)); t1=$(date +%s%N)
  cores=$(awk -v b=$((busy1 - busy0)) -v hz="$hz" -v ns=$((t1 - t0)) 'BEGIN { printf "%.2f", b / hz / (ns / 1e9) }')
  echo "$(( $(date +%s) - start )) $cores $(cut -d' ' -f1-3 /proc/loadavg)" >>"$log"
  busy0=$busy1; t0=$t1
done
