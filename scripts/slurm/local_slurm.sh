#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, to test agentstream.sbatch without a real cluster (run as root).
#   eval "$(scripts/slurm/local_slurm.sh [DIR])"     # start (idempotent); prints `export SLURM_CONF=DIR/slurm.conf`
#   scripts/slurm/local_slurm.sh stop [DIR]           # ends the daemons this script started (pids kept in DIR)
# DIR (default /tmp/agentstream-slurm) holds the config, state, spool, logs and pids: nothing outside it is
# touched except munge's key and socket, which every Slurm daemon of the machine shares.
set -euo pipefail

cmd=start
if [ "${1:-}" = stop ] || [ "${1:-}" = start ]; then cmd=$1; shift; fi
dir=$(realpath -m "${1:-/tmp/agentstream-slurm}")
conf=$dir/slurm.conf
log() { echo "local_slurm: $*" >&2; }   # stdout is kept for the `export` line (eval-able)

alive() { [ -f "$dir/$1.pid" ] && kill -0 "$(cat "$dir/$1.pid")" 2>/dev/null; }

stop() {
  # Only our own pids: another Slurm or munged on the machine (another test) is left alone.
  for d in slurmd slurmctld munged; do
    if alive "$d"; then
      pid=$(cat "$dir/$d.pid"); kill "$pid"
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
      log "stopped $d ($pid)"
    fi
    rm -f "$dir/$d.pid"
  done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null; then
  log "installing slurm-wlm (Debian package: slurmctld, slurmd, munge)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm >&2
fi

export SLURM_CONF=$conf
if alive slurmctld && alive slurmd && sinfo -h >/dev/null 2>&1; then   # already running: nothing to do
  echo "export SLURM_CONF=$conf"; exit 0
fi
stop   # a half-started earlier attempt
mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/run"

# munge authenticates every Slurm message. One munged per machine serves all: reuse a running one.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  chown munge: /run/munge /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
    else create-munge-key -f; fi
    chown munge: /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  fi
  runuser -u munge -- munged   # forks into the background and writes its pid file
  for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$dir/munged.pid"
  log "started munged ($(cat "$dir/munged.pid"))"
fi

# Free ports now (another Slurm on the machine may hold the default 6817/6818).
read -r ctld_port d_port < <(python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')
cat >"$conf" <<EOF
# Written by scripts/slurm/local_slurm.sh: a one-node test cluster.
ClusterName=agentstream
SlurmctldHost=localhost
SlurmctldPort=$ctld_port
SlurmdPort=$d_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF

# -D: in the foreground, so that $! is the daemon itself (its pid, kept in DIR, is what `stop` ends; the daemons'
# own pid files are in DIR/run); -i: ignore state left by an earlier instance.
slurmctld -D -i -f "$conf" >>"$dir/log/slurmctld.out" 2>&1 &
echo $! >"$dir/slurmctld.pid"
slurmd -D -N localhost -f "$conf" >>"$dir/log/slurmd.out" 2>&1 &
echo $! >"$dir/slurmd.pid"

for _ in $(seq 300); do
  state=$(sinfo -h -n localhost -o %t 2>/dev/null || true)
  if [ "$state" = idle ]; then
    log "node idle (slurmctld $(cat "$dir/slurmctld.pid"), slurmd $(cat "$dir/slurmd.pid"), ports $ctld_port/$d_port)"
    echo "export SLURM_CONF=$conf"; exit 0
  fi
  sleep 0.1
done
log "the node did not become idle in 30 s (state '${state:-?}'); see $dir/log"; stop; exit 1
