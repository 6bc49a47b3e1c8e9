#!/usr/bin/env bash
# The prepared GPU run: one command on a bare machine with one NVIDIA H200 (python3, a CUDA torch, no network), at
# most 9 minutes, its answers in order of value (a phase cut by its timeout keeps what it printed):
#   1. versions and nvidia-smi
#   2. bench.py --gpu: the training step's MFU on the compiled path at the Qwen3-8B drafter shape, a Qwen3-8B-shaped
#      target forward beside it, the whole train_step; read against dflash_tools/bench_gpu_expected.md
#   3. GPU = CPU: torchrun's compiled loop, its checkpoint's tau on the GPU against the CPU's (tests/test_gpu.py)
#   4. bench_long.py --flex: flex enable_gqa=True against K/V repeated, at the 4,096 training length, fwd + bwd
#   5. the rest of tests/test_gpu.py (one compiled step with --grad_checkpoint among them)
# Everything is printed and written to $OUT (default out/bench_gpu): bench_gpu.log, bench_gpu.json, flex.json.
#
#   bash dflash_tools/bench_gpu.sh --prepare   # where a package registry answers: the wheels -> .wheels/ (ignored)
#   bash dflash_tools/bench_gpu.sh --dry-run   # on a CPU: the same flow at tiny shapes, the wheel folder checked
#   bash dflash_tools/bench_gpu.sh             # on the GPU machine, with .wheels/ carried beside the code
#
# The image's transformers (5.17) and its missing flash-linear-attention are replaced from .wheels/ by pip's
# --no-index --no-deps --target into a temporary folder put first on PYTHONPATH: the image's torch is never touched.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=$ROOT/.wheels
# the pins the image lacks (requirements.txt's, and what they need at other versions than the image may have)
PINS="transformers==5.24.0 tokenizers==0.23.3 safetensors==0.8.0 huggingface_hub==2.4.0 hf-xet==1.8.0
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 h11==0.16.0 anyio==4.16.0 idna==3.20 click==8.5.1
      regex==2026.5.9 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 pytest==9.0.3 pluggy==1.6.0
      iniconfig==2.3.0 pygments==2.20.0 packaging==26.2 exceptiongroup==1.3.2 tomli==2.5.0"
PER_PYTHON="regex==2026.5.9 tomli==2.5.0"  # the binary wheels built per Python version (the others are pure or abi3)
MAX_MB=64

