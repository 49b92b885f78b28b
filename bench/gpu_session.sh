#!/usr/bin/env bash
# One call on the H200 test machine: GPU tests and benchmarks, results under $OUT/results.tgz.
#   stage fi : carry .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz .gpu/save-flashinfer-aot.sh
#   stage fa3: carry .gpu/fa3 .gpu/env.sh   (on a machine kept warm from stage fi, both sets load)
# Every step has its own time limit so one hang cannot eat the call; its log says what ran.
# (no set -u: .gpu/env.sh reads unset variables)
stage=${1:?stage: fi or fa3}
source "$(dirname "$0")/gpu_lib.sh"
case $stage in fi*) source .gpu/env.sh flashinfer || exit 1;; *) source .gpu/env.sh fa3 || exit 1;; esac
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer -e ./plugins/fa3 -e ./plugins/rocm 2>&1 | tail -3
{ nvidia-smi; python3 -c "import torch,sys;print(torch.__version__,torch.version.cuda,sys.version)"; pip list 2>/dev/null | grep -iE "flashinfer|fa3|triton|torch"; } > "$R/env.txt" 2>&1
if [ "$stage" = fi ]; then
  T 40 profile_plan python3 bench/profile_plan.py
  T 240 tests_fi python3 -m pytest -m gpu tests/flashinfer tests/core tests/bounded -v --durations=25 -rs -p no:cacheprovider
  T 110 bench_flashinfer python3 bench/flashinfer_bench.py --out "$R"
  T 90 bench_runner python3 bench/runner_bench.py --out "$R"
  [ -n "${BOUNDED:-}" ] && T 60 bench_bounded python3 bench/bounded_bench.py --out "$R"
  T 30 save_aot bash .gpu/save-flashinfer-aot.sh
elif [ "$stage" = fi3 ]; then  # the final pass at HEAD: every flashinfer/core/bounded GPU test, the wrapper bench
  T 230 tests_fi python3 -m pytest -m gpu tests/flashinfer tests/core -q -rs -p no:cacheprovider
  T 90 bench_flashinfer python3 bench/flashinfer_bench.py --out "$R"
  T 170 tests_bounded python3 -m pytest -m gpu tests/bounded -q -rs --durations=5 -p no:cacheprovider
elif [ "$stage" = fi10 ]; then  # issue 10 (validation, per-step plans): GPU tests, and what the checks cost
  T 260 tests_fi python3 -m pytest -m gpu tests/flashinfer tests/core tests/bounded -q -rs -p no:cacheprovider
  T 100 bench_flashinfer python3 bench/flashinfer_bench.py --out "$R"
  T 120 bench_runner python3 bench/runner_bench.py --out "$R"
  T 30 save_aot bash .gpu/save-flashinfer-aot.sh
elif [ "$stage" = fi10b ]; then  # the GPU tests of fi10 with room (260 s was too little for all three folders)
  T 400 tests_fi_core python3 -m pytest -m gpu tests/flashinfer tests/core -v -rs --durations=20 -p no:cacheprovider
  T 150 tests_bounded python3 -m pytest -m gpu tests/bounded -v -rs --durations=10 -p no:cacheprovider
elif [ "$stage" = fi10c ]; then  # after the parked-pages change (graph warm-up rolls its dummy step back)
  T 150 bench_runner python3 bench/runner_bench.py --out "$R"
  T 380 tests_fi_core python3 -m pytest -m gpu tests/flashinfer tests/core -q -rs --durations=10 -p no:cacheprovider
elif [ "$stage" = fa310 ]; then  # issue 10 on the dense path: FA3 GPU tests, the denoise demo, the dense bench
  T 60 backends python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  T 220 tests_fa3 python3 -m pytest -m gpu tests/dense tests/registry -q -rs --durations=10 -p no:cacheprovider
  T 60 denoise_demo python3 -m mstar_core.cli demo --workload denoise --device cuda
  T 180 bench_dense python3 bench/dense_bench.py --out "$R"
elif [ "$stage" = fi2 ]; then  # after a core change: the runner's figures and the core GPU tests again
  T 120 tests_core python3 -m pytest -m gpu tests/core -v -rs -p no:cacheprovider
  T 120 bench_runner python3 bench/runner_bench.py --out "$R"
else
  T 60 backends python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  T 200 tests_fa3 python3 -m pytest -m gpu tests/dense tests/registry -v --durations=15 -rs -p no:cacheprovider
  T 150 bench_dense python3 bench/dense_bench.py --out "$R"
  T 60 denoise_demo python3 -m mstar_core.cli demo --workload denoise --device cuda
  T 150 tests_bounded python3 -m pytest -m gpu tests/bounded -v --durations=15 -rs -p no:cacheprovider
fi
log done
