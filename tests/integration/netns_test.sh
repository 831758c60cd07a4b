#!/usr/bin/env bash
# Two hosts emulated with network namespaces joined by a veth pair: a coordinator and a trainer on
# host A (10.77.0.1), a rollout rank on host B (10.77.0.2); one update over TRANSPORT (tcp or ucx).
# Exits 77 (skipped) where namespaces cannot be made (no root, no iproute2, a sandbox refusing them).
# usage: netns_test.sh FERRY_BIN FAULT_PEER_BIN TRANSPORT
set -u
ferry=$1 peer=$2 transport=$3
id=$$
a=ferry-a-$id b=ferry-b-$id
cleanup() {
  kill $coord_pid $rank_pid 2>/dev/null
  wait $coord_pid $rank_pid 2>/dev/null
  ip netns del "$a" 2>/dev/null
  ip netns del "$b" 2>/dev/null
}
coord_pid= rank_pid=
trap cleanup EXIT
command -v ip >/dev/null || exit 77
ip netns add "$a" 2>/dev/null || exit 77
ip netns add "$b" || exit 77
ip link add "va$id" type veth peer name "vb$id" || exit 77
ip link set "va$id" netns "$a" && ip link set "vb$id" netns "$b" || exit 77
ip -n "$a" addr add 10.77.0.1/24 dev "va$id" && ip -n "$b" addr add 10.77.0.2/24 dev "vb$id" || exit 77
ip -n "$a" link set "va$id" up && ip -n "$b" link set "vb$id" up || exit 77
ip -n "$a" link set lo up && ip -n "$b" link set lo up || exit 77

export FERRY_TRANSPORT=$transport FERRY_TIMEOUT_MS=10000
[ "$transport" = ucx ] && export UCX_TLS=${UCX_TLS:-tcp} UCX_NET_DEVICES=${UCX_NET_DEVICES:-all}
port=$((20000 + id % 20000))
FERRY_LISTEN_HOST=10.77.0.1 ip netns exec "$a" "$ferry" coordinator --port "$port" &
coord_pid=$!
# The rank retries until the coordinator listens (bounded).
for i in $(seq 1 50); do
  ip netns exec "$b" bash -c "exec 3<>/dev/tcp/10.77.0.1/$port" 2>/dev/null && break
  sleep 0.1
done
FERRY_LISTEN_HOST=10.77.0.2 ip netns exec "$b" "$peer" rollout "10.77.0.1:$port" 0 1 &
rank_pid=$!
# The update starts once the rank has joined (bounded).
joined=0
for i in $(seq 1 100); do
  if ip netns exec "$a" "$ferry" status "10.77.0.1:$port" 2>/dev/null | grep -q " rollout "; then joined=1; break; fi
  sleep 0.1
done
[ $joined = 1 ] || { echo "the rank on host B never joined"; exit 1; }
# The trainer on host A sends a full update (stop-after beyond the tensor count: it never stops).
FERRY_LISTEN_HOST=10.77.0.1 timeout 60 ip netns exec "$a" "$peer" trainer "10.77.0.1:$port" 1 1000000
rc=$?
echo "update across namespaces over $transport: rc=$rc"
exit $rc
