#!/usr/bin/env bash
# `pip install .` with scikit-build-core into a clean virtual environment (none of the system's
# packages; numpy and pytest from PyPI), then ferry.__version__, the `ferry` command and the Python
# tests against the installed package; then `pip wheel .` makes the wheel.
# usage: pip_test.sh PYTHON WORK_DIR VERSION
#   WORK_DIR keeps the CMake build between runs and between the install and the wheel (build/), so
#   each rebuilds only what changed.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
python=$1 work=$2 version=$3
rm -rf "$work/venv" "$work/wheels"
"$python" -m venv "$work/venv"
py=$work/venv/bin/python
# The build requirements and the test's own come from PyPI; without it there is nothing to test.
if ! "$py" -m pip install -q numpy pytest; then
  echo "PyPI unreachable: skipped"
  exit 77
fi
"$py" -m pip install -q --config-settings=build-dir="$work/build" "$root"
cd "$work"  # away from the sources: `import ferry` must find the installed package
[ "$("$py" -c 'import ferry; print(ferry.__version__)')" = "$version" ]
[ "$("$py" -c 'import ferry; print(ferry.__file__)')" = "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/ferry/__init__.py" ]
[ "$("$work/venv/bin/ferry" --version)" = "ferry $version" ]
"$py" -m pytest -q -p no:cacheprovider "$root/tests/python"
# The wheel of the same build.
"$py" -m pip wheel -q --no-deps -w "$work/wheels" --config-settings=build-dir="$work/build" "$root"
wheel=$(ls "$work"/wheels/ferry-"$version"-*.whl)
"$py" -m zipfile -l "$wheel" | grep -q 'ferry/_ferry.*\.so'
