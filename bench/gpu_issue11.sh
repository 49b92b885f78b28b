#!/usr/bin/env bash
# Issue 11 on the H200: the FlashInfer plugin on 0.5.3 and on 0.7.2.post1 (tests, the wrapper
# benchmark, `mstar warmup` then a first plan + run). Results under $OUT/results-<stage>.tgz.
#   fi053    carry .gpu/flashinfer .gpu/flashinfer-aot.tgz                   (a fresh machine)
#   fi072a   carry .gpu/fi072      (the 62 MB wheel alone; the machine kept warm from fi053)
#   fi072b   carry .gpu/fi07deps [.gpu/flashinfer-aot-0.7.2.post1.tgz]: its dependencies; warm-up check
#   fi072c   (nothing carried) tests and benchmark on 0.7.2.post1
#   fi074a   carry .gpu/fi074p1: the first half of the 101 MB 0.7.4 wheel (split -b 52000000), kept in /tmp
#   fi074b   carry .gpu/fi074p2: the second half; joined, checked, installed
#   fi074c   carry .gpu/fi07deps: its dependencies (the same set as 0.7.2.post1's); warm-up check
#   fi074d   (nothing carried) the final pass on 0.7.4
#   r053     carry .gpu/flashinfer .gpu/flashinfer-aot.tgz: after the review fixes, tests + warm-up check on 0.5.3
#   r074     carry .gpu/fi07deps .gpu/flashinfer-aot-0.7.4.tgz, after fi074a/b: the same on 0.7.4
#   v053     carry .gpu/flashinfer .gpu/flashinfer-aot.tgz: the final pass on 0.5.3 (a fresh machine)
#   v072     carry .gpu/fi07deps .gpu/flashinfer-aot-0.7.2.post1.tgz, after fi072a: the final pass on 0.7.2.post1
# Each FlashInfer version gets its own site folder (/tmp/fi-<version>), alone on PYTHONPATH, and its own
# compiled-module archive (.gpu/flashinfer-aot.tgz for 0.5.3, .gpu/flashinfer-aot-<version>.tgz else).
stage=${1:?stage}
source "$(dirname "$0")/gpu_lib.sh"
site() { # version wheel-dirs...: install into /tmp/fi-<version>, alone on PYTHONPATH
  local v=$1; shift
  for d in "$@"; do python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "/tmp/fi-$v" "$d"/*.whl || return 1; done
}
use() { export PYTHONPATH=/tmp/fi-$1; python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2; }
aot_in() { # archive version: compiled modules where FlashInfer loads them without compiling
  [ -f "$1" ] && mkdir -p "/tmp/fi-$2/flashinfer/data/aot" && tar xzf "$1" -C "/tmp/fi-$2/flashinfer/data/aot" && echo "aot: $(ls /tmp/fi-$2/flashinfer/data/aot | wc -l) modules from $1"
}
aot_out() { # version: every module compiled or prebuilt so far -> $OUT/flashinfer-aot-<version>.tgz (parts if > 15 MB)
  local v=$1 t; t=$(mktemp -d)
  cp -r "/tmp/fi-$v/flashinfer/data/aot/." "$t/" 2>/dev/null
  for c in ~/.cache/flashinfer/$v/*/cached_ops; do [ -d "$c" ] && (cd "$c" && for d in */; do d=${d%/}; [ -f "$d/$d.so" ] && mkdir -p "$t/$d" && cp "$d/$d.so" "$t/$d/"; done); done
  tar czf "$OUT/flashinfer-aot-$v.tgz" -C "$t" . && ls -la "$OUT/flashinfer-aot-$v.tgz"
  if [ "$(stat -c %s "$OUT/flashinfer-aot-$v.tgz")" -gt 15000000 ]; then
    split -b 15000000 "$OUT/flashinfer-aot-$v.tgz" "$OUT/flashinfer-aot-$v.tgz.part-" && rm "$OUT/flashinfer-aot-$v.tgz"; fi
}
envinfo() { { nvidia-smi -L; python3 -c "import torch,sys,flashinfer;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0],'flashinfer',flashinfer.__version__,flashinfer.__file__)"; python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|cuda|nvidia-cudnn|apache-tvm|nccl)"; } > "$R/env-$1.txt" 2>&1; cat "$R/env-$1.txt"; }
tests() { T "$1" "tests_$2" python3 -m pytest -m gpu tests/flashinfer tests/core -v -rs --durations=15 -p no:cacheprovider; }
final() { # version: the final pass at HEAD, every compiled module carried in
  envinfo "$1"; echo "commit ${COMMIT:-unknown}" > "$R/commit-$1.txt"
  T 60 "backends_$1" python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  tests 240 "$1"
  T 100 "warmup_check_$1" python3 bench/warmup_check.py --out "$R/$1" --window 128
  T 150 "bench_$1" python3 bench/flashinfer_bench.py --out "$R/$1"
}
case $stage in
fi053)
  site 0.5.3 .gpu/flashinfer || exit 1; aot_in .gpu/flashinfer-aot.tgz 0.5.3; use 0.5.3; envinfo 0.5.3
  T 150 warmup_check_0.5.3 python3 bench/warmup_check.py --out "$R/0.5.3" --window 128
  T 60 warmup_cli_0.5.3 python3 -m mstar_core.cli warmup --backend flashinfer --window -1 --window 128
  tests 200 0.5.3
  T 150 bench_0.5.3 python3 bench/flashinfer_bench.py --out "$R/0.5.3"
  aot_out 0.5.3 ;;
