#!/usr/bin/env bash
# Issue 16 on two H200s (device kind nvidia-h200-x2): the tiny decoder sharded over 2 ranks by
# torchrun on NCCL. The demo against the no-cache forward, `mstar bench` at --tp 1 and --tp 2 on a
# model whose decode step is memory-bound (eager, and graphs + pre-plan), a rank failing mid-run,
# and the two-GPU tests. Results under $OUT/results-tp.tgz.
#   carry .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz (bf16 paged modules of head dims 64 and
#   128 only: the carry stays under 64 MiB) .gpu/save-flashinfer-aot.sh
stage=tp
source "$(dirname "$0")/gpu_lib.sh"
source .gpu/env.sh flashinfer || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
{ nvidia-smi -L; nvidia-smi topo -m
  python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'nccl',torch.cuda.nccl.version(),'python',sys.version.split()[0],'gpus',torch.cuda.device_count())"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|flashinfer-python|pytest) "
  env | grep -E "^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=" | sort
  echo "commit ${COMMIT:-unknown}"; } > "$R/env.txt" 2>&1
cat "$R/env.txt"
# NVLink multicast stays off (the device notes): refuse to run if the machine's setting is missing.
[ "${NCCL_NVLS_ENABLE:-}" = 0 ] || { echo "NCCL_NVLS_ENABLE is not 0: not running"; exit 1; }
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mstar_core.cli"
T 300 demo-tp1 python3 -m mstar_core.cli demo --device cuda
T 300 demo-tp2 $TR demo --tp 2 --device cuda
# Memory-bound decode: 8 layers of hidden 8192 (MLP 16384), 64 query / 8 KV heads of 128: 8.9 GB of
# bf16 weights a step at tp 1 (half a rank at tp 2), far more than the KV it reads.
M="--layers 8 --hidden 8192 --qo-heads 64 --kv-heads 8 --head-dim 128 --context 2048 --steps 50 --warmup 5 --device cuda --json"
for batch in 8 64; do
  for mode in eager graphs; do
    flags=""; [ $mode = graphs ] && flags="--graphs --preplan"
    T 240 "bench-b$batch-$mode-tp1" python3 -m mstar_core.cli bench $M --batch $batch $flags
    T 240 "bench-b$batch-$mode-tp2" $TR bench --tp 2 $M --batch $batch $flags
  done
done
python3 bench/tp_summary.py "$R" | tee "$R/tp_bench.md"
T 200 failure-graphs python3 bench/tp_failure.py --graphs --timeout 20
T 200 failure-eager python3 bench/tp_failure.py --timeout 20
T 400 gpu-tests python3 -m pytest -q -p no:cacheprovider tests/core/test_gpu_tensor_parallel.py tests/core/test_tensor_parallel.py \
    tests/core/test_gpu_runner.py tests/core/test_multi_token_decode.py
bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null
exit 0
