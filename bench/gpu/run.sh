#!/usr/bin/env bash
# One GPU suite per call on the H200 test machine (no network there):
#
#   COMMIT=<sha> bash bench/gpu/run.sh SUITE [FLASHINFER_VERSION]
#
# Results: $OUT/<suite>.tgz holding r/<suite>/ (the flashinfer suite: $OUT/flashinfer-<version>.tgz
# holding r/flashinfer/<version>/): one log per step (<step>.txt, its exit status and wall seconds at
# the end), each benchmark's .json and .md, env.txt, commit.txt and summary.txt. Unpack it here with
# `tar xzf <file> -C /tmp/x` and copy /tmp/x/r/<suite> to results/h200/<suite>. FlashInfer modules
# compiled during the run come back as $OUT/flashinfer-aot-<version>.tgz (split into .part-* files
# over 15 MB: `cat` them together) to carry next time. COMMIT is recorded because the machine's copy
# of the tree may have no git history.
#
# What each suite carries (the device run's `carry`; wheel sets from ../shared/gpu/fetch-wheels.sh
# and bench/gpu/fetch_flashinfer.sh; at most 64 MiB a call, the tree included):
#   flashinfer [0.5.3]  .gpu/flashinfer and .gpu/flashinfer-aot-0.5.3.tgz, or on a first run
#                       .gpu/flashinfer-aot.tgz (+ .gpu/flashinfer-aot-features.tgz while it fits):
#                       the plugin's, core and registry GPU tests, the wrapper bench, warm-up then
#                       first use, `mstar backends`
#   wheel 0.7.4         one call per part, on one machine kept warm (it keeps /tmp): .gpu/fi-0.7.4/part1,
#                       then .gpu/fi-0.7.4/part2; the second call joins, checks and installs the wheel
#   flashinfer 0.7.4    then, on that machine: .gpu/fi-0.7.4-deps [.gpu/flashinfer-aot-0.7.4.tgz]
#   tests [VERSION]     the flashinfer suite's GPU tests alone (on a machine where that release is installed):
#                       from an empty 0.7.4 module cache its warm-up and tests do not fit one call together
#   runner              as flashinfer 0.5.3 (nothing on a machine where it ran): the step runner's decode
#                       loop and the host cost of a step
#   features            .gpu/flashinfer .gpu/flashinfer-aot-0.5.3.tgz (FP8 and soft-cap modules in it):
#                       bench/attention_features.py's FlashInfer sections
#   dense               .gpu/fa3 .gpu/env.sh: FA3 and dense-path GPU tests, the dense bench, FA3 features,
#                       the denoise demo (FlashInfer's variants too where a flashinfer suite ran on this
#                       machine before: its /tmp/fi-0.5.3 stays)
#   bounded             nothing beyond the tree: bounded KV GPU tests and bench (Triton is on the machine)
#   transformers        .gpu/flashinfer .gpu/flashinfer-aot-0.5.3.tgz: the transformers check and decode bench
#   tp                  as transformers, on kind nvidia-h200-x2: tensor parallelism over two GPUs
#   tp_generate         as transformers, on kind nvidia-h200-x2 (after smollm2 on that machine for SmolLM2's own weights):
#                       bench/tp_generate.py (MODELS, default smollm2,llama1b,llama1b_seed) and the transformers
#                       tensor-parallel tests
#   smollm2             one call per part of the SmolLM2-135M-Instruct GGUF file (98 MB; split under .gpu/smollm2/
#                       a, b, c; c with gguf-0.19.0-py3-none-any.whl and the file's sha256), on one machine kept
#                       warm: the call that brings the last part joins and checks it into /tmp/smollm2
#   compiled            as transformers (on that machine for SmolLM2): compiled steps' GPU tests and
#                       bench/compiled_decode.py (MODELS=smollm2,llama1b by default; SmolLM2 where /tmp/smollm2 holds it)
#   sampling            as transformers: the sampler's and compiled steps' GPU tests, bench/sampled_decode.py (sampled against
#                       greedy decode steps inside graphs)
#   check               .gpu/flashinfer and .gpu/flashinfer-aot-0.5.3.tgz, then (a second call on that machine) .gpu/fa3:
#                       `mstar check NAME --device cuda` for each of BACKENDS (default: flashinfer, or fa3 where
#                       .gpu/fa3 came), CHECK_ARGS added (e.g. --dtype bfloat16), each report as <name>.json, and
#                       the kit's own GPU tests (its device plants)
#   paged               call 1: .gpu/fa3 .gpu/env.sh (PAGED_STEPS="check tests"); call 2 on that machine: .gpu/flashinfer and
#                       .gpu/flashinfer-aot-0.5.3.tgz (PAGED_STEPS="bench models"): FA3's and FlashInfer's paged backends,
#                       the kit and GPU tests, bench/paged_backends.py (and the measured tables it writes into $R/tables),
#                       a gpt-oss-shaped model through the transformers integration (MODEL_BACKEND, default auto);
#                       PAGED_STEPS=sinks: FlashInfer's sink-logit GPU tests (SINKS_K: pytest -k, default the 64 head dim)
#   prefix              as transformers (on the smollm2 machine for SmolLM2's own weights; .gpu/flashinfer may stay behind
#                       where an earlier call on that machine installed it): bench/prefix_cache.py (MODELS=smollm2,smollm2_shape)
# Every step has its own time limit, and the whole suite stays within SUITE_S (default 560) seconds
# so that its results are packed before the call's 10-minute limit.
# (no set -u: the machine's PYTHONPATH may be unset)
suite=${1:?"suite: flashinfer [version] | tests [version] | wheel <version> | runner | features | dense | bounded | transformers | tp | tp_generate | smollm2 | compiled | sampling | prefix | check | paged"}
FI=${2:-0.5.3}
export PYTHONUNBUFFERED=1 OUT=${OUT:?run on the GPU machine, where OUT is set}
export COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
name=$suite; R=$OUT/r/$suite
if [ "$suite" = flashinfer ] || [ "$suite" = tests ]; then name=$suite-$FI; R=$OUT/r/$suite/$FI; fi
mkdir -p "$R"
END=$((SECONDS + ${SUITE_S:-560}))
finish() { tar czf "$OUT/$name.tgz" -C "$OUT" r && rm -rf "$OUT/r"; ls -la "$OUT"; }
trap finish EXIT

