#!/usr/bin/env bash
# Create (or reuse) the benchmark environment .venv-bench: TRL and its dependencies, sharing the
# project's torch, transformers and megarl from .venv without touching .venv.
#
#   tools/bench/setup_bench_env.sh            # prints the path of the environment's python
#
# How: a plain venv of the same base interpreter, plus a .pth file that appends .venv's
# site-packages (and its .pth files) to sys.path (so torch/transformers/megarl are shared, not copied). pip installs TRL
# under a constraints file pinning every package .venv already has to its installed version, so it
# picks the newest TRL compatible with the installed transformers and never upgrades (or shadows)
# a shared package.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
main_python="$repo/.venv/bin/python"
bench="${MEGARL_BENCH_VENV:-$repo/.venv-bench}"
[ -x "$main_python" ] || { echo "setup_bench_env: $main_python not found (create .venv first)" >&2; exit 1; }

if ! "$bench/bin/python" -c "import trl" 2>/dev/null; then
  base_python="$("$main_python" -c 'import sys; print(sys._base_executable)')"
  "$base_python" -m venv "$bench" >&2
  main_site="$("$main_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  bench_site="$("$bench/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # an `import` line in a .pth runs at start-up; addsitedir also runs .venv's own .pth files (editable megarl)
  echo "import site; site.addsitedir('$main_site')" > "$bench_site/megarl-main-venv.pth"
  constraints="$bench/constraints.txt"
  "$main_python" -m pip freeze --exclude-editable 2>/dev/null | grep -v '^#' | grep '==' > "$constraints"
  "$bench/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" trl >&2
fi
"$bench/bin/python" -c "import trl, transformers, torch, megarl" >&2
echo "$bench/bin/python"
