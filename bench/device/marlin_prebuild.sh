#!/bin/bash
# Start SGLang 0.5.16's Marlin MoE JIT build (sglang.jit_kernel.moe_wna16_marlin, bf16) in the
# background, into the test bed's tvm-ffi cache, so it can run beside GPU work (drafter training)
# before the INT4 stages need it.  INT4 run 1 showed why: every Marlin stage spent its whole 200 s
# cap inside this build (five processes building it at once).  run_stages.sh reports the build's
# log at its end and returns the built module as $OUT/marlin_moe.tar.xz (not in cache.tar.xz).
# usage (repo root, GPU host): bash bench/device/marlin_prebuild.sh   (returns at once)
REPO=$(cd "$(dirname "$0")/../.." && pwd)
[ -d /tmp/site/sglang ] || tar -xJf $REPO/.kit/site.tar.xz -C /tmp || exit 1
source $REPO/bench/device/cuda_home.sh
mkdir -p /tmp/tvmcache
PYTHONPATH=/tmp/site TVM_FFI_CACHE_DIR=/tmp/tvmcache setsid nohup python3 -c "
import time, torch
t = time.time()
print('marlin build start', flush=True)
from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module as build
build(torch.bfloat16)
print(f'marlin built in {time.time() - t:.0f} s', flush=True)
" > /tmp/marlin_build.log 2>&1 < /dev/null &
echo "marlin build started (pid $!, CUDA_HOME=$CUDA_HOME)"
