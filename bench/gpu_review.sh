#!/usr/bin/env bash
# After the review of the change since e54fdb3 (commit bc698cb), on one H200: the GPU tests of what
# it touched -- graph replay through the suite's assert_close (mstar check's replay), the paged
# manager's run and capture rule under real graphs (runner, multi-token decode). Same carry as bench/gpu_issue16.sh; results in $OUT/results-review.tgz.
stage=review
source "$(dirname "$0")/gpu_lib.sh"
source .gpu/env.sh flashinfer || exit 1
python3 -m pip install -q --no-build-isolation --no-deps -e . -e ./plugins/flashinfer 2>&1 | tail -2
{ nvidia-smi -L; python3 -c "import torch;print('torch',torch.__version__)"; echo "commit ${COMMIT:-unknown}"; } > "$R/env.txt" 2>&1
T 300 replay python3 -m pytest -q -p no:cacheprovider tests/flashinfer/test_gpu_flashinfer.py -k graph_replay
T 300 runner python3 -m pytest -q -p no:cacheprovider tests/core/test_gpu_runner.py tests/core/test_multi_token_decode.py
exit 0
