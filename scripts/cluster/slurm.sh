#!/usr/bin/env bash
# Install and start a single-node Slurm cluster (munged, slurmctld, slurmd from Debian's packages) for
# roving's slurm backend tests. Idempotent: when the node already answers, it only checks it.
# No systemd, no cgroups: every daemon runs as root in the background, state under $STATE.
# The node is oversubscribed (more CPUs configured than the machine has) so that tests can run more
# one-CPU jobs at once than there are cores.
. "$(dirname "${BASH_SOURCE[0]}")/../fail-loudly.sh"
STATE=${SETUP_SLURM_STATE:-/var/lib/roving-slurm}
CONF=/etc/slurm/slurm.conf
CPUS=${SETUP_SLURM_CPUS:-32}
HOST=$(hostname -s)

if [ "${1:-}" = --down ]; then
    # the daemons of this network namespace (hosts.sh runs others in the test hosts'), the config, the state;
    # the pattern is under 16 characters: pgrep says a longer one can match no process name whenever none matches
    pkill --ns $$ --nslist net -x 'slurm(ctld|d)' || true
    for _ in $(seq 100); do
        pgrep --ns $$ --nslist net -x 'slurm(ctld|d)' >/dev/null || break
        sleep 0.1
    done
    ! pgrep --ns $$ --nslist net -x 'slurm(ctld|d)' >/dev/null || { echo "slurm: daemons still running" >&2; exit 1; }
    rm -rf "$STATE" "$CONF"
    echo "slurm: down (daemons stopped; $STATE and $CONF removed)"
    exit 0
fi

ready() {
    timeout 5 sinfo -h -N -n "$HOST" -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

if command -v sinfo >/dev/null && ready; then
    echo "slurm: already running"; exit 0
fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ -n "${SETUP_APT_UPDATED:-}" ] || apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
fi

bash "$(dirname "$0")/munge.sh"

mkdir -p "$STATE/state" "$STATE/spool" /etc/slurm
MEM_MB=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
cat > "$CONF" <<CONF
ClusterName=roving
SlurmctldHost=$HOST(127.0.0.1)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF

# only daemons in this network namespace count: hosts.sh runs others inside the test hosts' namespaces
pgrep --ns $$ --nslist net -x slurmctld >/dev/null || slurmctld -f "$CONF"
pgrep --ns $$ --nslist net -x slurmd >/dev/null || slurmd -f "$CONF"
for _ in $(seq 120); do
    if ready; then echo "slurm: node $HOST up ($CPUS CPUs configured, ${MEM_MB} MB)"; exit 0; fi
    sleep 0.5
done
echo "slurm: the node did not become idle; logs in $STATE" >&2
sinfo -N -l >&2 || true
tail -20 "$STATE/slurmctld.log" "$STATE/slurmd.log" >&2 || true
exit 1
