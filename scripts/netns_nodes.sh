# "Nodes" on one machine: a Linux bridge in the root network namespace and one network namespace per node, each
# with its own address on the bridge. Sourced by scripts/slurm_cluster.sh (multi-node mode); needs root and iproute2.
#
#   node i (1..N): namespace dapo-node$i, interface eth0 = $NODE_NET.$i/24, hostname node$i (set by the daemon
#   started in it, through its own UTS namespace); the root namespace is $NODE_NET.254 on bridge $BRIDGE.
#
# The namespaces share this machine's filesystem (munge's socket, the venv, a "shared" run directory) and its PID
# space, so every process of every node is visible in /proc. Traffic stays on the bridge: nothing is routed out.

NODE_NET=10.77.0
CONTROLLER_ADDR="$NODE_NET.254"
BRIDGE=dapo-br0
NETNS_PREFIX=dapo-node

node_netns() { echo "$NETNS_PREFIX$1"; }
node_addr() { echo "$NODE_NET.$1"; }

our_namespaces() {  # the namespaces this script made (from an earlier start too), one per line
  ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${NETNS_PREFIX}[0-9]+$" || true
}

require_netns_support() {  # a clear error up front instead of a half-built network (the caller checked root)
  local tool
  for tool in ip nsenter unshare; do
    command -v "$tool" >/dev/null || die "'$tool' is not installed (apt-get install iproute2 util-linux)"
  done
  local probe="${NETNS_PREFIX}probe$$"
  if ! timeout 10 ip netns add "$probe" 2>/dev/null; then
    die "cannot create a network namespace here ('ip netns add' failed: no CAP_SYS_ADMIN, or a kernel without" \
      "network namespaces); use the single-node mode"
  fi
  ip netns del "$probe"
}

make_nodes() {  # make_nodes N: bridge + N namespaces wired to it; idempotent per piece
  local n="$1" i ns
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge || die "cannot create the bridge $BRIDGE (kernel without bridge support?)"
    ip addr add "$CONTROLLER_ADDR/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  for ((i = 1; i <= n; i++)); do
    ns="$(node_netns "$i")"
    ip netns list | awk '{print $1}' | grep -qx "$ns" || ip netns add "$ns"
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip link del "dapo-veth$i" 2>/dev/null || true  # a root end left from a half-finished start
      ip link add "dapo-veth$i" type veth peer name eth0 netns "$ns"
      ip link set "dapo-veth$i" master "$BRIDGE" up
      ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
    fi
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
}

run_on_node() {  # run_on_node I COMMAND...: COMMAND in node I's network namespace, with hostname node$I
  # nsenter, not `ip netns exec`: the latter remounts /sys for the namespace, which hides this machine's cgroup
  # mounts, and slurmd then fails to initialize its cgroup plugin.
  local i="$1"
  shift
  nsenter --net="/run/netns/$(node_netns "$i")" unshare --uts sh -c 'hostname "$0" && exec "$@"' "node$i" "$@"
}

kill_namespace_processes() {  # kill_namespace_processes NS: SIGTERM, then SIGKILL after a deadline, by PID
  local ns="$1" pids end
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [ -n "${pids// /}" ] || return 0
  log "ending processes left in $ns: $pids"
  kill -TERM $pids 2>/dev/null || true
  end=$((SECONDS + STOP_DEADLINE_S))
  while [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && ((SECONDS < end)); do sleep 0.2; done
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
  [ -n "${pids// /}" ] && kill -KILL $pids 2>/dev/null || true
  return 0
}

remove_nodes() {  # every namespace, veth and the bridge this script made; idempotent
  local ns link
  for ns in $(our_namespaces); do
    kill_namespace_processes "$ns"
    ip netns del "$ns" || log "could not delete namespace $ns"
  done
  for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^dapo-veth[0-9]+$'); do
    ip link del "$link" 2>/dev/null || true
  done
  if ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link del "$BRIDGE" || log "could not delete bridge $BRIDGE"
  fi
  return 0
}
