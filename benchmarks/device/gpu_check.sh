#!/usr/bin/env bash
# Run ON the device machine (one NVIDIA GPU, 16 cores) after benchmarks/device/fetch.sh here:
#   run(command="bash benchmarks/device/gpu_check.sh", carry=[".whl", ".corpus"], timeout_s=590)
# Issue 8's checks that need it, in one call (at most 9.5 minutes, each step under its own timeout; results under $OUT):
#  1. one node's stage throughput against plain PyTorch (target: within 10%), at the issue's shape and at
#     the two shapes of its reference figures for plain eager PyTorch on an H200;
#  2. the training benchmark with a core per node, where the simulator's one-processor-per-node
#     assumption holds (measured against predicted, target within 20%).
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" | tee -a "$OUT/gpu.txt"
{
  timeout 110 python3 benchmarks/stage_throughput.py --model 500m --stages 6 --samples 4 --seq-len 1024 \
      --microbatches 8 --bf16
  timeout 110 python3 benchmarks/stage_throughput.py --model 500m --dim 1024 --heads 16 --layers 48 --stages 2 \
      --samples 8 --seq-len 1024 --microbatches 4 --bf16
  timeout 130 python3 benchmarks/stage_throughput.py --model 1b --dim 2048 --heads 16 --layers 32 --stages 2 \
      --samples 4 --seq-len 2048 --microbatches 4 --bf16
} 2>&1 | tee "$OUT/stage_throughput.txt"
timeout 210 python3 benchmarks/train.py --iterations 30 --out "$OUT/train" --corpus .corpus/jargon.txt.gz --device cpu \
    2>&1 | tee "$OUT/train.txt"
