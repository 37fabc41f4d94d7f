#!/bin/bash
# Build a carry-able SGLang 0.5.16 kit (site-packages overlay, ~32 MB tar.xz) for the
# lent H200 machine (Python 3.12, torch 2.11.0+cu130, triton 3.6.0, no network).
#
# usage: [KIT_TRIM=0] [KIT_TRIM_SKIP=rule,...] bash build_kit.sh KIT_DIR   (a git-ignored folder, e.g. .kit)
# needs: internet to PyPI here, python3 with pip, xz, strip.  Produces KIT_DIR/site.tar.xz which
# unpacks to ./site  (device: tar -xJf site.tar.xz -C /tmp; export PYTHONPATH=/tmp/site).
# After the base trims below, kit_trim.sh removes what the host never loads (43.0 -> ~32 MB; each
# rule named and argued there; `python bench/device/check_kit.py $STAGE/site` checks it on the CPU).
# KIT_TRIM=0 builds the untrimmed kit (43 MB: it no longer fits beside the tree and the JIT cache),
# KIT_TRIM_SKIP=rule,... keeps the named rules' files: the fallback when a trimmed kit fails on the GPU.
set -euo pipefail
KIT=${1:?usage: build_kit.sh KIT_DIR (a git-ignored folder inside your checkout, e.g. .kit)}
WHL=${WHL:-/tmp/kit_wheels}
STAGE=${STAGE:-/tmp/kit_stage}
mkdir -p "$WHL" "$KIT"
KIT=$(cd "$KIT" && pwd)   # absolute: the script cd's below
HERE=$(cd "$(dirname "$0")" && pwd)

PLAT=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
      --platform linux_x86_64 --platform any)
TAGS=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${PLAT[@]}")

# Exact pins.  sglang 0.5.16's own pins: torch==2.11.0 (device has it), sglang-kernel==0.4.5,
# flashinfer_python==0.6.14, transformers==5.12.1 (device's 5.17 clashes: "'qwen3_asr' is
# already used by a Transformers config"), apache-tvm-ffi==0.1.11, openai==2.6.1, torchao==0.17.0,
# soundfile==0.13.1.  Deviations: xgrammar 0.2.9 instead of 0.2.1 (0.2.1's .so is 53 MB;
# sglang only imports StructuralTag eagerly; run with --grammar-backend none), fastapi 0.140.13
# (>=0.150 needs opentelemetry-api), tokenizers 0.22.2 (transformers 5.12.1 wants <=0.23.0;
# 0.23.0 is not on PyPI, device has 0.23.2).
PKGS=(
  sglang==0.5.16 sglang-kernel==0.4.5 flashinfer-python==0.6.14 apache-tvm-ffi==0.1.11
  transformers==5.12.1 tokenizers==0.22.2
  fastapi==0.140.13 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 python-multipart==0.0.34
  pyzmq==27.3.0 orjson==3.13.0 msgspec==0.23.0 pybase64==1.5.1 setproctitle==1.3.8
  interegular==0.3.3 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.9
  compressed-tensors==0.20.1 torchao==0.17.0 gguf==0.19.0
  openai==2.6.1 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1
  watchfiles==1.3.0 zstandard==0.25.0 easydict==1.14 dill==0.4.1 loguru==0.7.3
  jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
  soundfile==0.13.1 cffi==2.1.1 pycparser==3.12
  ipython==9.18.1 traitlets==5.16.1 decorator==5.3.1 ipython-pygments-lexers==1.1.1
)
# (sglang/utils.py imports IPython.display eagerly; IPython's other deps - jedi, prompt_toolkit,
#  pexpect, stack_data ... - are not needed for that import and are left out.)

echo "== download"
python3 -m pip download -q --no-deps --only-binary=:all: "${TAGS[@]}" -d "$WHL" "${PKGS[@]}"

echo "== install into $STAGE/site"
rm -rf "$STAGE"; mkdir -p "$STAGE/site"
for p in "${PKGS[@]}"; do
  n=${p%%==*}; v=${p#*==}; pat=$(echo "$n" | tr '-' '_')
  f=$(ls "$WHL"/ | grep -i "^${pat}-${v}-" | head -1)
  [ -n "$f" ] || { echo "missing wheel for $p"; exit 1; }
  # wheels are zip files; every wheel here is purelib/platlib only (no .data scripts needed)
  (cd "$STAGE/site" && python3 -m zipfile -e "$WHL/$f" .)
done

echo "== trim"
cd "$STAGE/site"
rm -f  sgl_kernel/flash_ops.abi3.so            # 1.1 GB FA3 kernels (use triton/flashinfer backends)
rm -f  sgl_kernel/infllm_ops*.so sgl_kernel/flashmla_ops.abi3.so
rm -rf sgl_kernel/sm100                         # Blackwell build; H200 loads sgl_kernel/sm90
rm -rf sglang/multimodal_gen                    # diffusion runtime, not imported by srt
rm -rf xgrammar/lib                              # static lib
rm -f  zstandard/_cffi.*.so                      # 12 MB: zstandard imports backend_c first (cffi only on request)
rm -f  torchao/_C_mxfp8.cpython-310-*.so          # a Python 3.10 build: never loadable on the host's 3.12
find . -name __pycache__ -prune -exec rm -rf {} +
find . -name '*.so' -exec chmod 755 {} +
du -sh .
if [ "${KIT_TRIM:-1}" != 0 ]; then bash "$HERE/kit_trim.sh" "$STAGE/site"; fi
cd "$STAGE"
# files grouped by extension (headers with headers, .py with .py: xz finds more repeats; -0.4 MB),
# directories implied by their files
find site -type f -o -type l | awk -F/ '{n = $NF; e = (n ~ /\./) ? n : ""; sub(/^.*\./, "", e); print e "\t" $0}' \
  | LC_ALL=C sort -t"$(printf '\t')" -k1,1 -k2,2 | cut -f2 > "$STAGE/files.txt"
tar --no-recursion -cf - -T "$STAGE/files.txt" | xz -T0 -9 > "$KIT/site.tar.xz"
ls -la "$KIT/site.tar.xz"
