#!/usr/bin/env bash
# The installed package as an outside project sees it; tests/packaging/CMakeLists.txt runs each step.
#   consumer_test.sh install BUILD_DIR PREFIX              cmake --install the built tree into an empty PREFIX
#   consumer_test.sh cmake PREFIX WORK_DIR VERSION         consumer/ with find_package(ferry VERSION EXACT), built, run
#   consumer_test.sh pkg-config PC_DIR WORK_DIR VERSION    consumer/main.cc built with `pkg-config --cflags --libs ferry`, run
# Each run of the consumer makes one update and must print the version.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cmake=${CMAKE:-cmake}
cxx=${CXX:-c++}
mode=$1 from=$2 work=$3
rm -rf "$work"
case $mode in
  install)
    "$cmake" --install "$from" --prefix "$work" >/dev/null
    exit 0 ;;
  cmake)
    "$cmake" -S "$here/consumer" -B "$work" -DCMAKE_PREFIX_PATH="$from" -DCMAKE_CXX_COMPILER="$cxx" \
      -DEXPECTED_VERSION="$4" >/dev/null
    "$cmake" --build "$work" ;;
  pkg-config)
    [ "$(PKG_CONFIG_PATH=$from pkg-config --modversion ferry)" = "$4" ]
    mkdir -p "$work"
    # shellcheck disable=SC2046  # the flags are words
    "$cxx" -std=c++20 "$here/consumer/main.cc" -o "$work/consumer" $(PKG_CONFIG_PATH=$from pkg-config --cflags --libs ferry) ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
out=$("$work/consumer")
echo "$out"
[[ $out == "ferry $4: update v1 ok "* ]]
