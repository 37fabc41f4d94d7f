# sourced by run_stages.sh and marlin_prebuild.sh: CUDA_HOME of the GPU host's nvcc (its `nvcc` is a
# wrapper script naming the real binary), for the tvm-ffi / flashinfer JIT builds
NVCC=$(command -v nvcc); REAL=$(grep -ao '/[^ "]*/bin/nvcc' "$NVCC" 2>/dev/null | head -1)
export CUDA_HOME=$(dirname "$(dirname "$(readlink -f "${REAL:-$NVCC}")")")
ls $CUDA_HOME/lib64/libcudart.so >/dev/null 2>&1 || for d in /usr/local/cuda /usr/local/cuda-13.0; do [ -f $d/lib64/libcudart.so ] && export CUDA_HOME=$d; done
