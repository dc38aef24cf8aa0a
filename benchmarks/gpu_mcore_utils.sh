#!/usr/bin/env bash
# GPU tests and benchmarks of verl-mcore-utils (issue 4), for the lent GPU machine (see README).
# Usage: bash benchmarks/gpu_mcore_utils.sh OUT_DIR      (wheelhouse/ built with --extra mbridge --extra peft, carried)
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site wheelhouse/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, megatron.core, peft, mbridge, transformers; print('torch', torch.__version__, 'mcore', megatron.core.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)" | tee "$OUT/versions.txt"
python3 -m pytest -q -rA -m gpu -p no:cacheprovider \
  tests/test_gpu_construction.py tests/test_gpu_offload.py tests/test_gpu_lora.py tests/test_gpu_weights.py 2>&1 \
  | grep -v -i "warn" | tee "$OUT/pytest_gpu_mcore_utils.log"
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_' | tr -cd 'A-Za-z0-9_-')
python3 benchmarks/offload_bandwidth.py --out "$OUT/offload_bandwidth_${DEV}.json" 2>&1 | grep -v -i warn | tail -40 \
  | tee "$OUT/offload_bandwidth.log"
