#!/usr/bin/env bash
# A throw-away Slurm cluster on this host, to try sbatch scripts (and to test slurm/megarl.sbatch):
# several simulated nodes (one slurmd each, `slurmd -N nX` on its own port) with fake GPUs that
# Slurm really accounts for (mknod'd char devices, major 195: GRES counts, SLURM_GPUS_ON_NODE and a
# per-job CUDA_VISIBLE_DEVICES). Everything lives under DIR; nothing is written to /etc/slurm.
# Needs root (slurmd, mknod). Debian/Ubuntu's Slurm (22.05 on Debian 12).
#
#   tools/slurm_sandbox.sh deps                       # apt-get install Slurm when slurmctld is missing
#   tools/slurm_sandbox.sh up DIR [--nodes 2] [--gpus 2] [--cpus 2] [--port 6960]
#   export SLURM_CONF=DIR/etc/slurm.conf              # `up` prints this line; then sbatch/squeue/srun
#   tools/slurm_sandbox.sh down DIR                   # cancel its jobs, stop its daemons by PID
#
# Ports: slurmctld on --port, node k's slurmd on --port + k. auth/none (no munged): a sandbox only.
set -euo pipefail

die() { echo "slurm_sandbox: $*" >&2; exit 1; }

deps() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null; then
        echo "slurm_sandbox: Slurm is installed ($(slurmctld -V))"
        return
    fi
    [ "$(id -u)" = 0 ] || die "Slurm is not installed and installing it needs root: run as root
  apt-get update && apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge"
    command -v apt-get >/dev/null || die "Slurm is not installed and this machine has no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=120 update -q
    apt-get -o DPkg::Lock::Timeout=120 install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
    echo "slurm_sandbox: installed $(slurmctld -V)"
}

up() {
    local dir="" nodes=2 gpus=2 cpus=2 port=6960
    while [ $# -gt 0 ]; do
        case $1 in
            --nodes) nodes=$2; shift 2 ;;
            --gpus) gpus=$2; shift 2 ;;
            --cpus) cpus=$2; shift 2 ;;
            --port) port=$2; shift 2 ;;
            -*) die "unknown option $1" ;;
            *) dir=$1; shift ;;
        esac
    done
    [ -n "$dir" ] || die "usage: slurm_sandbox.sh up DIR [--nodes N] [--gpus G] [--cpus C] [--port P]"
    [ "$(id -u)" = 0 ] || die "up needs root (slurmd runs jobs as their users; fake GPUs need mknod)"
    command -v slurmctld >/dev/null || die "Slurm is not installed: run tools/slurm_sandbox.sh deps"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ ! -s "$dir/run/pids" ] || die "$dir already has a running sandbox (run/pids); run: slurm_sandbox.sh down $dir"
    mkdir -p "$dir"/{etc,state,spool,log,run,dev}
    : > "$dir/run/pids"
    local i host
    host=$(hostname -s)
    for ((i = 0; i < gpus; i++)); do
        [ -e "$dir/dev/nvidia$i" ] || mknod "$dir/dev/nvidia$i" c 195 "$i" \
            || die "mknod failed: fake GPUs need root with CAP_MKNOD"
    done
    cat > "$dir/etc/slurm.conf" <<CONF
ClusterName=sandbox
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
EnforcePartLimits=ALL
KillWait=5
MinJobAge=600
SlurmdParameters=config_overrides
GresTypes=gpu
CONF
    for ((i = 1; i <= nodes; i++)); do
        echo "NodeName=n$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + i)) CPUs=$cpus RealMemory=4000 Gres=gpu:$gpus State=UNKNOWN" \
            >> "$dir/etc/slurm.conf"
    done
    echo "PartitionName=gpu Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP" >> "$dir/etc/slurm.conf"
    printf 'AutoDetect=off\nNodeName=n[1-%s] Name=gpu File=%s/dev/nvidia[0-%s]\n' "$nodes" "$dir" $((gpus - 1)) \
        > "$dir/etc/gres.conf"

    export SLURM_CONF=$dir/etc/slurm.conf
    slurmctld -D -i -f "$SLURM_CONF" > "$dir/log/slurmctld.stdout" 2>&1 &
    echo $! >> "$dir/run/pids"
    for ((i = 1; i <= nodes; i++)); do
        mkdir -p "$dir/spool/n$i"
        slurmd -D -N "n$i" -f "$SLURM_CONF" > "$dir/log/slurmd.n$i.stdout" 2>&1 &
        echo $! >> "$dir/run/pids"
    done
    for ((i = 0; i < 150; i++)); do
        if [ "$(sinfo -h -t idle -o %D 2>/dev/null)" = "$nodes" ]; then
            echo "slurm_sandbox: $nodes node(s) x $gpus GPU(s) x $cpus CPU(s) idle; logs in $dir/log"
            echo "export SLURM_CONF=$SLURM_CONF"
            return
        fi
        sleep 0.2
    done
    sinfo -N >&2 || true
    tail -n 5 "$dir"/log/*.stdout "$dir"/log/*.log >&2 || true
    down "$dir" >&2
    die "the nodes did not become idle within 30 s (port $port taken? see above)"
}

down() {
    local dir=${1:?usage: slurm_sandbox.sh down DIR} pid i jobs
    [ -f "$dir/run/pids" ] || die "$dir has no sandbox (no run/pids)"
    export SLURM_CONF=$dir/etc/slurm.conf
    # Jobs outlive slurmd (their slurmstepd keeps running), so cancel this cluster's jobs first.
    jobs=$(timeout 10 squeue -h -o %i 2>/dev/null || true)
    if [ -n "$jobs" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs || true
        for ((i = 0; i < 100; i++)); do
            [ -z "$(timeout 10 squeue -h -o %i 2>/dev/null || true)" ] && break
            sleep 0.2
        done
    fi
    for pid in $(tac "$dir/run/pids"); do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in $(cat "$dir/run/pids"); do
        for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    done
    : > "$dir/run/pids"
    echo "slurm_sandbox: stopped"
}

case ${1:-} in
    deps) deps ;;
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    *) die "usage: slurm_sandbox.sh deps | up DIR [--nodes N] [--gpus G] [--cpus C] [--port P] | down DIR" ;;
esac
