#!/usr/bin/env bash
# Start munged (Slurm's authentication) if it does not answer: a key, its folders, the daemon. Idempotent.
# Used by slurm.sh and hosts.sh; munge and Slurm must already be installed. Its socket is a file in
# /run/munge, so processes in the test hosts' network namespaces (hosts.sh) use the same daemon and key.
. "$(dirname "${BASH_SOURCE[0]}")/../fail-loudly.sh"
if [ "${1:-}" = --down ]; then  # munged stopped and its key removed, as before a first run
    pkill -x munged || true
    for _ in $(seq 100); do pgrep -x munged >/dev/null || break; sleep 0.1; done
    ! pgrep -x munged >/dev/null || { echo "munge: munged still running" >&2; exit 1; }
    rm -f /etc/munge/munge.key
    echo "munge: down (munged stopped, key removed)"
    exit 0
fi
if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then exit 0; fi
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge
munged --force
for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && exit 0; sleep 0.1; done
echo "munge: munged started but does not answer; see /var/log/munge/munged.log" >&2
exit 1
