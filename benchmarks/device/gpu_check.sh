#!/usr/bin/env bash
# Run ON the device machine (one NVIDIA GPU, 16 cores) after benchmarks/device/fetch.sh here:
#   run(command="bash benchmarks/device/gpu_check.sh", carry=[".whl", ".corpus"], timeout_s=590)
# Issue 8's checks that need it, in one call (at most 9.5 minutes, each step under its own timeout; results under $OUT):
#  1. one node's stage throughput against plain PyTorch (target: within 10%), at the issue's shape and at
#     the two shapes of its reference figures for plain eager PyTorch on an H200;
#  2. the training benchmark with a core per node, where the simulator's one-processor-per-node
#     assumption holds (measured against predicted, target within 20%).
# A dry run anywhere (tiny shapes, 2 iterations; pyzmq must be importable): QUICK=1 OUT=/tmp/x bash ...
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import zmq" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ "${QUICK:-0}" = 1 ]; then
    SHAPE1="--model tiny --stages 2 --samples 2 --seq-len 32 --microbatches 2 --rounds 1"
    SHAPE2="$SHAPE1 --dim 32 --heads 2"; SHAPE3="$SHAPE1 --dim 48 --heads 2"; ITERS=2; BF16=""
else
    SHAPE1="--model 500m --stages 6 --samples 4 --seq-len 1024 --microbatches 8"
    SHAPE2="--model 500m --dim 1024 --heads 16 --layers 48 --stages 2 --samples 8 --seq-len 1024 --microbatches 4"
    SHAPE3="--model 1b --dim 2048 --heads 16 --layers 32 --stages 2 --samples 4 --seq-len 2048 --microbatches 4"
    ITERS=30; BF16="--bf16"
fi
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))" \
    2>&1 | tee -a "$OUT/gpu.txt"
{
  timeout 110 python3 benchmarks/stage_throughput.py $SHAPE1 $BF16
  timeout 110 python3 benchmarks/stage_throughput.py $SHAPE2 $BF16
  timeout 130 python3 benchmarks/stage_throughput.py $SHAPE3 $BF16
} 2>&1 | tee "$OUT/stage_throughput.txt"
timeout 210 python3 benchmarks/train.py --iterations $ITERS --out "$OUT/train" --corpus .corpus/jargon.txt.gz \
    --device cpu 2>&1 | tee "$OUT/train.txt"
