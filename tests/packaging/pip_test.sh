#!/usr/bin/env bash
# `pip install .` with scikit-build-core into a clean virtual environment (none of the system's
# packages; numpy, pytest and the build requirements from PyPI), then ferry.__version__, the `ferry`
# command and the Python tests against the installed package; then `pip wheel .` makes the wheel.
# Both build in the venv itself (--no-build-isolation), so that they share one CMake build.
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
# (pyproject.toml's build requirements, read with the standard library's TOML reader.)
mapfile -t requires < <("$py" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]))' "$root/pyproject.toml")
if ! "$py" -m pip install -q numpy pytest "${requires[@]}"; then
  echo "PyPI unreachable: skipped"
  exit 77
fi
"$py" -m pip install -q --no-build-isolation --config-settings=build-dir="$work/build" "$root"
cd "$work"  # away from the sources: `import ferry` must find the installed package
[ "$("$py" -c 'import ferry; print(ferry.__version__)')" = "$version" ]
[ "$("$py" -c 'import ferry; print(ferry.__file__)')" = "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')/ferry/__init__.py" ]
[ "$("$work/venv/bin/ferry" --version)" = "ferry $version" ]
"$py" -m pytest -q -p no:cacheprovider "$root/tests/python"
# The wheel of the same build.
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/wheels" --config-settings=build-dir="$work/build" "$root"
wheel=$(ls "$work"/wheels/ferry-"$version"-*.whl)
"$py" -m zipfile -l "$wheel" | grep 'ferry/_ferry.*\.so' > /dev/null