log() { echo "== $* ($(date +%T))"; }
# T LIMIT NAME CMD...: one step into $R/NAME.txt, within LIMIT seconds and the suite's time left
T() {
  local limit=$1 name=$2 left=$((END - SECONDS - 10)); shift 2
  if [ "$left" -lt 15 ]; then echo "$name skipped: the suite's time is spent" | tee -a "$R/summary.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "$name (limit ${limit} s)"; local s=$SECONDS
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1; local rc=$?
  echo "rc=$rc wall_s=$((SECONDS - s))" >> "$R/$name.txt"
  echo "$name rc=$rc wall_s=$((SECONDS - s))" >> "$R/summary.txt"; tail -4 "$R/$name.txt"
}
# the tests' own results files (tests/gpu_results.py writes into $OUT) land beside their log
# the suite sets its own torch threads (the CPU suite runs on one): the float64 oracles run on the host
gpu_tests() { T "$1" "$2" env OUT="$R" OMP_NUM_THREADS=16 python3 -m pytest -m gpu -q -rs --durations=10 -p no:cacheprovider "${@:3}"; }
envinfo() {
  { nvidia-smi -L; nproc
    python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0],'gpus',torch.cuda.device_count())"
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|flashinfer-python|tokenspeed-fa3|apache-tvm-ffi|nvidia-cudnn-frontend|cuda-|nccl|transformers|pytest) "
    echo "PYTHONPATH=$PYTHONPATH"; env | grep -E "^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=" | sort
  } > "$R/env.txt" 2>&1
  echo "$COMMIT" > "$R/commit.txt"; cat "$R/env.txt"
}
project() {  # the core and the named plugins, editable (setuptools is on the machine)
  local a=(-e .) p; for p in "$@"; do a+=(-e "./plugins/$p"); done
  python3 -m pip install -q --no-build-isolation --no-deps "${a[@]}" 2>&1 | tail -2
}

