#!/bin/bash
# GPU-host driver of the test bed: unpack the SGLang kit, install the project from the checkout,
# make the tiny models, run stages (parallel groups) under a deadline, write results to $OUT.
#
# usage (from the repo root, on the GPU host):
#   bash bench/device/run_stages.sh "GROUPS" DEADLINE_SECONDS
# GROUPS: groups separated by ';', run one after the other; the stages of a group run in parallel
# (one process each, sharing the GPU).  Stages:
#   <gqa|mla>_<base|dflash>_<eager|graph>   stage.py (offline Engine, token check vs target greedy)
#                                           suffixes (stage.py parse_name): _b<N> _synccheck _dfastplan _nomaskpatch _moetriton
#                                           _cycle (adaptive budget, forced widths incl. no-spec) _auto (its policy)
#                                           _vattn (SGLANG_DDTREE_VERIFY_ATTN=ddtree: our verify attention required)
#                                           _sglattn (=sglang: SGLang's masked verify kernel; default auto: ours where covered)
#                                           _default (the product default: no DDTree setting) _nospec (it, every round plain)
#                                           _default_uncapped (no --max-running-requests, decode graphs to bs 96) _dattn
#   <mlaint4|mlaint4ref>_<algo>_<mode>[_moetriton]  the INT4-expert MLA target (mk_int4.py) / its dequantized bf16 twin
#   kimicost_<algo>_<mode>[_b<N>]           the production-cost INT4 MLA pair (mk_kimi_cost.py: Kimi K2 widths, ~32 GB,
#                                           written only when a kimicost stage is named; KIMICOST_ARGS e.g. "--layers 6")
#   capture_<gqa|mla>                       capture_fixtures.py (top-k fixtures from DFLASH drafter)
#   http_<gqa|mla>[_<algo>][_metrics]       python -m sglang.launch_server --config configs/tiny_<pair>_<algo>.yaml (algo: dflash default, ddtree);
#                                           _metrics: with --enable-metrics, /metrics scraped for the plugin's sglang:ddtree_* series
#   plugin_probe                            entry-point discovery only (no engine)
#   sweep                                   bench/ab_serve.py --kernel-sweep-only (GPU tree build vs CPU heap)
#   prompts_<pair>                          the A/B prompts this host generates for the pair -> $OUT/prompts_<pair>.jsonl
#   pytest_gpu                              the whole test suite on CUDA -> $OUT/pytest_gpu_h200.log
#   pytest_gpu-1 / -2 / -<name>             test files a..o / p..z / tests/test_<name>.py only
#   sampledmem                              bench/sampled_memory.py (sampled accept memory, old vs new)
#   verify_attn[_quick]                     bench/verify_attention.py (tree-verify attention vs floor / SGLang / flashinfer; alone on the GPU)
#   logprobs_text                           bench/logprobs_check.py: DDTREE-GPU log-probs vs a plain server (text pair)
#   int4logits                              bench/int4_logits_check.py: INT4 (Marlin) log-probs vs the dequantized twin in fp32
#   badids_text                             bench/soak.py probe: does an out-of-vocab id kill plain SGLang / the plugin's server?
#   scale_<qwen3-8b|qwen3-30b-a3b>          bench/scale: write the text pair at that shape, check its greedy tokens, A/B on it
#   scalecode_<qwen3-8b>[_l<N>]             bench/scale on the code pair (issue 42 item 3; after codepair_train on this warm
#                                           machine): vocab.py --pair code (junk rows for its tokenizer), transform.py write
#                                           --pair code -> /tmp/models/<shape>code_{target,drafter}, exactness.py --pair code,
#                                           then the A/B, AB_CLIENT default bench_serving (AB_WORKLOAD natural: the held-out
#                                           prompts' text); reuses a written pair of the same code_pair.json (SCALE_REWRITE=1:
#                                           write again); EXACT_SKIP=1 / EXACT_NO_SERVE=1 / EXACT_PROMPTS=N; AB_ARMS=none: no A/B.
#                                           The MoE shape cannot hold the code pair (its 768-wide experts < the pair's MLP 2048)
#   scalechain_<qwen3-8b|qwen3-30b-a3b>     bench/scale/chain_pair.py: the chain GQA pair (block-16 drafter) at that shape,
#                                           A/B on chain prompts, base outputs checked against the chain
#                                           (AB_CLIENT=bench_serving: the load from sglang.bench_serving, random / long / mix)
#   codepair_train                          bench/codepair/recipe.py: the code pair (issue 42) from the host's sources, trained
#                                           here -> /tmp/models/code_{target,drafter}, code_heldout_prompts.json, code_pair.json;
#                                           $OUT gets codepair_log.json, corpus_manifest.tsv.gz, tokenizer.json, heldout_prompts.json,
#                                           corpus_meta.json, codepair_train.log (CODEPAIR_WORK, default /tmp/codepair: a warm
#                                           machine's work folder is resumed; CODEPAIR_ARGS: more recipe flags)
#   codepair_ab                             bench/ab_serve.py on that pair (needs /tmp/models/code_pair.json: codepair_train in this
#                                           call or on this warm machine): prompts /tmp/models/code_heldout_prompts.json (held-out
#                                           files), arms default base,dflash,ddtree_b15,ddtree_b31,ddtree_b63, AB_NEW default 256,
#                                           AB_CONCURRENCY default 1,16, AB_PROMPTS 64; AB_CLIENT=bench_serving: the A/B through
#                                           sglang.bench_serving (AB_WORKLOAD default natural = those prompts' text; arms default
#                                           base,dflash,ddtree), report serving_h200_codepair_<workload>; see bench/codepair/GPU_RECIPE.md
#   soak_text                               bench/soak.py: 1,000 mixed requests at c=64 on a DDTREE-GPU HTTP server + plain reference
#   ab_<text|gqa|mla|kimicost>[-fp32]       bench/ab_serve.py on that pair (alone on its GPU; set STAGE_CAP,
#                                           DDTREE_COMMIT; AB_ARMS / AB_CONCURRENCY / AB_PROMPTS / AB_NEW / AB_EXTRA /
#                                           AB_SERVER_ARGS: flags for every server, kept as one --server-args value;
#                                           AB_CLIENT=bench_serving + AB_WORKLOAD=random|varied|natural|long|mix|ids: the load from
#                                           python -m sglang.bench_serving, identity check on top; also for scale_*;
#                                           several comma-separated (random,long): each arm's server serves them in
#                                           turn, one report per workload)
# A stage name may end in @N: it then runs with CUDA_VISIBLE_DEVICES=N (e.g. "ab_text@0 ab_mla@1" runs
# two A/B benchmarks side by side on nvidia-h200-x2, one GPU each).  Two lanes must not share a stage name:
# ab_<pair>-<tag> is the same pair under another name (its arms from AB_ARMS_<tag> when set; tag fp32 also
# adds --dtype float32), e.g. AB_ARMS_1=base,dflash AB_ARMS_2=base,ddtree_b16 "ab_gqa-1@0 ab_gqa-2@1".
# $OUT gets: summary.txt, results.jsonl, logs.tar.gz, cache.tar.xz (JIT caches: `bash
# bench/device/carry.sh cache FILE` puts it in .kit/ for the next call), fixtures.tar (captured npz + stats).  See bench/device/README.md.
GROUPS_ARG=${1:-"gqa_base_graph"}
DEADLINE=${2:-480}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DEV=$REPO/bench/device
KIT=$REPO/.kit
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=/tmp/tblogs; rm -rf $LOG; mkdir -p $LOG
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
# the --out stem of a bench_serving A/B: STEM_<workload> for one workload; STEM for several (AB_WORKLOAD=random,long:
# each arm's server serves them in turn and the client writes STEM_<workload> for each)
serving_out() { if [[ $2 == *,* ]]; then echo $1; else echo ${1}_$2; fi; }
# the report stems a bench_serving A/B with --out STEM and AB_WORKLOAD $2 writes
serving_reports() { local w; if [[ $2 == *,* ]]; then for w in ${2//,/ }; do echo ${1}_$w; done; else echo $1; fi; }
S=$OUT/summary.txt
R=$OUT/results.jsonl
echo "== start $(date -u +%FT%TZ) groups='$GROUPS_ARG' deadline=${DEADLINE}s" | tee -a $S

# 1. SGLang kit (site-packages overlay) ------------------------------------------------------
if [ ! -d /tmp/site/sglang ]; then
  tar -xJf $KIT/site.tar.xz -C /tmp || { echo "unpack failed (is .kit/site.tar.xz carried?)" | tee -a $S; exit 1; }
fi
echo "unpacked at $(el)s" | tee -a $S

# 2. the project, installed without network: dist-infos with entry points on PYTHONPATH ---------
# The package is laid out as pip would install it (pyproject maps kernels/ and patches/ INTO the
# package): a real folder of symlinks, so sglang_ddtree/__init__.py sees the installed layout.  The
# repo root itself is never put on sys.path: its kernels/ would shadow the HF `kernels` package.
P=/tmp/ddtree_path; rm -rf $P; mkdir -p $P/sglang_ddtree
for f in $REPO/sglang_ddtree/*; do ln -s $f $P/sglang_ddtree/; done
ln -s $REPO/kernels $P/sglang_ddtree/kernels; [ -d $REPO/patches ] && ln -s $REPO/patches $P/sglang_ddtree/patches
if [ "${DDTREE_PLUGIN:-1}" = 1 ]; then
  D=$P/sglang_ddtree-0.1.0.dist-info; mkdir -p $D
  printf 'Metadata-Version: 2.1\nName: sglang-ddtree\nVersion: 0.1.0\n' > $D/METADATA
  printf '[sglang.srt.plugins]\nddtree = sglang_ddtree.plugin:register\n' > $D/entry_points.txt
  echo "sglang_ddtree installed from the checkout (entry point ddtree = sglang_ddtree.plugin:register;" \
       "plugin.py present: $([ -f $REPO/sglang_ddtree/plugin.py ] && echo yes || echo 'no -> SGLang logs a load failure, harmless')" | tee -a $S
fi
cp $DEV/testbed_hooks.py $P/ddtree_testbed_hooks.py
D=$P/ddtree_testbed-0.0.1.dist-info; mkdir -p $D
printf 'Metadata-Version: 2.1\nName: ddtree-testbed\nVersion: 0.0.1\n' > $D/METADATA
printf '[sglang.srt.plugins]\nddtree_testbed = ddtree_testbed_hooks:register\n' > $D/entry_points.txt

export PYTHONPATH=/tmp/site:$P
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TVM_FFI_CACHE_DIR=/tmp/tvmcache TRITON_CACHE_DIR=/tmp/tritoncache FLASHINFER_WORKSPACE_BASE=/tmp/fi
mkdir -p $TVM_FFI_CACHE_DIR $TRITON_CACHE_DIR
[ -f $KIT/cache.tar.xz ] && tar -xJf $KIT/cache.tar.xz -C / && echo "restored JIT caches from .kit/cache.tar.xz" | tee -a $S
# flashinfer rebuilds a carried module whose objects are missing (its ninja target needs them): link
# the carried .so files into its AOT directory, which it loads as they are (bench/device/fi_aot.py)
[ -d /tmp/fi ] && { PYTHONPATH=/tmp/site python3 $DEV/fi_aot.py 2>&1 | tail -1 | cut -c1-400 | tee -a $S; }
# SGLang's Marlin MoE module (380 s to build: bench/device/marlin_prebuild.sh), when carried as .kit_marlin
[ -f $REPO/.kit_marlin/marlin_moe.tar.xz ] && tar -xJf $REPO/.kit_marlin/marlin_moe.tar.xz -C / \
  && echo "restored the Marlin MoE module from .kit_marlin/marlin_moe.tar.xz" | tee -a $S
source $DEV/cuda_home.sh
echo "CUDA_HOME=$CUDA_HOME" | tee -a $S
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $S
python3 -c "import sys,torch,triton,transformers,sglang,sgl_kernel,flashinfer;print('versions: python',sys.version.split()[0],'torch',torch.__version__,'triton',triton.__version__,'transformers',transformers.__version__,'sglang',sglang.__version__,'sgl_kernel',sgl_kernel.__version__,'flashinfer',flashinfer.__version__,'cc',torch.cuda.get_device_capability())" 2>&1 | tail -1 | tee -a $S

# 3. tiny models -----------------------------------------------------------------------------
# (skipped when every stage is scalechain_* or verify_attn*: those write their own pair from the
# checkout or use synthetic tensors; saves ~35 s)
SELF_CONTAINED=1
for st in ${GROUPS_ARG//;/ }; do [[ "${st%@*}" == scalechain_* || "${st%@*}" == scale_* || "${st%@*}" == verify_attn* || "${st%@*}" == codepair_* || "${st%@*}" == scalecode_* ]] || SELF_CONTAINED=0; done
if [ $SELF_CONTAINED = 1 ]; then echo "tiny models, INT4 and text pairs skipped (scale / scalechain / scalecode / verify_attn / codepair stages only)" | tee -a $S; else
python3 $DEV/mk_models.py /tmp/models > $LOG/mk_models.log 2>&1 || tail -20 $LOG/mk_models.log | tee -a $S
echo "models at $(el)s: $(tail -1 $LOG/mk_models.log | cut -c1-300)" | tee -a $S
# the MLA target with INT4 (compressed-tensors W4A16) experts + its dequantized bf16 reference: pairs
# mlaint4 / mlaint4ref (stage suffix moetriton: --moe-runner-backend triton instead of Marlin)
python3 $DEV/mk_int4.py /tmp/models > $LOG/mk_int4.log 2>&1 && echo "int4 target at $(el)s: $(tail -1 $LOG/mk_int4.log | cut -c1-300)" | tee -a $S \
  || tail -5 $LOG/mk_int4.log | tee -a $S
# the production-cost INT4 MLA pair (Kimi K2 widths, ~30 GB target + 2.3 GB drafter, written on the GPU), only
# when a kimicost stage is asked for; a warm machine keeps it (mk_kimi_cost.py returns at once when
# /tmp/models/kimicost_target/kimicost.json matches).  KIMICOST_ARGS: e.g. "--layers 6 --experts 64"
if [[ "$GROUPS_ARG" == *kimicost* ]]; then
  python3 $DEV/mk_kimi_cost.py /tmp/models ${KIMICOST_ARGS:-} > $LOG/mk_kimi_cost.log 2>&1 \
    && echo "kimicost pair at $(el)s: $(grep -a -m1 '^kimicost: target' $LOG/mk_kimi_cost.log) $(tail -1 $LOG/mk_kimi_cost.log | cut -c1-400)" | tee -a $S \
    || tail -8 $LOG/mk_kimi_cost.log | tee -a $S
  df -h /tmp | tail -1 | tee -a $S
fi
# the text-trained pair (bench/textpair), when its weights are in the checkout
if [ -f $REPO/bench/textpair/materialize.py ] && ls $REPO/sglang_ddtree/data/textpair/*.safetensors* >/dev/null 2>&1; then
  python3 $REPO/bench/textpair/materialize.py /tmp/models ${DRAFTER_RUN:+--drafter-run $DRAFTER_RUN} > $LOG/materialize_text.log 2>&1 \
    && echo "text pair at $(el)s: $(tail -1 $LOG/materialize_text.log | cut -c1-200)" | tee -a $S \
    || tail -5 $LOG/materialize_text.log | tee -a $S
fi
fi   # SELF_CONTAINED

# 4. stages ----------------------------------------------------------------------------------
run_stage() {  # name[@GPU] port limit   (@GPU: pin the stage to one GPU of a multi-GPU machine)
  local name=$1 port=$2 lim=$3 ts=$(date +%s) rc st=${1%@*}
  if [ "$name" != "$st" ]; then export CUDA_VISIBLE_DEVICES=${name##*@}; fi
  case $st in
    capture_*)
      timeout -k 5 $lim python3 $DEV/capture_fixtures.py ${st#capture_} /tmp/models $OUT/fixtures $port > $LOG/$st.log 2>&1; rc=$?
      grep -a CAPTURE_STATS $LOG/$st.log | cut -c1-1500 > $LOG/$st.res ;;
    http_*)
      local rest=${st#http_}; local pair=${rest%%_*}; local algo=dflash; local mx=()
      [ "$rest" != "$pair" ] && algo=${rest#*_}
      # http_<pair>_<algo>_metrics: the same server with --enable-metrics; http_client scrapes /metrics
      if [ "${algo%_metrics}" != "$algo" ]; then algo=${algo%_metrics}; mx=(--enable-metrics); fi
      # -P: python -m would put the cwd (the checkout root) first on sys.path, and its bare
      # sglang_ddtree/ (no patches/) would shadow the installed package
      python3 -P -m sglang.launch_server --config $REPO/configs/tiny_${pair}_${algo}.yaml --port $port "${mx[@]}" \
        --mem-fraction-static 0.5 --max-total-tokens 32768 --nccl-port $((port+7)) > $LOG/$st.log 2>&1 &
      local sp=$!
      timeout -k 5 $lim python3 $DEV/http_client.py http://127.0.0.1:$port $((lim-15)) $sp /tmp/models/${pair}_target/perm.json $st $R > $LOG/$st.res 2>&1; rc=$?
      local ch=$(pgrep -P $sp); kill $sp 2>/dev/null; sleep 5; for c in $ch $sp; do kill -9 $c 2>/dev/null; done ;;
    ab_*)  # the A/B serving benchmark on one pair (ALONE on its GPU: it times servers); ab_<pair>-fp32: --dtype float32
      local spec=${st#ab_}; local pair=${spec%%-*}; local tag=${spec//-/_}; local sa=()
      [ "$spec" = "$pair-fp32" ] && sa=(--server-args "--dtype float32")
      [ -n "${AB_SERVER_ARGS:-}" ] && sa=(--server-args "${AB_SERVER_ARGS}")  # e.g. "--context-length 20000" (one word list)
      local arms_var=AB_ARMS_${spec#$pair}; arms_var=${arms_var//-/}  # ab_gqa-2 reads AB_ARMS_2, if set
      local pa=(--pair $pair) defarms=base,dflash,ddtreecpu_b16,ddtree_b8,ddtree_b16,ddtree_b32,ddtree_b64
      if [ "$pair" = kimicost ]; then  # not an ab_serve --pair: its folders; prompts tokenized by its (toy) tokenizer
        pa=(--model-path /tmp/models/kimicost_target --draft-model-path /tmp/models/kimicost_drafter --token-ids)
        defarms=base,dflash,ddtree_b16
      fi
      # AB_CLIENT=bench_serving: python -m sglang.bench_serving drives the levels (sglang_ddtree/ab/serving_client.py),
      # AB_WORKLOAD=random|varied|natural|long|mix|ids (default random; several comma-separated), arms default
      # base,dflash,ddtree; writes serving_h200_<tag>_<workload>.{json,md} for each workload
      local cl=() outname=ab_h200_$tag
      if [ "${AB_CLIENT:-ab}" = bench_serving ]; then
        cl=(--client bench_serving --workload ${AB_WORKLOAD:-random}); defarms=base,dflash,ddtree
        outname=$(serving_out serving_h200_${tag} ${AB_WORKLOAD:-random})
      fi
      local arms=${!arms_var:-${AB_ARMS:-$defarms}}
      # python -m sglang_ddtree.ab: the installed sglang-ddtree-ab command's code path (-P: not the cwd's copy)
      timeout -k 10 $lim python3 -P -m sglang_ddtree.ab "${pa[@]}" --arms $arms "${cl[@]}" \
        --concurrency ${AB_CONCURRENCY:-1,4,16,64} --num-prompts ${AB_PROMPTS:-128} --max-new-tokens ${AB_NEW:-96} "${sa[@]}" \
        --deadline $((lim-20)) --port $port --workdir /tmp/abw_$tag --out $OUT/$outname --no-progress ${AB_EXTRA:-} > $LOG/$st.log 2>&1; rc=$?
      tar -czf $OUT/ab_logs_$tag.tgz -C /tmp abw_$tag 2>/dev/null
      grep -a -E "^\[|kernel sweep|wrote" $LOG/$st.log | tail -40 > $LOG/$st.res ;;
    scalechain_*)  # bench/scale/chain_pair.py: the chain GQA pair (block-16 toy drafter) at a production shape
                   # (scalechain_qwen3-8b, scalechain_qwen3-30b-a3b; SCALE_LAYERS: fewer layers, e.g. 24 for the MoE
                   # shape's disk), the A/B on chain prompts (token ids), then check-outputs: every arm = the chain
                   # (AB_PROMPT_LEN=8000-8192: a long-context arm; add AB_EXTRA "--max-input-tokens 8192" and
                   # AB_SERVER_ARGS "--context-length 9000": the configs allow 40960 positions)
      # AB_CLIENT=bench_serving: sglang.bench_serving drives the load (AB_WORKLOAD random|varied|long|mix: random
      # token ids; ids: the chain prompts themselves, 64-256 out, where drafters accept long blocks; natural has no
      # meaning on a permutation pair), arms default base,dflash,ddtree, every server launched with
      # only its own flags; the identity requests are the chain prompts (16, 256 new tokens, 4 in flight) and
      # check-outputs compares every arm's with the chain; report serving_h200_<shape>chain_<workload>
      local shape=${st#scalechain_}; local sd=/tmp/models
      local ccl=(--token-ids --arms ${AB_ARMS:-base,dflash,ddtree_b7,ddtree_b15} --max-new-tokens ${AB_NEW:-64})
      local cout=scalechain_ab_${shape}_h200
      if [ "${AB_CLIENT:-ab}" = bench_serving ]; then
        ccl=(--client bench_serving --workload ${AB_WORKLOAD:-random} --arms ${AB_ARMS:-base,dflash,ddtree}
             --identity-concurrency 4)
        cout=$(serving_out serving_h200_${shape}chain ${AB_WORKLOAD:-random})
        # natural is refused below (set after ccl: before s33 the line above overwrote it)
        [[ ",${AB_WORKLOAD:-random}," == *,natural,* ]] && ccl=(natural)
      fi
      { if [ "${ccl[0]}" = natural ]; then echo "scalechain: AB_WORKLOAD=natural has no meaning on the chain pair"; false; else
        timeout -k 10 $lim python3 $REPO/bench/scale/chain_pair.py write --shape $shape --out $sd ${SCALE_LAYERS:+--layers $SCALE_LAYERS} \
        && echo "written at $(( $(date +%s) - ts ))s, disk: $(du -sh $sd/${shape}chain_target | cut -f1)" \
        && python3 $DEV/mk_chain_prompts.py /tmp/chain_prompts.jsonl --n ${AB_PROMPTS:-128} --len ${AB_PROMPT_LEN:-2-40} \
        && timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 -P -m sglang_ddtree.ab \
             --model-path $sd/${shape}chain_target --draft-model-path $sd/${shape}chain_drafter \
             --prompts /tmp/chain_prompts.jsonl "${ccl[@]}" \
             --concurrency ${AB_CONCURRENCY:-1,4,16,64} --num-prompts ${AB_PROMPTS:-128} \
             --deadline $(( lim - ($(date +%s) - ts) - 25 )) --port $port --workdir /tmp/abw_${shape}chain \
             --out $OUT/$cout --save-output-ids --no-progress ${AB_EXTRA:-} \
             ${AB_SERVER_ARGS:+--server-args "$AB_SERVER_ARGS"} \
        && { ok=0; for rep in $(if [ "${AB_CLIENT:-ab}" = bench_serving ]; then serving_reports $OUT/$cout ${AB_WORKLOAD:-random}; else echo $OUT/$cout; fi); do
               python3 $REPO/bench/scale/chain_pair.py check-outputs $rep.json \
                 $sd/${shape}chain_target/perm.json --arm all --record || ok=1; done; [ $ok = 0 ]; }; fi; } > $LOG/$st.log 2>&1; rc=$?
      tar -czf $OUT/scalechain_logs_$shape.tgz -C /tmp abw_${shape}chain 2>/dev/null
      grep -a -E "^\{|^written|^chain|^\||^\[|wrote|Error" $LOG/$st.log | tail -40 | cut -c1-400 > $LOG/$st.res ;;
    scalecode_*)  # bench/scale on the code pair (issue 42 item 3): needs /tmp/models/code_pair.json (codepair_train in
                  # this call or on this warm machine); a name ending in _l<N>: N layers (SCALE_LAYERS otherwise)
      local shape=${st#scalecode_} sd=/tmp/models; local nl=${SCALE_LAYERS:-}
      if [[ "$shape" =~ ^(.*)_l([0-9]+)$ ]]; then shape=${BASH_REMATCH[1]}; nl=${BASH_REMATCH[2]}; fi
      local ct=$sd/code_target cdr=$sd/code_drafter cpr=$sd/code_heldout_prompts.json junk=$sd/code_junk_head.json
      local big=$sd/${shape}code_target sarms sout scl=()
      if [ "${AB_CLIENT:-bench_serving}" = bench_serving ]; then
        scl=(--client bench_serving --workload ${AB_WORKLOAD:-natural}); sarms=${AB_ARMS:-base,dflash,ddtree}
        sout=$(serving_out serving_h200_${shape}code ${AB_WORKLOAD:-natural})
      else
        sarms=${AB_ARMS:-base,dflash,ddtree_b15,ddtree_b31,ddtree_b63}; sout=ab_h200_${shape}code
      fi
      if [ ! -f $sd/code_pair.json ]; then
        echo "scalecode: /tmp/models/code_pair.json is missing (a fresh machine): run codepair_train first" > $LOG/$st.log; rc=3
      else
        { if [ -z "${SCALE_REWRITE:-}" ] && [ -f $big/config.json ] && cmp -s $sd/code_pair.json $big/scaled_from_code_pair.json \
               && [ -f $junk ]; then
            echo "reusing $big (written from this code_pair.json)"
          else
            timeout -k 10 $lim python3 $REPO/bench/scale/vocab.py --pair code --target-dir $ct --drafter-dir $cdr \
              --train-stream ${CODEPAIR_WORK:-/tmp/codepair}/corpus/train.pt --prompts $cpr --out $junk --device cuda \
            && echo "junk rows at $(( $(date +%s) - ts ))s" \
            && timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 $REPO/bench/scale/transform.py write --shape $shape \
                 --out $sd ${nl:+--layers $nl} --pair code --target-dir $ct --drafter-dir $cdr --junk $junk \
            && cp $sd/code_pair.json $big/scaled_from_code_pair.json \
            && echo "written at $(( $(date +%s) - ts ))s, disk: $(du -sh $big | cut -f1)"
          fi \
          && { [ -n "${EXACT_SKIP:-}" ] || { timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 $REPO/bench/scale/exactness.py \
               --model-path $big --out $OUT/scale_exactness_${shape}code_h200${EXACT_NO_SERVE:+_fp32ref} --pair code \
               --small-target $ct --junk $junk --prompts $cpr --small-dir $sd/smallcode_ext_target \
               ${EXACT_NO_SERVE:+--no-serve} ${EXACT_PROMPTS:+--max-prompts $EXACT_PROMPTS} \
               && echo "exactness done at $(( $(date +%s) - ts ))s"; }; } \
          && { [ "${AB_ARMS:-}" = none ] || timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 -P -m sglang_ddtree.ab \
               --model-path $big --draft-model-path $sd/${shape}code_drafter --prompts $cpr \
               --arms $sarms "${scl[@]}" --concurrency ${AB_CONCURRENCY:-1,16} --num-prompts ${AB_PROMPTS:-64} \
               --max-new-tokens ${AB_NEW:-256} ${AB_SERVER_ARGS:+--server-args "$AB_SERVER_ARGS"} \
               --deadline $(( lim - ($(date +%s) - ts) - 25 )) --port $port --workdir /tmp/abw_${shape}code \
               --out $OUT/$sout --save-output-ids --no-progress ${AB_EXTRA:-}; }; } > $LOG/$st.log 2>&1; rc=$?
        cp $sd/code_pair.json $OUT/scale_code_pair.json
        [ -f $junk ] && cp $junk $OUT/${shape}code_junk_head.json
      fi
      [ -d /tmp/abw_${shape}code ] && tar -czf $OUT/scale_logs_${shape}code.tgz -C /tmp abw_${shape}code 2>/dev/null
      grep -a -E "^\{\"target|^reusing|^junk rows|^written|^reference rows|^exactness|^\||^\[|wrote|Error|scalecode:" $LOG/$st.log \
        | tail -40 | cut -c1-400 > $LOG/$st.res ;;
    scale_*)  # bench/scale: the text pair at a production shape (scale_qwen3-8b, scale_qwen3-30b-a3b):
              # transform.py writes it, exactness.py checks its greedy tokens, then the A/B on it through
              # python -m sglang_ddtree.ab (the installed sglang-ddtree-ab command's code path)
              # (SCALE_LAYERS: fewer layers; DRAFTER_RUN: a bench/textpair/train.py output folder whose
              # drafter replaces the shipped one; AB_ARMS / AB_CONCURRENCY / AB_PROMPTS / AB_NEW as for ab_*;
              # EXACT_NO_SERVE=1: exactness.py's fp32 reference rows only (SGLang 0.5.16 cannot serve Qwen3 in
              # fp32: sgl_kernel's rmsnorm has no float kernel); AB_ARMS=none: no A/B)
              # (a name ending in _l<N>, e.g. scale_qwen3-30b-a3b_l24: N layers for that stage only, over SCALE_LAYERS;
              # AB_ARMS=none also deletes the written pair at the end: the next stage's disk)
      # (AB_CLIENT=bench_serving / AB_WORKLOAD as for ab_*: the A/B through sglang.bench_serving, arms default
      # base,dflash,ddtree, report serving_h200_<shape>_<workload>)
      local shape=${st#scale_}; local sd=/tmp/models; local nl=${SCALE_LAYERS:-}
      if [[ "$shape" =~ ^(.*)_l([0-9]+)$ ]]; then shape=${BASH_REMATCH[1]}; nl=${BASH_REMATCH[2]}; fi
      local scl=() sarms=${AB_ARMS:-base,dflash,ddtree_b16} sout=scale_ab_${shape}_h200
      if [ "${AB_CLIENT:-ab}" = bench_serving ]; then
        scl=(--client bench_serving --workload ${AB_WORKLOAD:-random}); sarms=${AB_ARMS:-base,dflash,ddtree}
        sout=$(serving_out serving_h200_${shape} ${AB_WORKLOAD:-random})
      fi
      { timeout -k 10 $lim python3 $REPO/bench/scale/transform.py write --shape $shape --out $sd ${nl:+--layers $nl} \
        ${DRAFTER_RUN:+--drafter-run $DRAFTER_RUN} \
        && echo "written at $(( $(date +%s) - ts ))s, disk: $(du -sh $sd/${shape}_target | cut -f1)" \
        && timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 $REPO/bench/scale/exactness.py --model-path $sd/${shape}_target \
             --out $OUT/scale_exactness_${shape}_h200${EXACT_NO_SERVE:+_fp32ref} --small-dir $sd/small_ext_target \
             ${EXACT_NO_SERVE:+--no-serve} \
        && echo "exactness done at $(( $(date +%s) - ts ))s" \
        && { [ "${AB_ARMS:-}" = none ] || timeout -k 10 $(( lim - ($(date +%s) - ts) )) python3 -P -m sglang_ddtree.ab --pair text \
             --model-path $sd/${shape}_target --draft-model-path $sd/${shape}_drafter \
             --arms $sarms "${scl[@]}" --concurrency ${AB_CONCURRENCY:-1,16} --num-prompts ${AB_PROMPTS:-64} \
             --max-new-tokens ${AB_NEW:-96} --deadline $(( lim - ($(date +%s) - ts) - 25 )) --port $port \
             --workdir /tmp/abw_$shape --out $OUT/$sout --save-output-ids --no-progress ${AB_EXTRA:-}; }; } > $LOG/$st.log 2>&1; rc=$?
      [ "${AB_ARMS:-}" = none ] && rm -rf $sd/${shape}_target $sd/${shape}_drafter $sd/small_ext_target
      [ -d /tmp/abw_$shape ] && tar -czf $OUT/scale_logs_$shape.tgz -C /tmp abw_$shape 2>/dev/null
      grep -a -E "^\{\"target|^written|^reference rows|^exactness|^\||^\[|wrote|Error" $LOG/$st.log | tail -40 | cut -c1-400 > $LOG/$st.res ;;
    soak_*)  # bench/soak.py on the text pair: the mixed 1,000-request load on a DDTREE-GPU HTTP server, then a
             # plain server replays the greedy requests (SOAK_EXTRA: e.g. "--requests 300 --budget 32")
      timeout -k 10 $lim python3 $REPO/bench/soak.py run --model-path /tmp/models/text_target \
        --draft-model-path /tmp/models/text_drafter --out $OUT/soak_h200 --port $port ${SOAK_EXTRA:-} > $LOG/$st.log 2>&1; rc=$?
      tail -60 $LOG/$st.log | cut -c1-400 > $LOG/$st.res ;;
    pytest_gpu*)  # the test suite on CUDA, SGLang from the kit; -P: the checkout root never on sys.path.
                  # pytest_gpu-1 / pytest_gpu-2: the test files a..o / p..z (two lanes side by side)
      local part=${st#pytest_gpu}; part=${part#-}; local files=$REPO/tests
      [ "$part" = 1 ] && files=$(ls $REPO/tests/test_[a-o]*.py)
      [ "$part" = 2 ] && files=$(ls $REPO/tests/test_[p-z]*.py)
      case "$part" in ""|1|2) ;; *) files=$REPO/tests/test_$part.py ;; esac  # pytest_gpu-plugin: one file
      timeout -k 10 $lim python3 -P -m pytest -v -p no:cacheprovider -W ignore::DeprecationWarning -rfEs --tb=short \
        $files > $OUT/pytest_gpu_h200${part:+_$part}.log 2>&1; rc=$?
      grep -a -E "FAILED|ERROR|passed|failed" $OUT/pytest_gpu_h200${part:+_$part}.log | tail -25 | cut -c1-300 > $LOG/$st.res ;;
    verify_attn|verify_attn_quick)  # bench/verify_attention.py: ours vs floor / SGLang extend / flashinfer
      # VA_EXTRA: more flags, e.g. "--tune --deadline 300" or "--archs mla --bss 1,8"
      local q=(); [ "$st" = verify_attn_quick ] && q=(--quick)
      timeout -k 10 $lim python3 -P $REPO/bench/verify_attention.py --out $OUT/verify_attention_h200 "${q[@]}" ${VA_EXTRA:-} > $LOG/$st.log 2>&1; rc=$?
      tail -12 $LOG/$st.log | cut -c1-300 > $LOG/$st.res ;;
    sampledmem)  # bench/sampled_memory.py: the sampled accept's peak memory and time, SGLang's recipe vs ours
      timeout -k 10 $lim python3 -P $REPO/bench/sampled_memory.py --out $OUT/sampled_memory_h200 > $LOG/$st.log 2>&1; rc=$?
      tail -12 $LOG/$st.log | cut -c1-300 > $LOG/$st.res ;;
    logprobs_text)  # issue 15 item 3: DDTREE-GPU's log-probabilities (SGLANG_DDTREE_LOGPROBS=1) vs a plain server
      timeout -k 10 $lim python3 $REPO/bench/logprobs_check.py --model-path /tmp/models/text_target \
        --draft-model-path /tmp/models/text_drafter --prompts /tmp/models/heldout_prompts.json \
        --out $OUT/logprobs_h200 --port $port --deadline $((lim-15)) > $LOG/$st.log 2>&1; rc=$?
      tail -30 $LOG/$st.log | cut -c1-300 > $LOG/$st.res ;;
    int4logits)  # issue 14: the INT4 server's (and DDTree's) top-5 log-probs vs the dequantized twin's fp32 function
      timeout -k 10 $lim python3 $REPO/bench/int4_logits_check.py --int4 /tmp/models/mlaint4_target \
        --ref /tmp/models/mlaint4ref_target --draft-model-path /tmp/models/drafter \
        --out $OUT/int4_logits_h200 --port $port --deadline $((lim-15)) > $LOG/$st.log 2>&1; rc=$?
      tail -16 $LOG/$st.log | cut -c1-300 > $LOG/$st.res ;;
    badids_text)  # does an out-of-vocabulary token id kill plain SGLang 0.5.16 / a server with the plugin?
      timeout -k 10 $lim python3 $REPO/bench/soak.py probe --model-path /tmp/models/text_target \
        --out $OUT/badids_h200 --port $port > $LOG/$st.log 2>&1; rc=$?
      tail -40 $LOG/$st.log | cut -c1-400 > $LOG/$st.res ;;
    prompts_*)  # the A/B prompts of a pair as this host's stdlib generates them (JSON lines with input_ids)
      timeout -k 5 $lim python3 $REPO/bench/ab_serve.py --pair ${st#prompts_} --num-prompts ${AB_PROMPTS:-128} --dry-run \
        --no-env-probe --save-prompts $OUT/prompts_${st#prompts_}.jsonl > $LOG/$st.log 2>&1; rc=$?
      tail -1 $LOG/$st.log | cut -c1-300 > $LOG/$st.res ;;
    sweep)  # the A/B report's kernel-level part alone: GPU build_tree vs the CPU heap, bs 1..256 (no server)
      timeout -k 10 $lim python3 $REPO/bench/ab_serve.py --kernel-sweep-only --deadline $((lim-15)) --workdir /tmp/abw_sweep \
        --out $OUT/ab_sweep_h200 --no-progress > $LOG/$st.log 2>&1; rc=$?
      grep -a -E "kernel sweep|wrote|Error" $LOG/$st.log | tail -10 > $LOG/$st.res ;;
    plugin_probe)
      timeout -k 5 $lim python3 -P -c "from importlib.metadata import entry_points as e; print([(x.name,x.value) for x in e(group='sglang.srt.plugins')]); from sglang.srt.plugins import load_plugins; load_plugins()" > $LOG/$st.log 2>&1; rc=$?
      tail -5 $LOG/$st.log > $LOG/$st.res ;;
    codepair_train)  # issue 42: bench/codepair/recipe.py (corpus from this host's sources, target, block-16 drafter,
                     # offline acceptance, HF folders in /tmp/models); resumes a warm machine's CODEPAIR_WORK
      timeout -k 10 $lim python3 $REPO/bench/codepair/recipe.py --work ${CODEPAIR_WORK:-/tmp/codepair} --models /tmp/models \
        --out-dir $OUT --deadline $((lim - 20)) ${CODEPAIR_ARGS:-} > $LOG/$st.log 2>&1; rc=$?
      cp $LOG/$st.log $OUT/codepair_train.log
      grep -a -E "^\[ *[0-9.]+s\]|Error|Traceback" $LOG/$st.log | tail -30 | cut -c1-400 > $LOG/$st.res ;;
    codepair_ab)  # the A/B on the code pair codepair_train wrote (this call or this warm machine)
      if [ ! -f /tmp/models/code_pair.json ]; then
        echo "codepair_ab: /tmp/models/code_pair.json is missing (a fresh machine): run codepair_train first" > $LOG/$st.log; rc=3
      else
        local cpa=(--model-path /tmp/models/code_target --draft-model-path /tmp/models/code_drafter
                   --prompts /tmp/models/code_heldout_prompts.json) ccl=() cout=ab_h200_codepair
        local carms=${AB_ARMS:-base,dflash,ddtree_b15,ddtree_b31,ddtree_b63}
        if [ "${AB_CLIENT:-ab}" = bench_serving ]; then
          ccl=(--client bench_serving --workload ${AB_WORKLOAD:-natural}); carms=${AB_ARMS:-base,dflash,ddtree}
          cout=$(serving_out serving_h200_codepair ${AB_WORKLOAD:-natural})
        fi
        # CODEPAIR_CLASSIFY_S (default 90) seconds are kept for bench/ab_divergence.py: the mismatches
        # against base classified (near tie / error) on the pair's own fp32 forward, here, because
        # the pair never leaves this machine; 0: not classified
        local ccs=${CODEPAIR_CLASSIFY_S:-90}
        timeout -k 10 $((lim - ccs)) python3 -P -m sglang_ddtree.ab "${cpa[@]}" --arms $carms "${ccl[@]}" \
          --concurrency ${AB_CONCURRENCY:-1,16} --num-prompts ${AB_PROMPTS:-64} --max-new-tokens ${AB_NEW:-256} \
          ${AB_SERVER_ARGS:+--server-args "$AB_SERVER_ARGS"} --deadline $((lim-20-ccs)) --port $port --workdir /tmp/abw_codepair \
          --out $OUT/$cout --save-output-ids --no-progress ${AB_EXTRA:-} > $LOG/$st.log 2>&1; rc=$?
        if [ "$ccs" -gt 0 ] && [ -f $OUT/$cout.json ]; then
          timeout -k 5 $((ccs - 5)) python3 -P $REPO/bench/ab_divergence.py $OUT/$cout.json \
            --pair-dir /tmp/models/code_target >> $LOG/$st.log 2>&1 || echo "codepair_ab: classification failed or timed out" >> $LOG/$st.log
        fi
        cp /tmp/models/code_pair.json $OUT/code_pair.json
      fi
      [ -d /tmp/abw_codepair ] && tar -czf $OUT/ab_logs_codepair.tgz -C /tmp abw_codepair 2>/dev/null
      grep -a -E "^\[|wrote|Error|codepair_ab:|compared .*, diverged|vs itself at" $LOG/$st.log | tail -40 | cut -c1-400 > $LOG/$st.res ;;
    *)
      timeout -k 5 $lim python3 $DEV/stage.py $st /tmp/models $R $port > $LOG/$st.log 2>&1; rc=$?
      grep -a STAGE_RESULT $LOG/$st.log | cut -c1-1800 > $LOG/$st.res ;;
  esac
  local pids=$(grep -ao '\[ddtree-testbed\] register pid=[0-9]*' $LOG/$st.log | sort -u | wc -l)
  local sched=$(grep -a '\[ddtree-testbed\] register pid=' $LOG/$st.log | grep -c 'multiprocessing')
  local dd=$(grep -a -c 'Loaded plugin ddtree from group' $LOG/$st.log)
  local df=$(grep -a -c 'Failed to load plugin ddtree from group' $LOG/$st.log)
  local dx=$(grep -a -c 'Executed general plugin: ddtree$' $LOG/$st.log)
  local de=$(grep -a -c 'Failed to execute general plugin: ddtree$' $LOG/$st.log)
  {
    echo "[$name] rc=$rc took $(( $(date +%s) - ts ))s (ended at $(el)s); test-bed plugin registered in $pids processes" \
         "($sched spawned by SGLang); project entry point ddtree: loaded x$dd, load failed x$df (either = discovered)," \
         "register() ran x$dx, raised x$de"
    cat $LOG/$st.res 2>/dev/null
    grep -a -o "DDTREE-[A-Z]* tree round [0-9]*: bs=[0-9]* draft cuda graph=[A-Za-z]* target verify cuda graph=[A-Za-z]*" $LOG/$st.log | head -3
    grep -a -o "Using CompressedTensorsW[A-Za-z0-9]*[^\"]*" $LOG/$st.log | sort -u | head -2 | cut -c1-120
    grep -a -o "DDTREE-[A-Z]*: verify mask bound [0-9]* exceeds the CUDA-graph mask buffer at bs=[0-9]*: verify runs eagerly (round [0-9]* of this kind)" $LOG/$st.log | head -3
    if [ "$rc" != 0 ]; then grep -a -E "Error|error|Traceback|raise|Exception" $LOG/$st.log | grep -v -E "Warning|STAGE_RESULT|CAPTURE_STATS" | tail -10 | cut -c1-400; fi
  } > $LOG/$st.sum
  [ "$name" != "$st" ] && mv $LOG/$st.sum $LOG/$name.sum
}

i=0
IFS=';' read -ra GRPS <<< "$GROUPS_ARG"
# GROUP_CAPS="150,400": seconds per group, in order (else STAGE_CAP, default 220); empty = STAGE_CAP
IFS=',' read -ra GCAPS <<< "${GROUP_CAPS:-}"
g=0
for grp in "${GRPS[@]}"; do
  cap=${GCAPS[$g]:-${STAGE_CAP:-220}}; g=$((g+1))
  left=$(( DEADLINE - $(el) ))
  if [ $left -lt 60 ]; then echo "SKIP group '$grp' (deadline)" | tee -a $S; continue; fi
  lim=$left; [ $lim -gt $cap ] && lim=$cap
  echo "-- group [$grp] at $(el)s, limit ${lim}s, gpu mem used $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)" | tee -a $S
  # a trainer beside the engines (codepair_train next to the lossless gate): the engines' memory check
  # must not count the trainer's tens of GB against them (stage.py, DDTREE_STAGE_MEM_FRACTION)
  unset DDTREE_STAGE_MEM_FRACTION; [[ " $grp " == *" codepair_train "* ]] && export DDTREE_STAGE_MEM_FRACTION=0.9
  for st in $grp; do
    i=$((i+1)); run_stage $st $((30000 + 100*i)) $lim &
  done
  wait
  for st in $grp; do cat $LOG/$st.sum | tee -a $S; done
done

# 5. bring back results, logs, fixtures and JIT caches ----------------------------------------
[ -f $R ] && python3 $DEV/stage.py summarize $R 2>&1 | tee -a $S
[ -d $OUT/fixtures ] && tar -cf $OUT/fixtures.tar -C $OUT fixtures && rm -rf $OUT/fixtures
tar -czf $OUT/logs.tar.gz -C /tmp tblogs 2>/dev/null
# JIT caches: sgl-kernel (tvm-ffi), Triton, flashinfer (its sampling renorm compiles ~107 s on a cold
# host).  xz -3 here (fast); `bash bench/device/carry.sh cache FILE` recompresses it with `xz -9e`
# on the CPU machine into .kit/cache.tar.xz (4.2 -> 2.9 MB in session 27): a call carries <= 60 MB.
# Triton needs only the cubin, the metadata json and the launcher .so of a cached kernel
# (triton 3.6 CompiledKernel reads whatever group files exist; the IR dumps are 75 % of the cache);
# flashinfer: every module but batch_prefill here; batch_prefill below, as far as the carry allows.
# the Marlin MoE module (bench/device/marlin_prebuild.sh) travels on its own: it may be large
if [ -f /tmp/marlin_build.log ]; then
  # MARLIN_WAIT=1: a build started by marlin_prebuild.sh is waited for (until the deadline), so its
  # module comes back even when the stages ended first
  while [ "${MARLIN_WAIT:-0}" = 1 ] && ! grep -q "marlin built" /tmp/marlin_build.log \
        && pgrep -f moe_wna16_marlin > /dev/null && [ $(el) -lt $((DEADLINE - 30)) ]; do sleep 5; done
  echo "marlin build: $(tail -2 /tmp/marlin_build.log | tr '\n' ' ' | cut -c1-300)" | tee -a $S
  M=$(cd / && find tmp/tvmcache -path '*moe_wna16_marlin*' -name '*.so' | head -1)
  [ -n "$M" ] && (cd / && tar -cf - $M | xz -T8 -6 > $OUT/marlin_moe.tar.xz) \
    && echo "marlin module $(du -h /$M | cut -f1), packed $(du -h $OUT/marlin_moe.tar.xz | cut -f1)" | tee -a $S
fi
(cd / && { find tmp/tvmcache -name '*.so' ! -path '*moe_wna16_marlin*'
           find tmp/tritoncache -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \)
           find tmp/fi -name '*.so' ! -path '*batch_prefill*' 2>/dev/null; } > /tmp/cachelist
 tar -cf - -T /tmp/cachelist | xz -T8 -3 > $OUT/cache.tar.xz)
# flashinfer's batch_prefill modules (every flashinfer server at a production shape builds them: its
# prefill, and its tensor-core decode), smallest first, while the packed cache stays within
# CACHE_BUDGET bytes of this host's fast xz -3 packing (default: 3/2 x `carry.sh cache-budget`, what
# the 60 MB bound leaves next to the carried tree and kit, as the carried .git lists the tree: `bash
# bench/device/carry.sh cache` recompresses the returned cache with xz -9e to ~2/3 (4.2 -> 2.9 MB in
# s27, 4.7 -> 3.1 MB in s38) and drops the largest of them while the call would pass the bound; the
# old budget, 1 MB under the bound at -3 sizes, left out the 8B shape's two head-dim-128 modules in
# s38, and the next lease's first 8B flashinfer server compiled them again: 277 s against 90 s)
BUDGET=${CACHE_BUDGET:-$(( $(bash $DEV/carry.sh cache-budget 2>/dev/null || echo 1000000) * 3 / 2 ))}
CUR=$(stat -c %s $OUT/cache.tar.xz); ADDED=0
for f in $(cd / && find tmp/fi -name '*.so' -path '*batch_prefill*' -printf '%s %p\n' 2>/dev/null | sort -n | cut -d' ' -f2-); do
  EST=$(xz -T8 -3 -c /$f | wc -c)
  if [ $((CUR + EST)) -le $BUDGET ]; then echo $f >> /tmp/cachelist; CUR=$((CUR + EST)); ADDED=$((ADDED + 1))
  else echo "flashinfer module left out of the cache (budget $BUDGET B): $(du -k /$f | cut -f1) KB, ~$((EST / 1024)) KB packed: $(basename $f .so | cut -c1-160)" | tee -a $S; fi
done
[ $ADDED -gt 0 ] && (cd / && tar -cf - -T /tmp/cachelist | xz -T8 -3 > $OUT/cache.tar.xz) \
  && echo "flashinfer batch_prefill modules in the cache: $ADDED (budget $BUDGET B)" | tee -a $S
echo "== end at $(el)s; cache $(du -h $OUT/cache.tar.xz | cut -f1)" | tee -a $S
# at most 8 files come back from $OUT: bundle the rest (A/B reports, prompts, sweep) into one tar
if [ $(find $OUT -maxdepth 1 -type f | wc -l) -gt 8 ]; then
  (cd $OUT && find . -maxdepth 1 -type f ! -name summary.txt ! -name cache.tar.xz ! -name logs.tar.gz ! -name results.jsonl \
     -printf '%f\n' > /tmp/bundle.list && tar -cf bundle.tar -T /tmp/bundle.list && xargs rm -f < /tmp/bundle.list)
  echo "bundled into bundle.tar: $(tr '\n' ' ' < /tmp/bundle.list)"
fi
