#!/usr/bin/env bash
# Install what the tests need, start the cluster software they run against (a single-node Slurm, the test
# hosts with a multi-node Slurm on them, and a Docker engine, all real), then run the whole test suite.
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
# jargon-text: the Jargon File, public-domain English prose for the SkipPipe training tests' corpus
if ! command -v slurmctld >/dev/null || ! command -v dockerd >/dev/null || ! dpkg -s jargon-text >/dev/null 2>&1 \
        || ! command -v ip >/dev/null || ! command -v nsenter >/dev/null || ! command -v tcpdump >/dev/null \
        || ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge docker.io jargon-text iproute2 util-linux tcpdump chromium chromium-driver
fi
export SETUP_APT_UPDATED=1
bash scripts/install.sh
bash scripts/lint.sh  # ruff and mypy (their rules: pyproject.toml), before anything starts
# slurm.sh, hosts.sh and docker.sh, each run from nothing and then once more (the first-run path, checked)
bash scripts/check-first-run.sh
python3 -m pytest -q -p no:cacheprovider tests
# the version-sensitive tests on each other CPython 3.10-3.13 found here (nothing when there are none)
bash scripts/test-pythons.sh
