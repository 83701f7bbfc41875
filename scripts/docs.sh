#!/usr/bin/env bash
# Serve the documentation site at http://127.0.0.1:8000, rebuilt on each change (MkDocs, mkdocs.yml).
# The packages are in pyproject.toml's dev extra (scripts/install.sh installs them). Arguments go to
# `mkdocs serve` (e.g. --dev-addr 127.0.0.1:8001).
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m mkdocs serve --strict "$@"
