#!/usr/bin/env bash
# The prepared GPU run for one NVIDIA H200, under 8 minutes in all: first the CUDA tests (tests/test_gpu.py: the
# default CUDA configuration, compiled drafter + flex + bf16 autocast, checked end to end), then the timing
# (bench.py --gpu: the training step at the Qwen3-8B drafter shape, compiled flex vs dense, step time, tokens/s,
# MFU, peak memory; JSON to $OUT/bench_gpu.json if $OUT is set, else dflash_tools/bench_gpu.json), then the long-context
# flex timing (bench_long.py --flex: compiled flex attention forward + backward at 8k and 32k tokens, Qwen3-8B drafter
# shape, enable_gqa=True against K/V repeated to the query heads: which one dflash.Attention should keep; JSON beside).
#
#   bash dflash_tools/bench_gpu.sh            # on the GPU machine
#   bash dflash_tools/bench_gpu.sh --dry-run  # on a CPU: the tests report themselves skipped (no CUDA), then the
#                                             # timing at tiny fp32 shapes (flex forward only)
#
# Runs from any directory. Extra arguments go to `python bench.py --gpu` (e.g. --budget 200, --json path).
set -uo pipefail
cd "$(dirname "$0")/.."

json="${OUT:-dflash_tools}/bench_gpu.json"
if [[ " $* " == *" --dry-run "* ]]; then
    json="${OUT:-/tmp}/bench_gpu_dry_run.json"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
fi
export TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks}"  # any recompile or graph break shows in the log
# -rs: every skipped test is listed with its reason; the tests get at most 4 minutes, the timings 2 minutes each
timeout --signal=INT --kill-after=20 240 python -m pytest -q -rs tests/test_gpu.py
tests=$?
timeout --signal=INT --kill-after=20 120 python dflash_tools/bench.py --gpu --budget 85 --json "$json" "$@"
timing=$?
# the long-context lines print as each one finishes: a timeout keeps what was measured
timeout --signal=INT --kill-after=10 120 python dflash_tools/bench_long.py --flex --json "${json%.json}_long.json"
long=$?
echo "tests/test_gpu.py: exit $tests (0: all passed or skipped, as listed above); bench.py --gpu: exit $timing;" \
     "bench_long.py --flex: exit $long"
exit $(( tests != 0 ? tests : timing != 0 ? timing : long ))
