#!/usr/bin/env bash
# The FlashInfer 0.7.2.post1 wheel set for the H200 test machine (no network there), beside the
# 0.5.3 set that ../shared/gpu/fetch-wheels.sh makes. A run carries at most 64 MiB, so the 62 MB
# wheel travels alone (.gpu/fi072) and what `import flashinfer` needs that the machine's image
# lacks travels in the next run (.gpu/fi07deps); bench/gpu_issue11.sh installs both.
#   bash bench/fetch_flashinfer.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { local dir=$1; shift; mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" "$@"; }
get .gpu/fi072 flashinfer-python==0.7.2.post1
# its requirements missing from the image (it has cuda-bindings, cuda-core, cuda-pathfinder, click, einops,
# ninja, numpy, packaging, requests, tabulate, tqdm, nvidia-ml-py); nvidia-cutlass-dsl is imported only by
# the CuTe-DSL kernels, which these wrappers do not use
get .gpu/fi07deps cuda-python==13.4.4 cuda-tile==1.7.0 nccl4py==0.6.0 nccl-extensions==0.1.0 \
    apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
du -sh .gpu/fi072 .gpu/fi07deps
