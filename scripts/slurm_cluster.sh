#!/usr/bin/env bash
# A real SLURM cluster on one Debian machine, for CI and the SLURM tests: one node, or several "nodes" in network
# namespaces.
#
#   scripts/slurm_cluster.sh start [--nodes N] | stop | status
#
# Run as root on a machine without systemd (a container / CI runner). `start` installs munge + slurmctld + slurmd +
# slurm-client when missing, writes /etc/slurm/slurm.conf, starts the daemons directly and returns once every node
# accepts jobs; `stop` ends the daemons through their PID files and removes every namespace, link and process the
# multi-node mode made; `status` prints the state and exits 0 only when every node is up and idle or allocated.
# Every command is idempotent. `start` of one layout while the other runs is refused (run `stop` first).
#
# Layouts:
# * default: one node, this machine (its hostname, 127.0.0.1, all its CPUs), every daemon in the root namespace.
# * --nodes N (N >= 2): nodes node1..nodeN, each in its own network namespace (scripts/netns_nodes.sh)
#   with address 10.77.0.i on a bridge and its own hostname; slurmctld stays in the root namespace on 10.77.0.254,
#   where jobs are submitted from. Every node has this machine's CPU count (they share its cores: a job may put
#   as many tasks on one node as on the single node) and an Nth of its memory. One slurmd per node with its own
#   NodeName/NodeAddr, spool, PID file and log
#   (/var/spool/slurmd/nodeI, /run/slurm/slurmd-nodeI.pid, /var/log/slurm/slurmd-nodeI.log). The nodes share the
#   filesystem, so a run directory anywhere is the cluster's shared filesystem. Node names do not resolve in DNS
#   (/etc/hosts is not touched): job scripts address nodes by their NodeAddr, as slurm/launch_plan.py does.
#
# Why it is done this way (measured on Debian 12, SLURM 22.05):
# * Package install scripts try to start the services through invoke-rc.d; a /usr/sbin/policy-rc.d that exits 101
#   stops them (the daemons are started below, by PID file, not by an init system that is not there).
# * The single node's line takes Sockets/CoresPerSocket/ThreadsPerCore from `slurmd -C` and a RealMemory below
#   MemTotal, else slurmd registers with fewer resources than configured and the node is drained.
# * DefMemPerCPU keeps one job from taking the whole node's memory; MinJobAge=4 keeps `sbatch --wait` from polling
#   every 32 s; proctrack/linuxproc + task/none need no cgroups.
# * A namespace node's slurmd is started with nsenter + unshare --uts, not `ip netns exec` (which remounts /sys and
#   hides the cgroup mounts slurmd initializes from).
# * Daemons are stopped by PID (/run/slurm/*.pid, /run/munge/munged.pid), never by process name: other SLURM or
#   munge processes on the machine are not ours to end. Processes left inside our namespaces (steps of jobs that
#   outlived their slurmd) are ours: `stop` ends them by PID before deleting the namespaces.
set -euo pipefail

SLURM_CONF=/etc/slurm/slurm.conf
RUN_DIR=/run/slurm
LAYOUT_FILE="$RUN_DIR/layout"  # "single" or "nodes=N": what the running cluster is, for status/stop/start
SLURMCTLD_PID="$RUN_DIR/slurmctld.pid"
SINGLE_SLURMD_PID="$RUN_DIR/slurmd.pid"
MUNGED_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
PACKAGES=(munge slurmctld slurmd slurm-client)
START_DEADLINE_S="${SLURM_CLUSTER_START_DEADLINE_S:-60}"
STOP_DEADLINE_S=20
HEADROOM_MB=1024  # RealMemory = MemTotal - headroom: slurmd refuses a node configured above what it measures
MAX_NODES=200     # node addresses 10.77.0.1..N; .254 is the controller

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

# shellcheck source=netns_nodes.sh
source "$(dirname "${BASH_SOURCE[0]}")/netns_nodes.sh"

# ---- helpers ---------------------------------------------------------------------------------------------------