if [[ "${1:-}" == "--prepare" ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" $PINS || exit 1
    for v in 3.10 3.11 3.12 3.13 3.14; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d "$WHEELS" $PER_PYTHON || exit 1
    done
    ls "$WHEELS" | grep -i '^torch' && { echo "error: torch got into $WHEELS; it must come from the image"; exit 1; }
    echo "$WHEELS: $(ls "$WHEELS" | wc -l) wheels, $(du -sm "$WHEELS" | cut -f1) MiB (at most $MAX_MB travel)"
    exit 0
fi

dry=0
[[ "${1:-}" == "--dry-run" ]] && dry=1
OUT=${OUT:-$ROOT/out/bench_gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/bench_gpu.log") 2>&1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1  # no network there: never wait on one
# any recompile or graph break shows in the log
export TORCH_LOGS="${TORCH_LOGS:-recompiles,graph_breaks}"
budget=$(( dry ? 3600 : 530 ))  # seconds for everything; the last phase gets what is left
left() { local l=$(( budget - SECONDS )); echo $(( l < $1 ? (l > 10 ? l : 10) : $1 )); }
phase() { echo; echo "=== [$SECONDS s] $*"; }
status=()
run() {  # run NAME SECONDS CMD...: the command under a timeout (SIGINT first: pytest and the benches print what they have)
    local name=$1 t; t=$(left "$2"); shift 2
    timeout --signal=INT --kill-after=15 "$t" "$@"
    local rc=$?
    status+=("$name: exit $rc$( ((rc == 124 || rc == 130)) && echo " (cut at ${t}s)")")
}

phase "1. versions, wheels, nvidia-smi"
if [[ ! -d "$WHEELS" ]]; then
    echo "no $WHEELS: run 'bash dflash_tools/bench_gpu.sh --prepare' where a registry answers, and carry .wheels"
    ((dry)) && exit 1
else
    mb=$(du -sm "$WHEELS" | cut -f1)
    echo "$WHEELS: $(ls "$WHEELS" | wc -l) wheels, $mb MiB (limit $MAX_MB)"
    ((mb > MAX_MB)) && { echo "error: $WHEELS is over $MAX_MB MiB"; ((dry)) && exit 1; }
    SITE=$(mktemp -d /tmp/dflash_site.XXXXXX)
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$SITE" $PINS || {
        echo "warning: pip could not install the wheels; unpacking them into $SITE instead (a wheel is a zip)"
        python3 - "$WHEELS" "$SITE" <<'EOF'
import glob, sys, zipfile
tag = "cp%d%d" % sys.version_info[:2]
for w in sorted(glob.glob(sys.argv[1] + "/*.whl")):
    parts = w.rsplit("/", 1)[1][:-4].split("-")  # name-version-python-abi-platform
    if parts[2] in ("py3", "py2.py3", tag) or parts[3] == "abi3":
        zipfile.ZipFile(w).extractall(sys.argv[2])
EOF
    }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 - <<'EOF'
import importlib.metadata as md, platform, sys
from packaging.requirements import Requirement
import torch


def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "absent"


print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      + ", ".join(f"{p} {version(p)}" for p in ("transformers", "triton", "flash-linear-attention", "tokenizers",
                                                 "huggingface_hub", "pytest")))
unmet = []  # each installed distribution's requirements, checked against what this python imports first
for d in md.distributions():
    for r in map(Requirement, d.requires or []):
        if r.marker and not r.marker.evaluate({"extra": ""}):
            continue
        v = version(r.name)
        if v == "absent" or not r.specifier.contains(v, prereleases=True):
            unmet.append(f"{d.metadata['Name']} needs {r} (has {v})")
wanted = ("transformers", "tokenizers", "huggingface", "safetensors", "flash-linear", "fla-core", "torch", "pytest")
print("unmet requirements that matter here:", [u for u in unmet if u.lower().startswith(wanted)] or "none")
import transformers, fla  # noqa: E401,F401  (fla: the Gated DeltaNet kernels on CUDA)
print("imports: transformers", transformers.__version__, "from", transformers.__file__.rsplit("/", 2)[0])
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version \
    --format=csv,noheader

if ((dry)); then
    phase "2. bench.py --dry-run (tiny shapes, CPU)"
    run "bench.py --dry-run" 600 python3 -u dflash_tools/bench.py --dry-run --json "$OUT/bench_gpu.json"
    phase "3-5. tests/test_gpu.py (each reports itself skipped without CUDA)"
    run "tests/test_gpu.py" 120 python3 -u -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py
    phase "4. bench_long.py --flex on the CPU (eager flex, forward only, 256 tokens)"
    run "bench_long.py --flex" 300 python3 -u dflash_tools/bench_long.py --flex --flex_device cpu \
        --flex_lengths 256 --flex_anchors 16 --json "$OUT/flex.json"
else
    phase "2. the training step at the Qwen3-8B drafter shape: compiled MFU, target forward, train_step"
    run "bench.py --gpu" 210 python3 -u dflash_tools/bench.py --gpu --json "$OUT/bench_gpu.json"
    phase "3. GPU = CPU: torchrun's compiled loop and its tau"
    run "GPU = CPU test" 150 python3 -u -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py -k torchrun
    phase "4. flex enable_gqa=True against repeated K/V at the training length"
    run "bench_long.py --flex" 90 python3 -u dflash_tools/bench_long.py --flex --json "$OUT/flex.json"
    phase "5. the other GPU tests"
    run "other GPU tests" 600 python3 -u -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py -k "not torchrun"
fi
phase "done in ${SECONDS}s; files in $OUT"
printf '  %s\n' "${status[@]}"
[[ -n "${SITE:-}" ]] && rm -rf "$SITE"
exit 0
