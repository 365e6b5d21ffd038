#!/usr/bin/env bash
# GPU benchmark for one NVIDIA GPU machine with PyTorch but no internet, no megatron-core and no megarl:
# installs megatron-core (and any other missing dependency) from local wheel files and megarl from this
# source tree into a temporary target (pip --no-index --no-deps --target), then runs gpu_bench.py:
# train-step MFU of the Megatron engine on a ~1B Llama in bf16 and the sync path's GB/s on the device.
#
#   tools/bench/gpu.sh --wheels DIR [gpu_bench.py options]     # e.g. --steps 5 --json outputs/bench/gpu.json
#   tools/bench/gpu.sh --dry-run --wheels DIR                  # install and import only, print the commands
#   tools/bench/gpu.sh --wheels DIR --device cpu --tiny        # the same on CPU (checks the script)
#
# DIR holds megatron-core's wheel and wheels of whatever else the GPU machine lacks among megarl's
# runtime dependencies (transformers, tokenizers, safetensors, pyyaml, ...), made on a connected machine
# with the GPU machine's Python version, e.g.:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d DIR megatron-core==0.16.1 transformers ...
# Without --wheels, packages already importable are used as they are. Nothing outside the temporary
# target is installed or changed; it is removed at exit (--keep keeps it and prints its path).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python="${PYTHON:-python3}"
wheels="" dry_run=0 keep=0 bench_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) bench_args+=("$1"); shift ;;
  esac
done

"$python" -c "import torch" 2>/dev/null || { echo "gpu.sh: $python cannot import torch" >&2; exit 2; }
target="$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-bench.XXXXXX")"
if [ "$keep" = 1 ]; then echo "gpu.sh: target kept at $target" >&2; else trap 'rm -rf "$target"' EXIT; fi

pip_install=("$python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$target")
if [ -n "$wheels" ]; then
  [ -d "$wheels" ] || { echo "gpu.sh: --wheels $wheels is not a directory" >&2; exit 2; }
  shopt -s nullglob
  files=("$wheels"/*.whl)
  [ ${#files[@]} -gt 0 ] || { echo "gpu.sh: no .whl files in $wheels" >&2; exit 2; }
  # torch (and what it brings) stays the machine's own: never install a wheel of it
  keep_files=()
  for f in "${files[@]}"; do
    case "$(basename "$f")" in torch-*|nvidia_*|triton-*) echo "gpu.sh: skipping $(basename "$f") (the machine's own is used)" >&2 ;;
      *) keep_files+=("$f") ;; esac
  done
  echo "+ ${pip_install[*]} ${keep_files[*]}" >&2
  "${pip_install[@]}" "${keep_files[@]}"
fi
# megarl from source: pure Python, no build step needed, so no setuptools download either
echo "+ cp -r $repo/src/megarl $target/" >&2
cp -r "$repo/src/megarl" "$target/"

export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
"$python" - <<'EOF'
import importlib, sys
missing = []
for name in ("torch", "megatron.core", "megarl", "transformers", "safetensors", "yaml", "tokenizers"):
    try:
        module = importlib.import_module(name)
        print(f"  {name:<14} {getattr(module, '__version__', '')}  {getattr(module, '__file__', '')}", file=sys.stderr)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit("gpu.sh: not importable: " + ", ".join(missing) + "; add their wheels to --wheels DIR")
EOF
command=("$python" "$repo/tools/bench/gpu_bench.py" "${bench_args[@]}")
echo "+ PYTHONPATH=$target ${command[*]}" >&2
if [ "$dry_run" = 1 ]; then echo "gpu.sh: dry run, imports OK; not running the benchmark" >&2; exit 0; fi
cd "$repo"
"${command[@]}"
