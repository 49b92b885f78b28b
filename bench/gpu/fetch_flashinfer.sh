#!/usr/bin/env bash
# A FlashInfer release other than the 0.5.3 set of ../shared/gpu/fetch-wheels.sh, for the H200 test
# machine (no network there), in pieces a run can carry (at most 64 MiB, the tree included):
#
#   bash bench/gpu/fetch_flashinfer.sh 0.7.4
#
# writes .gpu/fi-<version>/part1, part2, ... (the wheel split in 50 MB pieces, with its name, the
# number of parts and its sha256 in each folder) and .gpu/fi-<version>-deps (what `import
# flashinfer` needs that the machine's image lacks). On the machine, one call per part and then the
# suite, all on one machine kept warm (it keeps /tmp):
#   bash bench/gpu/run.sh wheel 0.7.4          carry .gpu/fi-0.7.4/part1, then again with part2
#   bash bench/gpu/run.sh flashinfer 0.7.4     carry .gpu/fi-0.7.4-deps [.gpu/flashinfer-aot-0.7.4.tgz]
set -euo pipefail
v=${1:?FlashInfer version, e.g. 0.7.4}
cd "$(git rev-parse --show-toplevel)"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"  # wheels stay out of git
# the hash of each release's wheel that ran on the machine before: a download that differs stops here
declare -A SHA256=([0.7.4]=a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
get() { local dir=$1; shift; mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d "$dir" "$@"; }

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
get "$tmp" "flashinfer-python==$v"
whl=$(ls "$tmp"/flashinfer_python-*.whl); name=$(basename "$whl")
sum=$(sha256sum "$whl" | cut -d' ' -f1)
if [ -n "${SHA256[$v]:-}" ] && [ "$sum" != "${SHA256[$v]}" ]; then
  echo "$name: sha256 $sum, expected ${SHA256[$v]}"; exit 1
fi
rm -rf ".gpu/fi-$v"; (cd "$tmp" && split -b 50000000 "$name" "$name.part-")
parts=("$tmp/$name".part-*); i=0
for p in "${parts[@]}"; do
  i=$((i + 1)); d=".gpu/fi-$v/part$i"; mkdir -p "$d"; mv "$p" "$d/"
  echo "$name" > "$d/name"; echo "${#parts[@]}" > "$d/parts"; echo "$sum  $name" > "$d/sha256"
done
# its requirements missing from the image (it has cuda-bindings, cuda-core, cuda-pathfinder, click,
# einops, ninja, numpy, packaging, requests, tabulate, tqdm, nvidia-ml-py); nvidia-cutlass-dsl is
# imported only by the CuTe-DSL kernels, which mstar's wrappers do not use
rm -rf ".gpu/fi-$v-deps"
get ".gpu/fi-$v-deps" cuda-python==13.4.4 cuda-tile==1.7.0 nccl4py==0.6.0 nccl-extensions==0.1.0 \
    apache-tvm-ffi==0.1.15.post2 nvidia-cudnn-frontend==1.32.0
du -sh ".gpu/fi-$v"/part* ".gpu/fi-$v-deps"
