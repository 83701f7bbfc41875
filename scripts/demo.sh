#!/usr/bin/env bash
# Install roving, then run the main demo on the embedded local backend: evolution strategies solving
# gymnasium's Pendulum-v1 with a roving.Pool of one worker per CPU (about a minute on 2 cores; it stops
# once the policy scores -250 or better over 20 evaluation episodes, then writes the learning curve).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 examples/es.py --iterations 200 --stop-when-solved --plot es_pendulum.png
echo "learning curve: $(pwd)/es_pendulum.png"
