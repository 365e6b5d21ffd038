#!/usr/bin/env bash
# Run a megarl experiment on this machine, on a Ray cluster started for it and stopped after it:
#
#   launch/local.sh --config my_exp.yaml [key=value ...]
#
# The cluster is sized from the config: a Ray head with trainer.n_gpus_per_node GPUs, plus
# trainer.nnodes - 1 more Ray nodes on this machine when the config spans several nodes (to try a
# multi-node layout locally). Then the cluster check (placement plan realised, gloo across all
# ranks), then the experiment (MEGARL_ENTRY, default `-m megarl.trainer.main_ppo`, with the same
# arguments). Only the Ray processes it started are stopped (by PID); the exit status is the
# experiment's, or 3 if the cluster did not come up. Works from any directory.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ -n "${MEGARL_PYTHON:-}" ]; then
    PY=$MEGARL_PYTHON
elif [ -x "$here/../.venv/bin/python" ]; then
    PY=$here/../.venv/bin/python  # the checkout's own environment (make install)
else
    PY=$(command -v python3 || true)
fi
if ! "$PY" -c "import megarl.launch.local" 2>/dev/null; then
    echo "launch/local.sh: '$PY' cannot import megarl: run 'make install', activate megarl's environment, or set MEGARL_PYTHON" >&2
    exit 2
fi
exec "$PY" -m megarl.launch.local "$@"
