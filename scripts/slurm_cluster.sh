#!/usr/bin/env bash
# A real single-node SLURM cluster on a Debian machine, for CI and the SLURM tests.
#
#   scripts/slurm_cluster.sh start | stop | status
#
# Run as root on a machine without systemd (a container / CI runner). `start` installs munge + slurmctld + slurmd +
# slurm-client when missing, writes /etc/slurm/slurm.conf for this one node, starts the three daemons directly and
# returns once the node accepts jobs; `stop` ends the daemons through their PID files; `status` prints the state and
# exits 0 only when the node is up and idle or allocated. Every command is idempotent.
#
# Why it is done this way (measured on Debian 12, SLURM 22.05):
# * Package install scripts try to start the services through invoke-rc.d; a /usr/sbin/policy-rc.d that exits 101
#   stops them (the daemons are started below, by PID file, not by an init system that is not there).
# * The node line takes Sockets/CoresPerSocket/ThreadsPerCore from `slurmd -C` and a RealMemory below MemTotal,
#   else slurmd registers with fewer resources than configured and the node is drained.
# * DefMemPerCPU keeps one job from taking the whole node's memory; MinJobAge=4 keeps `sbatch --wait` from polling
#   every 32 s; proctrack/linuxproc + task/none need no cgroups.
# * Daemons are stopped by PID (/run/slurm/*.pid, /run/munge/munged.pid), never by process name: other SLURM or
#   munge processes on the machine are not ours to end.
set -euo pipefail

SLURM_CONF=/etc/slurm/slurm.conf
RUN_DIR=/run/slurm
SLURMCTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"
MUNGED_PID=/run/munge/munged.pid
MUNGE_KEY=/etc/munge/munge.key
LOG_DIR=/var/log/slurm
PACKAGES=(munge slurmctld slurmd slurm-client)
START_DEADLINE_S="${SLURM_CLUSTER_START_DEADLINE_S:-60}"
STOP_DEADLINE_S=20
HEADROOM_MB=1024  # RealMemory = MemTotal - headroom: slurmd refuses a node configured above what it measures

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

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
  for f in "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" /var/log/munge/munged.log; do
    [ -f "$f" ] && { log "--- last lines of $f"; tail -n 20 "$f" >&2; }
  done
  return 0
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

write_slurm_conf() {
  local host mem_total_mb real_mem_mb hardware
  host="$(hostname -s)"
  mem_total_mb=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
  real_mem_mb=$((mem_total_mb - HEADROOM_MB))
  ((real_mem_mb > 0)) || die "MemTotal ${mem_total_mb} MB leaves no memory for jobs"
  hardware="$(node_hardware)"
  [ -n "$hardware" ] || die "could not read the node's CPU layout from 'slurmd -C'"
  mkdir -p /etc/slurm
  cat >"$SLURM_CONF.new" <<EOF
# Written by scripts/slurm_cluster.sh: a single-node test cluster on $host.
ClusterName=dapo-test
SlurmctldHost=${host}(127.0.0.1)
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
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
NodeName=${host} NodeAddr=127.0.0.1 ${hardware}RealMemory=${real_mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$SLURM_CONF.new" "$SLURM_CONF"
}

prepare_dirs() {
  mkdir -p "$RUN_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd /run/munge /var/log/munge /var/lib/munge
  chown slurm:slurm "$RUN_DIR" "$LOG_DIR" /var/spool/slurmctld
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  chmod 0755 /run/munge
  if [ ! -s "$MUNGE_KEY" ]; then
    mungekey --create --keyfile="$MUNGE_KEY"
  fi
  chown munge:munge "$MUNGE_KEY"
  chmod 0400 "$MUNGE_KEY"
}

# ---- daemons ---------------------------------------------------------------------------------------------------

node_ready() {  # the node takes jobs: idle, or already running some (allocated / mixed)
  local state
  state="$(sinfo -h -N -o %t 2>/dev/null | head -n 1)"
  [[ "$state" =~ ^(idle|alloc|mix)$ ]]
}

node_ready_or_resume() {  # as node_ready, but first return a drained/down node (stale state from an earlier run)
  local state
  state="$(sinfo -h -N -o %t 2>/dev/null | head -n 1)"
  if [[ "$state" =~ ^(drain|drng|down|fail)\*?$ ]]; then
    scontrol update NodeName="$(hostname -s)" State=RESUME 2>/dev/null || true
  fi
  node_ready
}

munge_works() { munge -n | unmunge; }
controller_up() { scontrol ping | grep -q UP; }

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

  if ! pid_alive "$SLURMD_PID"; then
    /usr/sbin/slurmd
  fi
  wait_until "$START_DEADLINE_S" "sinfo to show the node idle" node_ready_or_resume \
    || { sinfo -N -l >&2 || true; show_logs; die "the node did not become idle"; }
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
  if pid_alive "$SLURMCTLD_PID" && pid_alive "$SLURMD_PID" && pid_alive "$MUNGED_PID" && node_ready; then
    log "already up"
    return 0
  fi
  local t0=$SECONDS
  install_packages
  if ! pid_alive "$SLURMCTLD_PID" && ! pid_alive "$SLURMD_PID"; then
    write_slurm_conf  # only while no daemon reads it: a running cluster keeps the configuration it started with
  fi
  prepare_dirs
  start_daemons
  log "up in $((SECONDS - t0))s: $(sinfo -h -N -o '%N %t cpus=%c mem=%m')"
}

cmd_stop() {
  stop_daemon slurmd "$SLURMD_PID"
  stop_daemon slurmctld "$SLURMCTLD_PID"
  stop_daemon munged "$MUNGED_PID"
}

cmd_status() {
  local name pidfile up=1
  for name in munged slurmctld slurmd; do
    case "$name" in
      munged) pidfile="$MUNGED_PID" ;;
      slurmctld) pidfile="$SLURMCTLD_PID" ;;
      slurmd) pidfile="$SLURMD_PID" ;;
    esac
    if pid_alive "$pidfile"; then
      echo "$name: running (pid $(cat "$pidfile"))"
    else
      echo "$name: stopped"
      up=0
    fi
  done
  if ((up)) && node_ready; then
    echo "node: $(sinfo -h -N -o '%N %t cpus=%c mem=%m')"
    return 0
  fi
  echo "cluster: not ready"
  return 1
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2
    ;;
esac