# FlashInfer VERSION alone on PYTHONPATH (/tmp/fi-VERSION), with its compiled modules where it loads
# them without compiling: 0.5.3 from .gpu/flashinfer; another release from the wheel that `wheel`
# installed there and its dependencies in .gpu/fi-VERSION-deps.
flashinfer_site() {
  local v=$1 site=/tmp/fi-$1 d a
  for d in $([ "$v" = 0.5.3 ] && echo .gpu/flashinfer || echo ".gpu/fi-$v-deps"); do
    [ -d "$d" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$d"/*.whl
  done
  [ -d "$site/flashinfer" ] || { echo "FlashInfer $v is not installed in $site (carry its wheels; see the header)"; return 1; }
  mkdir -p "$site/flashinfer/data/aot"
  for a in $([ "$v" = 0.5.3 ] && echo .gpu/flashinfer-aot.tgz .gpu/flashinfer-aot-features.tgz) ".gpu/flashinfer-aot-$v.tgz"; do
    [ -f "$a" ] && tar xzf "$a" -C "$site/flashinfer/data/aot" && echo "prebuilt modules from $a"
  done
  echo "$(ls "$site/flashinfer/data/aot" | wc -l) prebuilt modules"
  export PYTHONPATH=$site${EXTRA_PATH:+:$EXTRA_PATH}
}
# every module prebuilt or compiled so far -> $OUT/flashinfer-aot-VERSION.tgz, when this run compiled any
flashinfer_modules_out() {
  local v=$1 t c d; t=$(mktemp -d)
  ls ~/.cache/flashinfer/"$v"/*/cached_ops/*/*.so >/dev/null 2>&1 || { echo "no module compiled in this run"; return; }
  cp -r "/tmp/fi-$v/flashinfer/data/aot/." "$t/" 2>/dev/null
  for c in ~/.cache/flashinfer/"$v"/*/cached_ops; do
    (cd "$c" && for d in */; do d=${d%/}; [ -f "$d/$d.so" ] && mkdir -p "$t/$d" && cp "$d/$d.so" "$t/$d/"; done)
  done
  tar czf "$OUT/flashinfer-aot-$v.tgz" -C "$t" . && rm -rf "$t"
  if [ "$(stat -c %s "$OUT/flashinfer-aot-$v.tgz")" -gt 15000000 ]; then  # a file coming back is at most 16 MiB
    split -b 15000000 "$OUT/flashinfer-aot-$v.tgz" "$OUT/flashinfer-aot-$v.tgz.part-" && rm "$OUT/flashinfer-aot-$v.tgz"
  fi
}

case $suite in
flashinfer)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  T 60 backends python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  # on an empty module cache this is where the compiles happen (minutes): the tests then load them
  T 480 warmup_first_use python3 bench/warmup_first_use.py --out "$R" --window 128
  gpu_tests 300 tests tests/plugins/flashinfer tests/node tests/kv tests/attention tests/registry tests/testing \
    tests/test_warmup.py
  T 120 flashinfer_wrappers python3 bench/flashinfer_wrappers.py --out "$R"
  flashinfer_modules_out "$FI" ;;
tests)  # the flashinfer suite's GPU tests alone, with the whole call's time (a release whose modules compile in them)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  gpu_tests 540 tests tests/plugins/flashinfer tests/node tests/kv tests/attention tests/registry tests/testing \
    tests/test_warmup.py
  flashinfer_modules_out "$FI" ;;
runner)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  T 150 runner_steps python3 bench/runner_steps.py --out "$R"
  T 200 host_cost python3 bench/host_cost.py --out "$R"
  flashinfer_modules_out "$FI" ;;
