#!/bin/bash
# On the GPU host (device tool), from the repo root:  bash bench/run_gpu_kernels.sh
# Runs the kernel tests on CUDA, then bench/tree_kernels.py; logs and results go to $OUT.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=/tmp/tritoncache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_tree_build.py tests/test_topk.py \
  tests/test_accept.py tests/test_bad_input.py tests/test_fixtures.py tests/test_verify_mask.py tests/test_demo.py 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "pytest rc=$?"
timeout 280 python3 bench/tree_kernels.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/tree_kernels.log" | tail -60
