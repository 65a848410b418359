#!/usr/bin/env bash
# The weight sync's NCCL path, on a machine with CUDA: the same measurement as
# benchmarks/sync_bench.py (raw NCCL broadcast vs the synchroniser, and the engine's pause),
# trainer on GPU 0 and engine on GPU 1 (NCCL needs a device per rank). Prints the same JSON.
#
#     bash benchmarks/gpu_sync.sh [--gb 4]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "gpu_sync: needs 2 GPUs (NCCL puts one rank per device), found $gpus" >&2
  exit 2
fi
exec $PY benchmarks/sync_bench.py --device cuda --bucket-mb 256 "$@"
