#!/bin/bash
# Trim an unpacked SGLang kit (the `site/` folder build_kit.sh packs) of what the H200 host never
# loads, so that the tracked tree + the kit + the JIT cache fit one device call (<= 60 MB of the
# 64 MiB carry; issue 40 item 1).  build_kit.sh runs it unless KIT_TRIM=0.
#
# usage: [KIT_TRIM_SKIP=rule,rule] bash bench/device/kit_trim.sh SITE_DIR
#
# Every rule is named; KIT_TRIM_SKIP leaves the named ones out (a session whose trimmed kit fails on
# the GPU rebuilds with the failing rule skipped: the whole untrimmed kit, KIT_TRIM=0, is ~10 MB
# larger and no longer fits beside the tree).  Each rule says why it is safe; what can be checked on
# the CPU is checked by `python bench/device/check_kit.py SITE_DIR` (the server's imports with the
# trimmed pure-Python packages ahead of the venv's, the removed packages blocked, the test bed's
# configs and tokenizers).  What each rule saves (xz -6, rules applied in this order, 0.5.16 kit):
#   tf_models 2.69 MB, fi_data 0.78, sgl_grpc 2.05, sgl_test 0.29, sgl_mmcore 0.42, sgl_models 0.39,
#   zstandard 2.09, torchao 1.14, tvm_extras ~0.3, tests 0.09, records 0.65, strip 0.67.
set -euo pipefail
SITE=${1:?usage: kit_trim.sh SITE_DIR}
cd "$SITE"
[ -d sglang ] && [ -d transformers ] && [ -d flashinfer ] || { echo "not a kit site: $SITE" >&2; exit 2; }
SKIP=",${KIT_TRIM_SKIP:-},"
on() { case "$SKIP" in *",$1,"*) echo "  kit_trim: $1 skipped"; return 1 ;; esac; echo "  kit_trim: $1"; }

