#!/usr/bin/env bash
# Issue 13 on the H200. Results under $OUT/results-<stage>.tgz.
#   fi   carry .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz .gpu/save-flashinfer-aot.sh: the feature GPU
#        tests on the real FlashInfer 0.5.3 (conformance per declared feature, an FP8 step mixing windowed and
#        full layers, multi-token decode replayed from graphs); compiled modules back
#   fi2  (as fi, after the FP8 prefill fix): the feature GPU tests again, then bench/features_bench.py's FlashInfer
#        sections (fp8, softcap, window, multitoken); compiled modules back
#   fi3  (as fi): the FP8 manager test and multi-token decode after the fixes (short-row graph prefill on fa2)
#   final (as fi): after features_bench's multi-token loop moved onto mstar_core.demo.decode_bench: that
#        section again, and `mstar bench --query-tokens 1|4` (64 x 8192, 32 layers, graphs + pre-plan)
#   review (as fi): after the review commit: the FlashInfer feature and conformance GPU tests
#   fa3  carry .gpu/fa3 .gpu/env.sh: the dense path's feature GPU tests on the real FA3 (and FlashInfer's ragged
#        prefill, installed by an earlier stage on a warm machine), features_bench's FA3 section
stage=${1:?stage}
source "$(dirname "$0")/gpu_lib.sh"
setup() {  # $1: the wheel set carried this time
  if [ ! -d "/tmp/site-$1" ]; then source .gpu/env.sh "$1" || exit 1; else source .gpu/env.sh "$1" >/dev/null 2>&1; fi
  python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer -e ./plugins/fa3 2>&1 | tail -2
  { nvidia-smi -L; python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"
    python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|numpy|flashinfer-python|tokenspeed-fa3) "; echo "commit ${COMMIT:-unknown}"; } > "$R/env-$stage.txt" 2>&1
  cat "$R/env-$stage.txt"
}
case $stage in
fi)
  setup flashinfer
  T 540 tests_features python3 -m pytest -m gpu tests/flashinfer/test_gpu_features.py -v -rs --durations=15 -p no:cacheprovider
  cp "$OUT"/flashinfer_gpu_features.json "$R/" 2>/dev/null
  bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null ;;
fi2)
  setup flashinfer
  T 200 tests_features python3 -m pytest -m gpu tests/flashinfer/test_gpu_features.py -q -rs --durations=8 -p no:cacheprovider
  cp "$OUT"/flashinfer_gpu_features.json "$R/" 2>/dev/null
  T 330 features_bench python3 bench/features_bench.py --out "$R" --sections fp8,softcap,window,multitoken --commit "${COMMIT:-unknown}"
  bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null ;;
fi3)
  setup flashinfer
  T 150 tests_fp8_manager python3 -m pytest -m gpu tests/flashinfer/test_gpu_features.py -q -rs -p no:cacheprovider -k "windowed or multi_token"
  T 300 features_bench_mt python3 bench/features_bench.py --out "$R" --sections multitoken,multitoken_kernels,window --commit "${COMMIT:-unknown}" ;;
final)
  setup flashinfer
  T 200 features_bench_mt python3 bench/features_bench.py --out "$R" --sections multitoken,window --commit "${COMMIT:-unknown}"
  for t in 1 4; do
    T 150 "mstar_bench_q$t" mstar bench --device cuda --backend flashinfer --layers 32 --qo-heads 32 --kv-heads 8 \
      --head-dim 128 --hidden 2048 --batch 64 --context 8192 --graphs --preplan --steps 30 --query-tokens $t --json
  done ;;
review)
  setup flashinfer
  T 150 tests_gpu_flashinfer python3 -m pytest -m gpu tests/flashinfer/test_gpu_features.py tests/flashinfer/test_gpu_flashinfer.py -q -rs -p no:cacheprovider ;;
fa3)
  setup fa3
  T 300 tests_dense python3 -m pytest -m gpu tests/dense/test_gpu_dense.py -v -rs --durations=10 -p no:cacheprovider
  cp "$OUT"/dense_gpu_conformance.json "$R/" 2>/dev/null
  T 200 features_bench_fa3 python3 bench/features_bench.py --out "$R/fa3" --sections fa3 --commit "${COMMIT:-unknown}" ;;
esac