pid_alive() {  # pid_alive PIDFILE: the process named in PIDFILE is running
  local pid
  [ -s "$1" ] || return 1
  pid="$(cat "$1")"
  [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null
}

wait_until() {  # wait_until DEADLINE_S WHAT COMMAND...: poll COMMAND every 0.5 s until it succeeds or time is up
  local deadline_s="$1" what="$2"
  shift 2
  local end=$((SECONDS + deadline_s))
  until "$@" >/dev/null 2>&1; do
    if ((SECONDS >= end)); then
      log "timed out after ${deadline_s}s waiting for: $what"
      return 1
    fi
    sleep 0.5
  done
}

show_logs() {
  local f
  for f in "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd*.log /var/log/munge/munged.log; do
    [ -f "$f" ] && { log "--- last lines of $f"; tail -n 20 "$f" >&2; }
  done
  return 0
}

set_layout() {  # set_layout [N]: LAYOUT ("single" / "nodes=N") and NODE_COUNT (0 = the single node) of this call
  if [ -z "${1:-}" ]; then
    LAYOUT=single
    NODE_COUNT=0
    return
  fi
  [[ "$1" =~ ^[0-9]+$ ]] && (($1 >= 2 && $1 <= MAX_NODES)) \
    || die "--nodes takes a node count from 2 to $MAX_NODES, got '$1' (omit it for the single-node cluster)"
  LAYOUT="nodes=$1"
  NODE_COUNT="$1"
}

running_layout() { if [ -s "$LAYOUT_FILE" ]; then cat "$LAYOUT_FILE"; else echo none; fi; }

slurmd_pidfile() {  # slurmd_pidfile I: node I's slurmd (0: the single node's)
  if (($1 == 0)); then echo "$SINGLE_SLURMD_PID"; else echo "$RUN_DIR/slurmd-node$1.pid"; fi
}

node_indices() { if ((NODE_COUNT == 0)); then echo 0; else seq 1 "$NODE_COUNT"; fi; }

node_name() { if (($1 == 0)); then hostname -s; else echo "node$1"; fi; }

all_daemons_alive() {
  local i
  pid_alive "$MUNGED_PID" && pid_alive "$SLURMCTLD_PID" || return 1
  for i in $(node_indices); do pid_alive "$(slurmd_pidfile "$i")" || return 1; done
}

any_slurm_daemon_alive() {
  local f
  pid_alive "$SLURMCTLD_PID" && return 0
  for f in "$SINGLE_SLURMD_PID" "$RUN_DIR"/slurmd-node*.pid; do pid_alive "$f" && return 0; done
  return 1
}

# ---- install ---------------------------------------------------------------------------------------------------

install_packages() {
  local missing=() p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  ((${#missing[@]} == 0)) && return 0
  log "installing ${missing[*]}"
  local made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    made_policy=1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  ((made_policy)) && rm -f /usr/sbin/policy-rc.d
  return 0
}

# ---- configuration ---------------------------------------------------------------------------------------------

node_hardware() {  # the Sockets/CoresPerSocket/ThreadsPerCore words of `slurmd -C`'s node line
  slurmd -C | head -n 1 | tr ' ' '\n' | grep -E '^(Sockets|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' \
    | sed 's/^SocketsPerBoard=/Sockets=/' | tr '\n' ' '
}

node_lines() {  # node_lines HOST REAL_MEM_MB: the NodeName and PartitionName lines of this layout
  local host="$1" real_mem_mb="$2" i hardware
  if ((NODE_COUNT == 0)); then
    hardware="$(node_hardware)"
    [ -n "$hardware" ] || die "could not read the node's CPU layout from 'slurmd -C'"
    echo "NodeName=${host} NodeAddr=127.0.0.1 ${hardware}RealMemory=${real_mem_mb} State=UNKNOWN"
    echo "PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP"
    return
  fi
  # The nodes share the machine's memory: each gets its part, so that together they stay below MemTotal.
  # Each node offers all the machine's CPUs. `nproc` alone would honour OMP_NUM_THREADS (the test script sets it
  # to 1), which left one CPU per node and refused every two-task job.
  local cpus
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
  for i in $(node_indices); do
    echo "NodeName=node$i NodeAddr=$(node_addr "$i") CPUs=${cpus} RealMemory=$((real_mem_mb / NODE_COUNT))" \
      "State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=node[1-$NODE_COUNT] Default=YES MaxTime=INFINITE State=UP"
}

write_slurm_conf() {
  local host mem_total_mb real_mem_mb controller_addr spool pidfile slurmd_log
  host="$(hostname -s)"
  mem_total_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
  real_mem_mb=$((mem_total_mb - HEADROOM_MB))
  ((real_mem_mb > 0)) || die "MemTotal ${mem_total_mb} MB leaves no memory for jobs"
  if ((NODE_COUNT == 0)); then
    controller_addr=127.0.0.1 spool=/var/spool/slurmd pidfile="$SINGLE_SLURMD_PID" slurmd_log="$LOG_DIR/slurmd.log"
  else
    controller_addr="$CONTROLLER_ADDR" spool=/var/spool/slurmd/%n pidfile="$RUN_DIR/slurmd-%n.pid"
    slurmd_log="$LOG_DIR/slurmd-%n.log"
  fi
  mkdir -p /etc/slurm
  cat >"$SLURM_CONF.new" <<CONF
# Written by scripts/slurm_cluster.sh: a test cluster on $host, layout $LAYOUT.
ClusterName=dapo-test
SlurmctldHost=${host}(${controller_addr})
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$spool
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$pidfile
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$slurmd_log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
MinJobAge=4
KillWait=5
$(node_lines "$host" "$real_mem_mb")
CONF
  if ! grep -q "layout $LAYOUT\.\$" "$SLURM_CONF" 2>/dev/null; then
    # The controller's saved jobs and nodes belong to another layout: start from a clean state.
    rm -rf "${STATE_DIR:?}"/*
  fi
  mv "$SLURM_CONF.new" "$SLURM_CONF"
}

prepare_dirs() {
  local i
  mkdir -p "$RUN_DIR" "$LOG_DIR" "$STATE_DIR" /var/spool/slurmd /run/munge /var/log/munge /var/lib/munge
  for i in $(node_indices); do
    if ((i > 0)); then mkdir -p "/var/spool/slurmd/node$i"; fi
  done
  chown slurm:slurm "$RUN_DIR" "$LOG_DIR" "$STATE_DIR"
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s "$MUNGE_KEY" ]; then
    mungekey --create --keyfile="$MUNGE_KEY"
  fi
  chown munge:munge "$MUNGE_KEY"
  chmod 0400 "$MUNGE_KEY"
}

# ---- daemons ---------------------------------------------------------------------------------------------------

nodes_ready() {  # every node takes jobs: idle, or already running some (allocated / mixed)
  local states
  states="$(sinfo -h -N -o %t 2>/dev/null)" || return 1
  [ -n "$states" ] && ! grep -qvE '^(idle|alloc|mix)$' <<<"$states"
}

nodes_ready_or_resume() {  # as nodes_ready, but first return drained/down nodes (stale state from an earlier run)
  local node state
  while read -r node state; do
    if [[ "$state" =~ ^(drain|drng|down|fail)\*?$ ]]; then
      scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
    fi
  done < <(sinfo -h -N -o '%N %t' 2>/dev/null)
  nodes_ready
}

munge_works() { munge -n | unmunge; }
controller_up() { scontrol ping | grep -q UP; }

start_slurmd() {  # start_slurmd I
  local i="$1"
  pid_alive "$(slurmd_pidfile "$i")" && return 0
  if ((i == 0)); then
    /usr/sbin/slurmd
  else
    run_on_node "$i" /usr/sbin/slurmd -N "node$i"
  fi
}

start_daemons() {
  if ! pid_alive "$MUNGED_PID"; then
    runuser -u munge -- /usr/sbin/munged
  fi
  wait_until 15 "munge -n | unmunge" munge_works || { show_logs; die "munged did not come up"; }

  if ! pid_alive "$SLURMCTLD_PID"; then
    /usr/sbin/slurmctld
  fi
  wait_until "$START_DEADLINE_S" "scontrol ping to report UP" controller_up \
    || { show_logs; die "slurmctld did not come up"; }

  local i
  for i in $(node_indices); do start_slurmd "$i"; done
  wait_until "$START_DEADLINE_S" "sinfo to show every node idle" nodes_ready_or_resume \
    || { sinfo -N -l >&2 || true; show_logs; die "the nodes did not become idle (run '$0 stop' to clean up)"; }
}

stop_daemon() {  # stop_daemon NAME PIDFILE: SIGTERM, wait for exit, SIGKILL after the deadline
  local name="$1" pidfile="$2" pid end
  pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid="$(cat "$pidfile")"
  kill -TERM "$pid"
  end=$((SECONDS + STOP_DEADLINE_S))
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS >= end)); then
      log "$name (pid $pid) still running after ${STOP_DEADLINE_S}s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.2
  done
  rm -f "$pidfile"
  log "stopped $name (pid $pid)"
}

# ---- commands --------------------------------------------------------------------------------------------------

cmd_start() {
  [ "$(id -u)" = 0 ] || die "must run as root (it installs packages and starts system daemons)"
  ((NODE_COUNT == 0)) || require_netns_support
  local running
  running="$(running_layout)"
  if any_slurm_daemon_alive && [ "$running" != "$LAYOUT" ]; then
    die "a cluster with layout '$running' is running; run '$0 stop' before starting layout '$LAYOUT'"
  fi
  if all_daemons_alive && nodes_ready; then
    log "already up ($LAYOUT)"
    return 0
  fi
  local t0=$SECONDS
  install_packages
  if ! any_slurm_daemon_alive; then
    write_slurm_conf  # only while no daemon reads it: a running cluster keeps the configuration it started with
  fi
  prepare_dirs
  echo "$LAYOUT" >"$LAYOUT_FILE"
  ((NODE_COUNT == 0)) || make_nodes "$NODE_COUNT"
  start_daemons
  log "up in $((SECONDS - t0))s ($LAYOUT): $(sinfo -h -N -o '%N %t cpus=%c mem=%m' | paste -sd ';')"
}

cmd_stop() {
  local f
  for f in "$SINGLE_SLURMD_PID" "$RUN_DIR"/slurmd-node*.pid; do
    if [ -e "$f" ]; then stop_daemon "$(basename "$f" .pid | tr '-' ' ')" "$f"; fi
  done
  stop_daemon slurmctld "$SLURMCTLD_PID"
  stop_daemon munged "$MUNGED_PID"
  remove_nodes
  rm -f "$LAYOUT_FILE"
}

report_daemon() {  # report_daemon NAME PIDFILE: one status line; fails when the daemon is not running
  if pid_alive "$2"; then echo "$1: running (pid $(cat "$2"))"; else echo "$1: stopped"; return 1; fi
}

cmd_status() {
  local running up=1 i
  running="$(running_layout)"
  echo "layout: $running"
  if [ "$running" = none ]; then
    echo "cluster: not started"
    return 1
  fi
  if [ "$running" = single ]; then set_layout; else set_layout "${running#nodes=}"; fi
  report_daemon munged "$MUNGED_PID" || up=0
  report_daemon slurmctld "$SLURMCTLD_PID" || up=0
  for i in $(node_indices); do report_daemon "slurmd $(node_name "$i")" "$(slurmd_pidfile "$i")" || up=0; done
  if ((up)) && nodes_ready; then
    sinfo -h -N -o 'node: %N %t cpus=%c mem=%m'
    return 0
  fi
  echo "cluster: not ready"
  return 1
}

usage() {
  echo "usage: $0 start [--nodes N] | stop | status" >&2
  exit 2
}

command="${1:-}"
(($#)) && shift
nodes_arg=""
while (($#)); do
  case "$1" in
    --nodes) (($# >= 2)) || usage; nodes_arg="$2"; shift 2 ;;
    --nodes=*) nodes_arg="${1#*=}"; shift ;;
    *) usage ;;
  esac
done
case "$command" in
  start) set_layout "$nodes_arg"; cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) usage ;;
esac