wheel)  # a FlashInfer wheel over 64 MiB, carried in parts (bench/gpu/fetch_flashinfer.sh) onto a warm machine
  [ -n "$2" ] || { echo "wheel: which version?"; exit 2; }
  store=/tmp/fi-wheel-$FI; mkdir -p "$store"
  cp .gpu/fi-"$FI"/part*/* "$store"/ 2>/dev/null
  have=$(ls "$store"/*.part-* 2>/dev/null | wc -l); want=$(cat "$store/parts" 2>/dev/null || echo "?")
  echo "parts here: $have of $want" | tee "$R/wheel.txt"
  if [ "$have" = "$want" ]; then
    whl=$store/$(cat "$store/name")
    cat "$store"/*.part-* > "$whl"
    (cd "$store" && sha256sum -c sha256) >> "$R/wheel.txt" 2>&1 || { echo "the joined wheel's sha256 differs"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/fi-$FI" "$whl" \
      && echo "installed in /tmp/fi-$FI" | tee -a "$R/wheel.txt"
  fi ;;
features)
  flashinfer_site "$FI" || exit 1; project flashinfer fa3; envinfo
  T 500 attention_features python3 bench/attention_features.py --out "$R" \
    --sections fp8,softcap,window,multitoken,multitoken_kernels
  flashinfer_modules_out "$FI" ;;
dense)
  source .gpu/env.sh fa3 || exit 1
  [ -d "/tmp/fi-$FI/flashinfer" ] && export PYTHONPATH=$PYTHONPATH:/tmp/fi-$FI
  project fa3 flashinfer; envinfo
  T 60 backends python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  gpu_tests 240 tests tests/attention tests/backends tests/plugins/fa3 tests/registry tests/testing tests/demo
  T 60 denoise_demo python3 -m mstar_core.cli demo --workload denoise --device cuda
  T 180 dense_prefill python3 bench/dense_prefill.py --out "$R"
  T 150 attention_features_fa3 python3 bench/attention_features.py --out "$R" --sections fa3 ;;
bounded)
  [ -d "/tmp/fi-$FI/flashinfer" ] && export PYTHONPATH=/tmp/fi-$FI
  project; envinfo
  gpu_tests 240 tests tests/kv/bounded tests/kernels
  T 200 bounded_decode python3 bench/bounded_decode.py --out "$R" ;;
transformers)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  T 320 transformers_decode python3 bench/transformers_decode.py --device cuda --out "$R"
  T 240 transformers_check python3 bench/transformers_check.py --device cuda --out "$R"
  flashinfer_modules_out "$FI" ;;
tp)
  # NVLink multicast stays off on this machine (the device notes): refuse to run without those settings
  [ "${NCCL_NVLS_ENABLE:-}" = 0 ] && [ "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" = 1 ] && [ "${NVSHMEM_DISABLE_NVLS:-}" = 1 ] \
    || { echo "NVLink multicast is not switched off here: not running"; exit 1; }
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo; nvidia-smi topo -m >> "$R/env.txt" 2>&1
  T 120 demo_tp1 python3 -m mstar_core.cli demo --device cuda
  T 120 demo_tp2 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mstar_core.cli demo --tp 2 --device cuda
  T 240 tp_scaling python3 bench/tp_scaling.py --out "$R"
  T 120 tp_failure_graphs python3 bench/tp_failure.py --graphs --timeout 20 --out "$R"
  T 120 tp_failure_eager python3 bench/tp_failure.py --timeout 20 --out "$R"
  gpu_tests 300 tests tests/distributed tests/node/test_gpu_runner.py tests/node/test_multi_token_decode.py
  flashinfer_modules_out "$FI" ;;
tp_generate)
  [ "${NCCL_NVLS_ENABLE:-}" = 0 ] && [ "${TORCH_SYMM_MEM_DISABLE_MULTICAST:-}" = 1 ] && [ "${NVSHMEM_DISABLE_NVLS:-}" = 1 ] \
    || { echo "NVLink multicast is not switched off here: not running"; exit 1; }
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo; nvidia-smi topo -m >> "$R/env.txt" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site-gguf
  smol=(); [ -f /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && smol=(--smol /tmp/smollm2)
  T 340 tp_generate python3 bench/tp_generate.py --out "$R" --models "${MODELS:-smollm2,llama1b,llama1b_seed}" \
    --work /tmp/tp_generate "${smol[@]}"
  gpu_tests 200 tests tests/integrations/transformers/test_gpu_tensor_parallel.py
  flashinfer_modules_out "$FI" ;;
smollm2)
  store=/tmp/smollm2-parts; mkdir -p "$store" /tmp/smollm2
  cp .gpu/smollm2/*/* "$store"/ 2>/dev/null
  ls -la "$store" | tee "$R/smollm2.txt"
  if [ -f "$store/gguf.part-a" ] && [ -f "$store/gguf.part-b" ] && [ -f "$store/gguf.part-c" ]; then
    cat "$store"/gguf.part-a "$store"/gguf.part-b "$store"/gguf.part-c > /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/smollm2 && sha256sum -c "$store/sha256") >> "$R/smollm2.txt" 2>&1 || { echo "the joined file's sha256 differs"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-gguf \
      "$store"/gguf-*.whl && echo "gguf in /tmp/site-gguf" | tee -a "$R/smollm2.txt"
  fi ;;
compiled)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  export PYTHONPATH=$PYTHONPATH:/tmp/site-gguf
  gpu_tests 200 tests tests/compiling tests/integrations/transformers/test_compiled.py
  smol=(); [ -f /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && smol=(--smol /tmp/smollm2)
  T 540 compiled_decode python3 bench/compiled_decode.py --out "$R" --models "${MODELS:-smollm2,llama1b}" "${smol[@]}"
  flashinfer_modules_out "$FI" ;;
sampling)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  gpu_tests 200 tests tests/sampling tests/compiling
  T 420 sampled_decode python3 bench/sampled_decode.py --out "$R"
  flashinfer_modules_out "$FI" ;;
