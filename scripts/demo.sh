#!/usr/bin/env bash
# Sets up a fresh machine, builds ferry, and runs the demo: a trainer and a TP-2 replica as three
# processes on 127.0.0.1, three verified weight updates.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
# The MPI example too (the README's mpirun line), where CMake found MPI.
targets=(ferry ferry-demo)
if cmake --build build --target help | grep '^ferry-mpi-example:' > /dev/null; then targets+=(ferry-mpi-example); fi
cmake --build build --target "${targets[@]}"
build/bin/ferry-demo "$@"
