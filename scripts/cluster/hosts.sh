#!/usr/bin/env bash
# Make the project's test hosts and a multi-node Slurm on them, for roving's cross-host tests.
#
#   bash scripts/cluster/hosts.sh            # make or mend every host, start what is missing
#   bash scripts/cluster/hosts.sh rv-h2 ...  # mend only these hosts (tests/support/helpers_hosts.py revive())
#   bash scripts/cluster/hosts.sh --down     # take every host down: the machine as it was before the first run
#
# Needs root. Names, addresses and paths come from hosts.env (tests/support/helpers_hosts.py reads the same file).
#
# * Hosts: a Linux bridge ($HOSTS_BRIDGE) in the root network namespace, holding $HOSTS_ROOT_ADDR (so the
#   root namespace, where pytest runs, is a host too), and one network namespace per host (the head host,
#   the compute hosts and a login host with no daemon), joined to the bridge by a veth pair: `ve-NAME` on
#   the bridge, `eth0` inside, `lo` up, the host's address. No default route inside: a host reaches the
#   test subnet and nothing else.
# * Slurm: a cluster apart from the single-node one of slurm.sh (own config $HOSTS_SLURM_CONF, own state
#   $HOSTS_SLURM_STATE): slurmctld inside the head host, one slurmd inside each compute host, each daemon
#   in its own UTS namespace with the host's name as hostname, real munge (its socket is a file, shared).
#   The daemons enter a host with `nsenter --net` (not `ip netns exec`, which remounts /sys: slurmd then
#   fails with "No filesystem mounted on /sys/fs/cgroup").
#
# Idempotent: a second run checks each piece and remakes only what is missing (a namespace, a link, an
# address, a dead daemon), brings up a link that was set down, and resumes a node Slurm marked down.
#
# What the hosts share and what they do not: loopback is per namespace (127.0.0.1 inside a host is that
# host's own; nothing in a host reaches the root namespace's 127.0.0.1), and so are abstract Unix sockets.
# The filesystem is one: /tmp, /run/munge and the working tree are the same in every host (as on a cluster
# with a shared filesystem); /dev/shm is each compute host's own for its Slurm jobs (a tmpfs per slurmd).
# `tc netem` does not work on these machines (the qdisc kind is unknown): links have no emulated delay.
. "$(dirname "${BASH_SOURCE[0]}")/../fail-loudly.sh"
HERE=$(cd "$(dirname "$0")" && pwd)
DOCKER_NETNS_DIR=${SETUP_DOCKER_NETNS:-/var/run/docker/netns}  # Docker's container namespaces (a check hides it)
# shellcheck source=hosts.env
. "$HERE/hosts.env"
CONF=$HOSTS_SLURM_CONF
STATE=$HOSTS_SLURM_STATE
HEAD_NAME=${HOSTS_HEAD%%:*}
HEAD_ADDR=${HOSTS_HEAD##*:}
COMPUTE=${HOSTS_COMPUTE//,/ }
ALL="$HOSTS_HEAD $COMPUTE $HOSTS_LOGIN"
DOWN=0
if [ "${1:-}" = --down ]; then DOWN=1; shift; fi
ONLY=" $* "

fail() { echo "hosts: $*" >&2; exit 1; }
wanted() { [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $1 "* ]]; }

[ "$(id -u)" = 0 ] || fail "must run as root (it makes network namespaces, a bridge and veth pairs)"

take_down() {
    # Everything a run made goes: the processes in each host (its daemons, their jobs), the namespaces, the
    # veth pairs, the bridge, the hosts' block in /etc/hosts, the multi-node Slurm's config and state.
    local h name p pids
    exec 9>/run/roving-hosts.lock
    flock -w 180 9 || fail "another hosts.sh has held /run/roving-hosts.lock for 180 s"
    for h in $ALL; do
        name=${h%%:*}
        pids=$(ip netns pids "$name" 2>/dev/null || true)
        # shellcheck disable=SC2086
        [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
        for _ in $(seq 50); do
            [ -z "$(ip netns pids "$name" 2>/dev/null || true)" ] && break
            sleep 0.1
        done
        [ ! -e "/run/netns/$name" ] || ip netns del "$name"
        ip link del "ve-$name" 2>/dev/null || true
    done
    ip link del "$HOSTS_BRIDGE" 2>/dev/null || true
    local BEGIN="# roving test hosts (scripts/cluster/hosts.sh)" END="# end of roving test hosts" others
    others=$(awk -v b="$BEGIN" -v e="$END" '$0 == b {on = 1} !on {print} $0 == e {on = 0}' /etc/hosts)
    printf '%s\n' "$others" > /etc/hosts  # in place: /etc/hosts may be a mount point
    rm -rf "$STATE" "$(dirname "$CONF")"
    for h in $ALL; do
        [ ! -e "/run/netns/${h%%:*}" ] || fail "the namespace ${h%%:*} is still there after ip netns del"
    done
    ! ip link show "$HOSTS_BRIDGE" >/dev/null 2>&1 || fail "the bridge $HOSTS_BRIDGE is still there"
    echo "hosts: down ($ALL; the bridge $HOSTS_BRIDGE; $STATE; $(dirname "$CONF"))"
}
if [ "$DOWN" = 1 ]; then
    [ "$ONLY" = "  " ] || fail "--down takes no host names: it takes every host down"
    take_down
    exit 0
fi
for name in $*; do
    [[ " $ALL " == *" $name:"* ]] || fail "no test host named '$name' (hosts.env: $ALL)"
done
if ! command -v ip >/dev/null || ! command -v nsenter >/dev/null || ! command -v unshare >/dev/null; then
    [ -n "${SETUP_APT_UPDATED:-}" ] || apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2 util-linux
fi
command -v slurmctld >/dev/null && command -v munged >/dev/null \
    || fail "Slurm and munge are not installed: run scripts/cluster/slurm.sh first (scripts/test.sh does)"
bash "$HERE/munge.sh"
# one run at a time (tests mend hosts with it, maybe from several test processes)
exec 9>/run/roving-hosts.lock
flock -w 180 9 || fail "another hosts.sh has held /run/roving-hosts.lock for 180 s"

# --- the network -----------------------------------------------------------------------------------
# the subnet must be ours alone: no route into it through any other device
other=$(ip -4 route show to match "${HOSTS_SUBNET%/*}" | grep -v '^default' | grep -v " dev $HOSTS_BRIDGE " || true)
[ -z "$other" ] || fail "the test subnet $HOSTS_SUBNET is already routed elsewhere: '$other'; change hosts.env"

# Fixed link addresses, made from the IP addresses: a host remade (its namespace lost) has the MAC it had,
# and the bridge keeps its own (a Linux bridge otherwise takes the lowest of its ports', which changes as
# ports come and go), so no neighbour cache is left pointing at an old MAC (seconds of silent loss).
mac() {  # KIND IP: 02:72:KIND and the IP's last three numbers (KIND: 62 bridge, 76 root end, 68 host end)
    local IFS=.
    # shellcheck disable=SC2086
    set -- "$1" $2
    printf '02:72:%s:%02x:%02x:%02x' "$1" "$3" "$4" "$5"
}
link_mac() {  # [-n NS] DEV MAC: set DEV's MAC when it differs
    local ns=()
    if [ "$1" = -n ]; then ns=(-n "$2"); shift 2; fi
    [[ "$(ip "${ns[@]}" link show dev "$1")" == *"link/ether $2 "* ]] || ip "${ns[@]}" link set dev "$1" address "$2"
}

ip link show "$HOSTS_BRIDGE" >/dev/null 2>&1 || ip link add "$HOSTS_BRIDGE" type bridge
link_mac "$HOSTS_BRIDGE" "$(mac 62 "$HOSTS_ROOT_ADDR")"
# (ip's output is read whole, then matched: with pipefail, `ip | grep -q` can fail when grep ends first)
[[ "$(ip -4 addr show dev "$HOSTS_BRIDGE")" == *"inet $HOSTS_ROOT_ADDR/$HOSTS_PREFIX "* ]] \
    || ip addr add "$HOSTS_ROOT_ADDR/$HOSTS_PREFIX" dev "$HOSTS_BRIDGE"
ip link set "$HOSTS_BRIDGE" up

remade=0
make_host() {  # NAME ADDR: the namespace, its veth pair on the bridge, lo and eth0 up with ADDR
    local name=$1 addr=$2 veth=ve-$1
    [ -e "/run/netns/$name" ] || { ip netns add "$name"; remade=1; }
    if ! ip -n "$name" link show eth0 >/dev/null 2>&1; then
        # a root end left from an earlier namespace of that name (deleted while processes held it) goes
        ip link del "$veth" 2>/dev/null || true
        ip link add "$veth" type veth peer name eth0 netns "$name"
    fi
    link_mac "$veth" "$(mac 76 "$addr")"
    link_mac -n "$name" eth0 "$(mac 68 "$addr")"
    ip link set "$veth" master "$HOSTS_BRIDGE"
    ip link set "$veth" up
    ip -n "$name" link set lo up
    [[ "$(ip -n "$name" -4 addr show dev eth0)" == *"inet $addr/$HOSTS_PREFIX "* ]] \
        || ip -n "$name" addr add "$addr/$HOSTS_PREFIX" dev eth0
    ip -n "$name" link set eth0 up
}

for h in $ALL; do wanted "${h%%:*}" && make_host "${h%%:*}" "${h##*:}"; done

stop_orphans() {
    # A host's namespace deleted while processes held it lives on without a link: a slurmd or a job's
    # slurmstepd there can reach no one (its node stays "completing"). Such namespaces are those of Slurm
    # processes in no namespace known here (the root's, /run/netns/*, Docker's); everything in them goes.
    # (one stat per file, each allowed to fail: on a first run there is no Docker, and its netns glob
    # matches nothing, which must not end the script under `set -e`)
    local known=" " p ns f orphans=""
    for f in /proc/$$/ns/net /run/netns/* "$DOCKER_NETNS_DIR"/*; do
        [ -e "$f" ] || continue
        ns=$(stat -L -c %i "$f" 2>/dev/null) && known="$known$ns "
    done
    for p in /proc/[0-9]*; do
        case "$(cat "$p/comm" 2>/dev/null)" in slurmd|slurmstepd|slurmctld) ;; *) continue;; esac
        ns=$(stat -L -c %i "$p/ns/net" 2>/dev/null) || continue
        [[ "$known" == *" $ns "* ]] || orphans="$orphans $ns "
    done
    [ -n "$orphans" ] || return 0
    for p in /proc/[0-9]*; do
        ns=$(stat -L -c %i "$p/ns/net" 2>/dev/null) || continue
        if [[ "$orphans" == *" $ns "* ]]; then
            echo "hosts: killing ${p#/proc/} ($(cat "$p/comm" 2>/dev/null)), left in a lost host namespace"
            kill -9 "${p#/proc/}" 2>/dev/null || true
        fi
    done
}
[ "$remade" = 0 ] || stop_orphans

# the hosts' names resolve everywhere (one /etc/hosts for all of them, as a cluster's DNS would)
BEGIN="# roving test hosts (scripts/cluster/hosts.sh)" END="# end of roving test hosts"
block=$(printf '%s\n' "$BEGIN"; for h in $ALL; do printf '%s %s\n' "${h##*:}" "${h%%:*}"; done; printf '%s\n' "$END")
current=$(awk -v b="$BEGIN" -v e="$END" '$0 == b {on = 1} on {print} $0 == e {on = 0}' /etc/hosts)
if [ "$current" != "$block" ]; then
    others=$(awk -v b="$BEGIN" -v e="$END" '$0 == b {on = 1} !on {print} $0 == e {on = 0}' /etc/hosts)
    printf '%s\n%s\n' "$others" "$block" > /etc/hosts  # in place: /etc/hosts may be a mount point
fi

# --- the multi-node Slurm ----------------------------------------------------------------------------
mkdir -p "$STATE/state" "$STATE/spool" "$(dirname "$CONF")"
MEM_MB=$(awk '/MemTotal/ {print int($2/1024)}' /proc/meminfo)
NODES=$(for h in $COMPUTE; do printf '%s,' "${h%%:*}"; done); NODES=${NODES%,}
new=$(mktemp)
trap 'rm -f "$new"' EXIT
{
    cat <<CONF
# Made by roving's scripts/cluster/hosts.sh: the multi-node test cluster on network namespaces.
ClusterName=roving-hosts
SlurmctldHost=$HEAD_NAME($HEAD_ADDR)
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd-%n.log
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
SlurmdTimeout=10
MessageTimeout=3
MpiDefault=none
KillWait=5
CONF
    for h in $COMPUTE; do
        echo "NodeName=${h%%:*} NodeAddr=${h##*:} CPUs=$HOSTS_NODE_CPUS RealMemory=$MEM_MB State=UNKNOWN"
    done
    # LLN: a job goes to the least loaded node, so that one-node jobs spread over the hosts
    echo "PartitionName=$HOSTS_SLURM_PARTITION Nodes=$NODES Default=YES MaxTime=INFINITE State=UP LLN=YES"
} > "$new"
conf_changed=0
if ! cmp -s "$new" "$CONF"; then cp "$new" "$CONF"; conf_changed=1; fi

in_host() {  # NAME COMM: true when a process named COMM runs in host NAME's network namespace
    local p
    for p in $(ip netns pids "$1" 2>/dev/null); do
        [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] && return 0
    done
    return 1
}

stop_stale() {  # PIDFILE NAME COMM: a daemon of that pid file outside host NAME (left from an old namespace)
    local pid
    pid=$(cat "$1" 2>/dev/null || true)
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$3" ] || return 0
    # the pid may have been reused since, even by the single-node cluster's daemon: ours name our config
    [[ "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" == *"-f $CONF "* ]] || return 0
    in_host "$2" "$3" && return 0
    kill -9 "$pid" 2>/dev/null || true
}

start_daemon() {  # NAME COMM ARGS...: start a daemon inside host NAME, with NAME as its hostname
    local name=$1; shift
    echo "hosts: starting $1 in $name"
    # The daemon forks into the background itself; its UTS and mount namespaces live on with it, and its
    # jobs inherit them: a hostname of the host's own, and a /dev/shm of its own (a tmpfs mounted in a
    # private mount namespace), as separate machines have (roving.shared writes data once per machine).
    nsenter --net="/run/netns/$name" unshare --uts --mount --propagation private \
        sh -c 'mount -t tmpfs -o mode=1777,size=2g "tmpfs-$0" /dev/shm && hostname "$0" && exec "$@"' "$name" "$@" \
        </dev/null >>"$STATE/start-$name.log" 2>&1 9>&- || fail "$1 did not start in $name; see $STATE/start-$name.log"
}

if [ "$conf_changed" = 1 ]; then
    # daemons running with an older config: start them afresh
    for h in $ALL; do
        for p in $(ip netns pids "${h%%:*}" 2>/dev/null); do
            case "$(cat "/proc/$p/comm" 2>/dev/null)" in slurmctld|slurmd) kill "$p" 2>/dev/null || true;; esac
        done
    done
    for _ in $(seq 50); do
        busy=0
        for h in $ALL; do in_host "${h%%:*}" slurmctld || in_host "${h%%:*}" slurmd && busy=1; done
        [ "$busy" = 0 ] && break; sleep 0.2
    done
fi

if wanted "$HEAD_NAME" && ! in_host "$HEAD_NAME" slurmctld; then
    stop_stale "$STATE/slurmctld.pid" "$HEAD_NAME" slurmctld
    start_daemon "$HEAD_NAME" slurmctld -f "$CONF"
fi
for h in $COMPUTE; do
    name=${h%%:*}
    if wanted "$name" && ! in_host "$name" slurmd; then
        stop_stale "$STATE/slurmd-$name.pid" "$name" slurmd
        start_daemon "$name" slurmd -f "$CONF" -N "$name"
    fi
done

export SLURM_CONF=$CONF
states() { timeout 5 sinfo -h -N -p "$HOSTS_SLURM_PARTITION" -o '%N %t' 2>/dev/null || true; }
for _ in $(seq 120); do
    out=$(states)
    ok=1
    [ -n "$out" ] || ok=0  # the controller does not answer (yet)
    for h in $COMPUTE; do
        name=${h%%:*}
        wanted "$name" || continue
        state=$(awk -v n="$name" '$1 == n {print $2}' <<<"$out")
        case "$state" in
            idle|mix|alloc) ;;
            # marked down or drained while it was away, and its slurmd answers again: back to service
            down|drain|drng|fail)
                ok=0; timeout 5 scontrol update nodename="$name" state=resume >/dev/null 2>&1 || true;;
            *) ok=0;;
        esac
    done
    if [ "$ok" = 1 ]; then
        echo "hosts: $HOSTS_BRIDGE $HOSTS_ROOT_ADDR; $ALL; Slurm (SLURM_CONF=$CONF): ${*:-$NODES} ready"
        exit 0
    fi
    sleep 0.5
done
echo "hosts: the multi-node Slurm's nodes did not all become idle; logs in $STATE" >&2
timeout 5 sinfo -N -l >&2 || true
tail -n 20 "$STATE"/slurmctld.log "$STATE"/slurmd-*.log "$STATE"/start-*.log >&2 || true
exit 1
