#!/usr/bin/env bash
# Makes DIR a venv over the system python (numpy and pytest from Debian, the interpreter the
# extension loads in) holding PyTorch, for tests/python/test_fsdp.py (FSDP2 trainer ranks), and
# prints its python. Reuses DIR when torch already imports there.
#   scripts/torch-venv.sh DIR
# FERRY_TORCH_PIP_ARGS replaces the pip arguments (default "torch", from PyPI): e.g.
# "torch --index-url https://download.pytorch.org/whl/cpu" for the CPU-only wheel, a tenth the size.
set -euo pipefail
dir=$1
base=${FERRY_TORCH_BASE_PYTHON:-/usr/bin/python3}
if [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import numpy, pytest, torch" 2>/dev/null; then
  echo "$dir/bin/python"
  exit 0
fi
rm -rf "$dir"
"$base" -m venv --system-site-packages "$dir" >&2
start=$(date +%s)
# shellcheck disable=SC2086  # the arguments are words
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check ${FERRY_TORCH_PIP_ARGS:-torch} >&2
"$dir/bin/python" -c "import numpy, pytest, torch; print('torch-venv: torch', torch.__version__, 'numpy', numpy.__version__)" >&2
echo "torch-venv: installed in $(($(date +%s) - start)) s" >&2
echo "$dir/bin/python"
