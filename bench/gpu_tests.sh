#!/usr/bin/env bash
# The tests whose kernels only run on a GPU, run where one is the default device (the CPU
# runs the same files against the kernels' reference paths in CI):
#   bash bench/gpu_tests.sh [pytest args]
# On the lent H200: after unpacking MLX and pytest's wheels into /tmp/site (bench/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import mlx.core as mx; assert mx.default_device() != mx.cpu, "no GPU"' || exit 1
# float32 in full precision: the tests load float32 checkpoints so that token equality
# tests the code, not bf16's rounding of random weights' near ties; CUDA's default TF32
# matmuls (a 10-bit mantissa) bring those ties back (MLX_ENABLE_TF32, MLX's docs)
export MLX_ENABLE_TF32=0
# the kernels' files first (quick), then what the caller names (2026-12-05: the compiled
# prompts' file, named first, ran out the step's time before any kernel test ran)
exec python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernel_gated_delta_scan.py tests/test_kernel_gated_delta_states.py \
    tests/test_kernel_gated_delta_fused.py \
    tests/test_kernel_deltanet_decode.py tests/test_kernel_deltanet_chunk.py \
    tests/test_kernel_rms_norm.py "$@"
