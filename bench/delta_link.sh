#!/usr/bin/env bash
# `ferry bench e2e --delta` over tcp through a link of a given rate: the bench (trainer, coordinator,
# rank processes) runs in a network namespace of its own whose loopback is shaped by a tc token
# bucket, so every tcp byte between trainer and ranks crosses a link of RATE, as between two nodes.
# Needs root (ip netns, tc). Unshaped loopback on the 2-core VM moves about 1.3 GB/s, a 10 Gbit/s
# link's rate; RATE 1gbit is a slow inter-node or inter-region link.
# usage: bench/delta_link.sh RATE [ferry bench e2e options...]   e.g. bench/delta_link.sh 1gbit --json
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:?usage: bench/delta_link.sh RATE [ferry bench e2e options]}
shift
ferry=${FERRY_BIN:-build/bin/ferry}
ns=ferry-link-$$
ip netns add "$ns"
trap 'ip netns del "$ns"' EXIT
ip -n "$ns" link set lo up
tc -n "$ns" qdisc add dev lo root tbf rate "$rate" burst 4mb latency 200ms
echo "tcp through loopback shaped to $rate ($(tc -n "$ns" qdisc show dev lo))" >&2
ip netns exec "$ns" "$ferry" bench e2e --delta --transport tcp "$@"
