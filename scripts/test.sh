#!/usr/bin/env bash
# Install what the tests need, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -q -p no:cacheprovider tests
