#!/usr/bin/env bash
# Issue 16, second run on two H200s: why eager tensor-parallel steps take more host time than tp 1
# (the first run: eager tp 2 slower than tp 1). Host cost of one eager NCCL all-reduce against one
# kernel launch, and tp 1 / tp 2 eager steps with the thread count torchrun sets (OMP_NUM_THREADS=1)
# and others. Same carry as bench/gpu_issue16.sh; results in $OUT/r.
source .gpu/env.sh flashinfer >/dev/null 2>&1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
mkdir -p $OUT/r
python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/tp_host_cost.py 2>&1 | grep -v "^\*\|OMP_NUM" | tee $OUT/r/host_cost.txt
M="--layers 8 --hidden 8192 --qo-heads 64 --kv-heads 8 --head-dim 128 --context 2048 --steps 50 --warmup 5 --device cuda --batch 8"
echo "== tp1 eager, OMP_NUM_THREADS=1" | tee $OUT/r/omp.txt
OMP_NUM_THREADS=1 python3 -m mstar_core.cli bench $M 2>&1 | tee -a $OUT/r/omp.txt
echo "== tp1 eager, default threads" | tee -a $OUT/r/omp.txt
python3 -m mstar_core.cli bench $M 2>&1 | tee -a $OUT/r/omp.txt
echo "== tp2 eager, OMP_NUM_THREADS=8" | tee -a $OUT/r/omp.txt
OMP_NUM_THREADS=8 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m mstar_core.cli bench --tp 2 $M 2>&1 | tee -a $OUT/r/omp.txt
