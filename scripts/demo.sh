#!/usr/bin/env bash
# Install roving, then run the main demo on the embedded local backend.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 examples/demo.py
