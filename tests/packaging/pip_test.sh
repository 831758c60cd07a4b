#!/usr/bin/env bash
# `pip wheel .` with scikit-build-core, the wheel installed into a fresh virtual environment, then
# ferry.__version__, the `ferry` command and the Python tests against the installed package.
# usage: pip_test.sh PYTHON WORK_DIR VERSION
#   PYTHON has numpy and pytest (the venv sees its site packages); WORK_DIR keeps the CMake build
#   between runs (build/), so a second run rebuilds only what changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=$1 work=$2 version=$3
rm -rf "$work/venv" "$work/wheels"
"$python" -m venv --system-site-packages "$work/venv"
py=$work/venv/bin/python
# The build requirements come from PyPI; without it there is nothing to test.
if ! "$py" -m pip download -q --no-deps -d "$work/wheels/probe" "scikit-build-core>=0.10"; then
  echo "PyPI unreachable: skipped"
  exit 77
fi
"$py" -m pip wheel -q --no-deps -w "$work/wheels" --config-settings=build-dir="$work/build" "$root"
"$py" -m pip install -q "$work"/wheels/ferry-"$version"-*.whl
cd "$work"  # away from the sources: `import ferry` must find the installed package
[ "$("$py" -c 'import ferry; print(ferry.__version__)')" = "$version" ]
[ "$("$py" -c 'import ferry; print(ferry.__file__)')" = "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/ferry/__init__.py" ]
[ "$("$work/venv/bin/ferry" --version)" = "ferry $version" ]
"$py" -m pytest -q -p no:cacheprovider "$root/tests/python"