fi072a)
  site 0.7.2.post1 .gpu/fi072 && ls /tmp/fi-0.7.2.post1 | head -3 ;;
fi072b)
  site 0.7.2.post1 .gpu/fi07deps || exit 1
  aot_in .gpu/flashinfer-aot-0.7.2.post1.tgz 0.7.2.post1; use 0.7.2.post1; envinfo 0.7.2.post1
  T 480 warmup_check_0.7.2.post1 python3 bench/warmup_check.py --out "$R/0.7.2.post1" --window 128
  aot_out 0.7.2.post1 ;;
fi072c)
  use 0.7.2.post1; envinfo 0.7.2.post1
  T 60 warmup_cli_0.7.2.post1 python3 -m mstar_core.cli warmup --backend flashinfer --window -1 --window 128
  tests 330 0.7.2.post1
  T 150 bench_0.7.2.post1 python3 bench/flashinfer_bench.py --out "$R/0.7.2.post1"
  aot_out 0.7.2.post1 ;;
fi074a)
  cp .gpu/fi074p1/fi074.part-aa /tmp/ && ls -la /tmp/fi074.part-aa ;;
fi074b)
  cat /tmp/fi074.part-aa .gpu/fi074p2/fi074.part-ab > /tmp/flashinfer_python-0.7.4-py3-none-any.whl
  echo "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32  /tmp/flashinfer_python-0.7.4-py3-none-any.whl" | sha256sum -c || exit 1
  mkdir -p /tmp/w074 && mv /tmp/flashinfer_python-0.7.4-py3-none-any.whl /tmp/w074/ && site 0.7.4 /tmp/w074 ;;
fi074c)
  site 0.7.4 .gpu/fi07deps || exit 1; use 0.7.4; envinfo 0.7.4
  T 500 warmup_check_0.7.4 python3 bench/warmup_check.py --out "$R/0.7.4" --window 128
  aot_out 0.7.4 ;;
fi074d)
  use 0.7.4; envinfo 0.7.4; echo "commit ${COMMIT:-unknown}" > "$R/commit-0.7.4.txt"
  T 60 backends_0.7.4 python3 -m mstar_core.cli backends --device cuda --dtype bfloat16 --head-dim 128
  tests 330 0.7.4
  T 150 bench_0.7.4 python3 bench/flashinfer_bench.py --out "$R/0.7.4"
  aot_out 0.7.4 ;;
r053)
  site 0.5.3 .gpu/flashinfer || exit 1; aot_in .gpu/flashinfer-aot.tgz 0.5.3; use 0.5.3; envinfo 0.5.3
  echo "commit ${COMMIT:-unknown}" > "$R/commit-0.5.3.txt"; tests 200 0.5.3
  T 100 warmup_check_0.5.3 python3 bench/warmup_check.py --out "$R/0.5.3" --window 128 ;;
r074)
  site 0.7.4 .gpu/fi07deps || exit 1; aot_in .gpu/flashinfer-aot-0.7.4.tgz 0.7.4; use 0.7.4; envinfo 0.7.4
  echo "commit ${COMMIT:-unknown}" > "$R/commit-0.7.4.txt"; tests 300 0.7.4
  T 150 warmup_check_0.7.4 python3 bench/warmup_check.py --out "$R/0.7.4" --window 128
  aot_out 0.7.4 ;;
v053)
  site 0.5.3 .gpu/flashinfer || exit 1; aot_in .gpu/flashinfer-aot.tgz 0.5.3; use 0.5.3; final 0.5.3 ;;
v072)
  site 0.7.2.post1 .gpu/fi07deps || exit 1
  aot_in .gpu/flashinfer-aot-0.7.2.post1.tgz 0.7.2.post1; use 0.7.2.post1; final 0.7.2.post1; aot_out 0.7.2.post1 ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac
log done
