#!/usr/bin/env bash
# Issue 12 on the H200 (FlashInfer 0.5.3). Results under $OUT/results-<stage>.tgz.
#   a   carry .gpu/flashinfer .gpu/flashinfer-aot.tgz: host_bench (prepare vs raw plan, 8-layer decode),
#       flashinfer_bench (wrapper plan overhead), runner_bench (32 layers, 64 x 8192); compiled modules back
#   b   (machine kept warm from a, or carry as for a): the GPU test suite with durations, bounded_bench
#   c   (as b; ran at 233bb63): where prepare()'s host time goes (profile_plan), the bounded decode sweep with
#       and without Triton's default specialisation (MSTAR_BOUNDED_SPECIALIZE, since removed), bounded GPU tests
#   d   (as a): the final pass: every benchmark, the GPU test suite with durations, profile_plan
#   e   (as a): after the review commit (bench/timing.py restructured): the benchmarks that use it, once more
#   f   (as a): bounded decode with kernels timed back to back (launch cost excluded), twice
stage=${1:?stage}
source "$(dirname "$0")/gpu_lib.sh"
setup() {
  if [ ! -d /tmp/site-flashinfer/flashinfer ]; then source .gpu/env.sh flashinfer || exit 1; fi
  export PYTHONPATH=/tmp/site-flashinfer
  python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
  { nvidia-smi -L; python3 -c "import torch,sys,flashinfer;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0],'flashinfer',flashinfer.__version__)"; python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|numpy) "; echo "commit ${COMMIT:-unknown}"; } > "$R/env-$stage.txt" 2>&1; cat "$R/env-$stage.txt"
}
case $stage in
a)
  setup
  T 300 host_bench python3 bench/host_bench.py --out "$R" --commit "${COMMIT:-unknown}"
  T 170 flashinfer_bench python3 bench/flashinfer_bench.py --out "$R"
  T 100 runner_bench python3 bench/runner_bench.py --out "$R"
  bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null ;;
b)
  setup
  T 330 tests_gpu python3 -m pytest -m gpu tests/flashinfer tests/core tests/bounded -v -rs --durations=20 -p no:cacheprovider
  T 200 bounded_bench python3 bench/bounded_bench.py --out "$R" ;;
c)
  setup
  T 120 profile_plan python3 bench/profile_plan.py
  T 200 bounded_decode python3 bench/bounded_bench.py --out "$R/nospec" --sections decode
  T 200 bounded_decode_spec env MSTAR_BOUNDED_SPECIALIZE=1 python3 bench/bounded_bench.py --out "$R/spec" --sections decode
  T 200 tests_bounded python3 -m pytest -m gpu tests/bounded -v -rs --durations=10 -p no:cacheprovider ;;
d)
  setup
  T 300 host_bench python3 bench/host_bench.py --out "$R" --commit "${COMMIT:-unknown}"
  T 170 flashinfer_bench python3 bench/flashinfer_bench.py --out "$R"
  T 100 runner_bench python3 bench/runner_bench.py --out "$R"
  T 200 bounded_bench python3 bench/bounded_bench.py --out "$R"
  T 330 tests_gpu python3 -m pytest -m gpu tests/flashinfer tests/core tests/bounded -v -rs --durations=20 -p no:cacheprovider
  T 60 profile_plan python3 bench/profile_plan.py ;;
e)
  setup
  T 300 host_bench python3 bench/host_bench.py --out "$R" --commit "${COMMIT:-unknown}"
  T 170 flashinfer_bench python3 bench/flashinfer_bench.py --out "$R"
  T 100 runner_bench python3 bench/runner_bench.py --out "$R"
  T 200 bounded_bench python3 bench/bounded_bench.py --out "$R" --sections decode ;;
f)
  setup
  T 200 bounded_decode_1 python3 bench/bounded_bench.py --out "$R/1" --sections decode
  T 200 bounded_decode_2 python3 bench/bounded_bench.py --out "$R/2" --sections decode ;;
esac
