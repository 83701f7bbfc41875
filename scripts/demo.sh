#!/usr/bin/env bash
# Install roving, then run the main demo on the embedded local backend: evolution strategies solving
# gymnasium's Pendulum-v1 with a roving.Pool of one worker per CPU (under a minute on 2 cores). It reports
# when the policy first scores -250 or better over 20 evaluation episodes (solved; iteration 50 with the
# default seed), trains on to 120 iterations (about -165), then writes the learning curve.
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 examples/es.py --iterations 120 --plot es_pendulum.png
echo "learning curve: $(pwd)/es_pendulum.png"
