#!/usr/bin/env bash
# The test setup's first run, proven on every test run (scripts/test.sh runs this in place of the setup
# scripts themselves): every piece is taken down to the state of a fresh machine that has the packages but
# nothing set up (no munged and no key, no Slurm daemons or state, no test hosts, no Docker engine, image or
# network), then made in the order a first run makes them, with Docker's namespace folder hidden from
# hosts.sh (on a fresh machine it does not exist yet: that once ended hosts.sh silently), then made again:
# the second run of each script must find everything there and change nothing.
#
#   bash scripts/check-first-run.sh      # as root; leaves Slurm, the test hosts and Docker running
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
C=scripts/cluster
say() { echo "first-run check: $*"; }
fail() { echo "first-run check: $*" >&2; exit 1; }

say "taking every piece down"
bash $C/hosts.sh --down
bash $C/slurm.sh --down
bash $C/docker.sh --down
bash $C/munge.sh --down
[ ! -e /var/run/docker/netns ] || [ -z "$(ls -A /var/run/docker/netns)" ] \
    || say "(Docker's netns folder still holds $(ls /var/run/docker/netns | wc -l) entries; hidden below)"

say "first run"
bash $C/slurm.sh
SETUP_DOCKER_NETNS=/nonexistent/roving-first-run-check bash $C/hosts.sh
bash $C/docker.sh

say "second run (must change nothing)"
out=$( { bash $C/slurm.sh && bash $C/hosts.sh && bash $C/docker.sh; } 2>&1) || { echo "$out" >&2; fail "a second run failed"; }
echo "$out"
[[ "$out" == *"slurm: already running"* ]] || fail "slurm.sh's second run did not find the node running"
for made in "hosts: starting" "docker: built image" "docker: made network" "making it anew"; do
    [[ "$out" != *"$made"* ]] || fail "a second run remade something: '$made'"
done
say "passed: every piece made on its first run from nothing, and left as it was by its second"
