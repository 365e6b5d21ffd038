#!/usr/bin/env bash
# Create (or bring up to date) the benchmark environment .venv-bench: TRL and its dependencies at
# the versions of requirements/bench-py311.lock, sharing the project's torch, transformers, accelerate
# and megarl from .venv (installed from requirements/cpu-py311.lock by `make install`) without touching .venv.
#
#   tools/bench/setup_bench_env.sh            # prints the path of the environment's python
#
# How: a plain venv of the same base interpreter, plus a .pth file that appends .venv's
# site-packages (and its .pth files) to sys.path (so torch/transformers/megarl are shared, not copied).
# pip installs exactly the bench lock's packages (--no-deps: the rest are .venv's), then checks that
# every requirement of the whole set holds. Installs again when the lock changed (`make lock`).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
main_python="$repo/.venv/bin/python"
bench="${MEGARL_BENCH_VENV:-$repo/.venv-bench}"
[ -x "$main_python" ] || { echo "setup_bench_env: $main_python not found (create .venv first)" >&2; exit 1; }

minor="$("$main_python" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
lock="$repo/requirements/bench-py$minor.lock"
[ -f "$lock" ] || { echo "setup_bench_env: no $lock: the benchmark environment is locked for Python 3.11 only (.venv is $minor)" >&2; exit 1; }

if ! cmp -s "$lock" "$bench/bench.lock"; then
  if [ ! -x "$bench/bin/python" ]; then
    base_python="$("$main_python" -c 'import sys; print(sys._base_executable)')"
    "$base_python" -m venv "$bench" >&2
    main_site="$("$main_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    bench_site="$("$bench/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # an `import` line in a .pth runs at start-up; addsitedir also runs .venv's own .pth files (editable megarl)
    echo "import site; site.addsitedir('$main_site')" > "$bench_site/megarl-main-venv.pth"
    # the setuptools Python 3.11's venv bundles (65.5) would shadow .venv's locked one (torch needs >= 77)
    "$bench/bin/python" -m pip uninstall --quiet --yes setuptools >&2
  fi
  "$bench/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -r "$lock" >&2
  "$bench/bin/python" -m pip check >&2
  cp "$lock" "$bench/bench.lock"
fi
"$bench/bin/python" -c "import trl, transformers, torch, megarl" >&2
echo "$bench/bin/python"
