# A/B on one machine (the H200): the runner bench at the working tree (head) and at an older commit
# (old), alternating, three rounds. Prepare the old tree here first (it travels as an untracked folder):
#   rm -rf .ab/old && mkdir -p .ab/old && git archive REV mstar_core mstar_flashinfer bench | tar -x -C .ab/old
# then on the device: bash bench/ab_runner.sh   (carry .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz)
source .gpu/env.sh flashinfer || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
for i in 1 2 3; do
  for v in head old; do
    mkdir -p $OUT/$v$i
    if [ $v = old ]; then PYTHONPATH=$PWD/.ab/old:$PYTHONPATH timeout 100 python3 .ab/old/bench/runner_bench.py --out $OUT/$v$i > $OUT/$v$i/log.txt 2>&1
    else timeout 100 python3 bench/runner_bench.py --out $OUT/$v$i > $OUT/$v$i/log.txt 2>&1; fi
    echo "$v$i: $(grep -E "^\| (eager|graphs)" $OUT/$v$i/runner_bench.md | tr "\n" " ")"; rm -f $OUT/$v$i/log.txt $OUT/$v$i/runner_bench.json
  done
done
nproc; cat /proc/cpuinfo | grep "model name" | head -1