prefix)
  flashinfer_site "$FI" || exit 1; project flashinfer; envinfo
  export PYTHONPATH=$PYTHONPATH:/tmp/site-gguf
  smol=(); [ -f /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ] && smol=(--smol /tmp/smollm2)
  T 540 prefix_cache python3 bench/prefix_cache.py --out "$R" --models "${MODELS:-smollm2,smollm2_shape}" "${smol[@]}"
  flashinfer_modules_out "$FI" ;;
check)  # the conformance kit on the real libraries; FlashInfer stays installed in /tmp/fi-0.5.3 between calls
  if [ -d .gpu/fa3 ]; then source .gpu/env.sh fa3 || exit 1; fi
  if [ -d .gpu/flashinfer ] || [ -d "/tmp/fi-$FI/flashinfer" ]; then
    EXTRA_PATH=$PYTHONPATH flashinfer_site "$FI" || exit 1
  fi
  project flashinfer fa3; envinfo
  for b in ${BACKENDS:-$([ -d .gpu/fa3 ] && echo fa3 || echo flashinfer)}; do
    # the report (JSON) into its own file; the progress lines and the table's exit status into the log
    T 540 "check_$b" bash -c "python3 -m mstar_core.cli check $b --device cuda --json $CHECK_ARGS > $R/check_$b.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['backend'], d['label'], 'ok' if d['ok'] else 'FAILED', d['passed'], 'passed', d['failed'], 'failed; not covered:', d['not_covered'])" \
      "$R/check_$b.json" >> "$R/summary.txt" 2>&1
  done
  [ -n "$KIT_TESTS" ] && gpu_tests 120 kit_tests tests/testing tests/registry
  flashinfer_modules_out "$FI" ;;
paged)  # FA3's and FlashInfer's paged backends; PAGED_STEPS picks the steps (FA3 stays in /tmp/site-fa3 between calls)
  if [ -d .gpu/fa3 ]; then source .gpu/env.sh fa3 || exit 1; fi
  if [ -d /tmp/site-fa3 ]; then case ":$PYTHONPATH:" in *:/tmp/site-fa3:*) ;; *) export PYTHONPATH=/tmp/site-fa3${PYTHONPATH:+:$PYTHONPATH};; esac; fi
  if [ -d .gpu/flashinfer ] || [ -d "/tmp/fi-$FI/flashinfer" ]; then EXTRA_PATH=$PYTHONPATH flashinfer_site "$FI" || exit 1; fi
  project flashinfer fa3; envinfo
  for step in ${PAGED_STEPS:-check}; do
    case $step in
    check)  # the kit on FA3 (paged: eager and graph replay; the dense path) and, where it is here, FlashInfer
      for b in ${BACKENDS:-fa3}; do
        T 300 "check_$b" bash -c "python3 -m mstar_core.cli check $b --device cuda --json $CHECK_ARGS > $R/check_$b.json"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['backend'], 'ok' if d['ok'] else 'FAILED', d['passed'], 'passed', d['failed'], 'failed')" \
          "$R/check_$b.json" >> "$R/summary.txt" 2>&1
      done ;;
    tests) gpu_tests 240 tests ${PAGED_TESTS:-tests/plugins tests/registry tests/testing tests/attention} ;;
    sinks)  # FlashInfer's sink-logit variant against the float64 oracle, eager and replayed (each head dim compiles its own)
      gpu_tests 330 sinks tests/plugins/flashinfer/test_gpu_sinks.py -k "${SINKS_K:-64}" ;;
    bench)  # both backends against their raw calls; the measured tables, then what auto picks from them
      T 240 paged_backends python3 bench/paged_backends.py --out "$R" --tables "$R/tables" --commit "$COMMIT"
      for p in mstar_fa3 mstar_flashinfer; do [ -f "$R/tables/$p/measured.json" ] && cp "$R/tables/$p/measured.json" "$p/"; done
      T 60 backends python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
      T 60 backends_json python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128 --json ;;
    models)  # a gpt-oss-shaped model (alternating windows, sink logits) through the transformers integration
      T 240 transformers_check python3 bench/transformers_check.py --device cuda --archs gpt_oss --backend "${MODEL_BACKEND:-auto}" --out "$R"
      T 240 transformers_decode python3 bench/transformers_decode.py --device cuda --arch gpt_oss --layers 16 \
        --backend "${MODEL_BACKEND:-auto}" --paths mstar --out "$R" ;;
    esac
  done
  flashinfer_modules_out "$FI" ;;
*) echo "unknown suite $suite"; exit 2 ;;
esac
log done
