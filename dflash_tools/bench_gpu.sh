#!/usr/bin/env bash
# One prepared GPU benchmark run (NVIDIA H200, < 8 minutes): the DFlash drafter training step at the Qwen3-8B
# drafter shape (D=4096, 5 layers, 32/8 heads, head_dim 128, MLP 12288, fc 20480 -> 4096, block 16) on 4096 tokens
# with 512 anchors in bf16 autocast: compiled flex_attention vs dense SDPA, then the whole drafter compiled (what
# dflash.train runs on CUDA). Prints step time, tokens/s, MFU, peak memory and the largest flex-vs-dense gradient
# difference; writes them all to JSON.
#
#   bash dflash_tools/bench_gpu.sh            # on the GPU machine; JSON to $OUT/bench_gpu.json if $OUT is set, else
#                                        # dflash_tools/bench_gpu.json
#   bash dflash_tools/bench_gpu.sh --dry-run  # tiny fp32 shapes on CPU: checks the script end to end (flex forward only)
#
# Runs from any directory: it changes into dflash_tools/ (its own directory), where bench.py puts the repository root
# on sys.path itself. Extra arguments go to `python bench.py --gpu` (e.g. --budget 300, --json path; a relative
# --json path is taken from dflash_tools/).
set -euo pipefail
cd "$(dirname "$0")"

json="${OUT:-.}/bench_gpu.json"
if [[ " $* " == *" --dry-run "* ]]; then
    json="${OUT:-/tmp}/bench_gpu_dry_run.json"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv,noheader || true
fi
# hard stop at 8 minutes; bench.py itself skips the optional compiled-model run past half its --budget (420 s)
export TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks}"  # any recompile or graph break shows in the log
exec timeout --signal=INT --kill-after=20 480 python bench.py --gpu --json "$json" "$@"
