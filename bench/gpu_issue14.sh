#!/usr/bin/env bash
# Issue 14 on the H200: transformers models through mstar. Results under $OUT/results-<stage>.tgz.
# Every stage carries .gpu/flashinfer .gpu/env.sh .gpu/flashinfer-aot.tgz .gpu/save-flashinfer-aot.sh and brings
# the compiled FlashInfer modules back.
#   check  bench/hf_check.py: Llama, Qwen3, Mistral, Gemma 2, gpt-oss at GPU sizes (head dims 64/128/256), bf16,
#          teacher-forced logits and greedy agreement against transformers' eager attention
#   all    bench, then check (final: at the review commits, carrying the AOT modules without issue 13's FP8 ones
#          so that the carry stays under 64 MiB)
#   (was:) bench, then check (the check after the GPU-size models' init moved to 0.01, with the yardsticks)
#   prof   bench/hf_host_profile.py: cProfile of the generate loop on the hf_bench workload
#   share  bench/hf_attention_share.py: the hf_bench graph's GPU time with and without attention
#   bench  bench/hf_bench.py: the Llama-3.2-1B-shaped workload (64 x 512 prompts, 128 new tokens), mstar against
#          transformers' generate (dynamic and static cache, sdpa) and generate_batch
stage=${1:?stage}
source "$(dirname "$0")/gpu_lib.sh"
source .gpu/env.sh flashinfer || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
{ nvidia-smi -L; python3 -c "import torch,sys;print('torch',torch.__version__,'cuda',torch.version.cuda,'python',sys.version.split()[0])"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|numpy|flashinfer-python|transformers|safetensors|tokenizers) "
  echo "commit ${COMMIT:-unknown}"; } > "$R/env-$stage.txt" 2>&1
cat "$R/env-$stage.txt"
case $stage in
check)
  T 560 hf_check python3 bench/hf_check.py --json "$R/hf_check.json" ;;
bench)
  T 560 hf_bench python3 bench/hf_bench.py --json "$R/hf_bench.json" ;;
prof)  # where the host's time goes in the generate loop
  T 300 hf_host_profile python3 bench/hf_host_profile.py 64 ;;
share)  # the captured step with and without attention
  T 300 hf_attention_share python3 bench/hf_attention_share.py ;;
all)  # bench, then check, in one lease
  T 320 hf_bench python3 bench/hf_bench.py --json "$R/hf_bench.json"
  T 240 hf_check python3 bench/hf_check.py --json "$R/hf_check.json" ;;
esac
bash .gpu/save-flashinfer-aot.sh >/dev/null 2>&1; ls -la "$OUT"/flashinfer-aot* 2>/dev/null
