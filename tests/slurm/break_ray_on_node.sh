#!/usr/bin/env bash
# MEGARL_RAY_WRAPPER for the Slurm tests: runs `ray start` unchanged except on the Slurm node named
# by BREAK_RAY_ON_NODE, where BREAK_RAY_MODE=crash gives it a bad --num-gpus (it exits with an
# error) and BREAK_RAY_MODE=hang never starts it (a node that never joins).
if [ "${SLURMD_NODENAME:-}" = "${BREAK_RAY_ON_NODE:-}" ]; then
    case ${BREAK_RAY_MODE:-crash} in
        crash) exec "$@" --num-gpus=not-a-number ;;
        hang) exec -a "hung ray start in $RAY_TMPDIR" sleep 600 ;;  # named so a leftover can be found
        *) echo "break_ray_on_node.sh: unknown BREAK_RAY_MODE=$BREAK_RAY_MODE" >&2; exit 1 ;;
    esac
fi
exec "$@"