# transformers/models (40 MB raw): keep the folders SGLang imports when the server starts (its
# configs / processors: auto, deepseek_v3, encoder_decoder, gemma4, gpt_oss, lfm2, lfm2_vl, llama,
# mellum, nemotron_h, qwen2, qwen2_5_vl, qwen3, qwen3_moe, siglip, whisper, read off sys.modules on
# the CPU) and those the test bed's pairs load (qwen3 / qwen3_moe / deepseek_v3 configs, qwen2's
# tokenizer; llama / mistral / deepseek_v2 / qwen2_moe as near kin).  SGLang's model registry skips
# a model module whose import fails (a logged warning): those model classes drop out of it.
if on tf_models; then
  KEEP=" auto deepseek_v2 deepseek_v3 encoder_decoder gemma4 gpt_oss lfm2 lfm2_vl llama mellum mistral
         nemotron_h qwen2 qwen2_5_vl qwen2_moe qwen3 qwen3_moe siglip whisper "
  for d in transformers/models/*/; do
    n=$(basename "$d"); case "$(echo $KEEP | sed 's/^/ /; s/$/ /')" in *" $n "*) ;; *) rm -rf "$d" ;; esac
  done
fi

# flashinfer/data (69 MB raw): its JIT compiles with -I on exactly cutlass/include,
# cutlass/tools/util/include, spdlog/include, cccl/{cub,thrust,libcudacxx/include}, include, csrc
# (flashinfer/jit/env.py, cpp_ext.py; sglang/jit_kernel/utils/deps.py the same); the rest of the
# vendored trees (cutlass' python DSL, examples and tests, cccl's python, benchmarks, docs, tests)
# is never on an include path.  Safe with or without the JIT cache.
if on fi_data; then
  FD=flashinfer/data
  rm -rf $FD/cutlass/examples $FD/cutlass/python $FD/cutlass/test
  find $FD/cutlass/tools -mindepth 1 -maxdepth 1 ! -name util -exec rm -rf {} +
  find $FD/cutlass/tools/util -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +
  rm -rf $FD/cccl/benchmarks $FD/cccl/ci $FD/cccl/docs $FD/cccl/python
  find $FD/cccl/cub -mindepth 1 -maxdepth 1 ! -name cub -exec rm -rf {} +
  find $FD/cccl/thrust -mindepth 1 -maxdepth 1 ! -name thrust -exec rm -rf {} +
  find $FD/cccl/libcudacxx -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +
  find $FD/spdlog -mindepth 1 -maxdepth 1 ! -name include -exec rm -rf {} +
fi

# sglang's native gRPC server (7.6 MB .so): http_server imports it only under --grpc-port.
if on sgl_grpc; then rm -rf sglang/srt/grpc; fi
# sglang.test: imported by the scripted-runtime hooks behind SGLANG_TEST_SCRIPTED_RUNTIME and by
# bench_one_batch_server, neither used here.
if on sgl_test; then rm -rf sglang/test; fi
# sglang's Rust image preprocessing (1.3 MB .so): only the Inkling multimodal processor imports it.
if on sgl_mmcore; then rm -f sglang/srt/multimodal/_core.*.so; fi
# sglang/srt/models (212 modules, all imported by the registry at every server start): keep the
# families the test bed serves (Qwen3 dense / MoE, DeepSeek-V3 MLA, the DFlash drafter) with their
# kin and what they import (qwen2*, llama*, deepseek*, mistral*, the generic transformers backend);
# the registry skips the rest.  Text-only servers never import the multimodal processors that
# name other model modules.
if on sgl_models; then
  for f in sglang/srt/models/*; do
    case "$(basename "$f")" in
      __init__.py|registry.py|utils.py|transformers.py|dflash*|qwen2*|qwen3*|llama*|deepseek*|mistral*) ;;
      *) rm -rf "$f" ;;
    esac
  done
fi

# zstandard (11.5 MB .so): imported only by SGLang's request-decompression middleware, which is off
# unless SGLANG_ENABLE_REQUEST_DECOMPRESSION is set; httpx / urllib3 import it optionally.
if on zstandard; then rm -rf zstandard zstandard-*.dist-info; fi
# torchao: transformers imports it only when it is installed (the host has none), SGLang only under
# --torchao-config; the top-level `test` folder is torchao's wheel's own tests.
if on torchao; then rm -rf torchao torchao-*.dist-info test; fi
# tvm_ffi: libbacktrace's sources (a CMake build of tvm_ffi itself uses them, its JIT does not: its
# include paths are tvm_ffi/include, dlpack; no .py file names them).  Its testing library stays: the
# host's import loads it without `import tvm_ffi.testing` (removing it failed every stage on the
# H200, 2026-12-05; check_kit.py now compares the compiled libraries the CPU import maps).
if on tvm_extras; then rm -rf tvm_ffi/3rdparty/libbacktrace; fi
# packages' own test suites and benchmarks (never imported by the package itself).
if on tests; then
  find . -path ./flashinfer/data -prune -o -type d \( -name tests -o -name benchmarks \) -prune -print \
    | xargs -r rm -rf
fi
# dist-info RECORD files (flashinfer's lists every vendored header): pip uninstall reads them, and
# importlib.metadata.packages_distributions() infers a distribution's import names from them when
# it has no top_level.txt (transformers' import_utils maps import names to versions with it): each
# RECORD is replaced by the top_level.txt it implies (the same names, as Python 3.12 infers them).
# version() / entry_points() read METADATA and entry_points.txt.
if on records; then
  python3 - <<'PY'
import csv, glob, inspect, os
for rec in glob.glob("*.dist-info/RECORD"):
    top_level = os.path.join(os.path.dirname(rec), "top_level.txt")
    if not os.path.exists(top_level):
        names = set()
        with open(rec, newline="") as f:
            for row in csv.reader(f):
                if row and row[0]:
                    parts = row[0].split("/")
                    names.add(parts[0] if len(parts) > 1 else (inspect.getmodulename(parts[0]) or parts[0]))
        with open(top_level, "w") as f:
            f.write("".join(n + "\n" for n in sorted(n for n in names if "." not in n)))
    os.remove(rec)
PY
fi
# symbol tables of the shared libraries not stripped in their wheels (--strip-unneeded keeps the
# dynamic symbols the loader and Python's import need).
if on strip; then
  if command -v strip > /dev/null; then
    find . -name '*.so*' -type f | while read -r f; do
      if file -b "$f" 2>/dev/null | grep -q 'not stripped'; then strip --strip-unneeded "$f"; fi
    done
  else
    echo "  kit_trim: no strip here, rule strip left out"
  fi
fi
du -sh .
