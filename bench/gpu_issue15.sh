#!/usr/bin/env bash
# Issue 15 on the H200: `mstar check` against the real kernel libraries, and the GPU tests of what
# it replaced or added. Results under $OUT/results-<stage>.tgz.
#   flashinfer  carry .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz (head dim 128 modules only, so the
#               carry stays under 64 MiB) .gpu/save-flashinfer-aot.sh; brings the compiled modules back
#   fa3         carry .gpu/fa3 .gpu/env.sh
stage=${1:?stage: flashinfer, fa3, isolation-flashinfer or isolation-fa3}
source "$(dirname "$0")/gpu_lib.sh"
plugin=${stage#isolation-}
source .gpu/env.sh "$plugin" || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e "./plugins/$plugin" 2>&1 | tail -2
{ nvidia-smi -L; python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|flashinfer-python|tokenspeed-fa3|pytest) "
  echo "commit ${COMMIT:-unknown}"; } > "$R/env-$stage.txt" 2>&1
cat "$R/env-$stage.txt"
case $stage in isolation-*)
  T 300 ragged-isolation python3 bench/ragged_isolation.py "$plugin"
  exit 0 ;;
esac
T 420 check-table python3 -m mstar_core.cli check "$stage" --device cuda --dtype bfloat16 --head-dim 128
T 120 check-json python3 -m mstar_core.cli check "$stage" --device cuda --dtype bfloat16 --head-dim 128 --json
case $stage in
flashinfer)
  T 300 gpu-tests python3 -m pytest -q -p no:cacheprovider tests/flashinfer/test_gpu_flashinfer.py \
      tests/registry/test_gpu_check.py -k "flashinfer or graph_replay or prefill or decode or mixed or ragged" ;;
fa3)
  T 300 gpu-tests python3 -m pytest -q -p no:cacheprovider tests/dense/test_gpu_dense.py tests/registry/test_gpu_check.py ;;
esac
[ "$stage" = flashinfer ] && { bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null; }
exit 0
# (appended after the first run, which found the ragged leak) which segments a poisoned one reaches:
#   bash bench/gpu_issue15.sh isolation-flashinfer | isolation-fa3   (carry as the matching stage)
