"""--shard_target on CUDA (skipped without it): with 2 GPUs, the peak memory per rank and the step time with and
without the flag, and equal losses; with 1 GPU the flag is a no-op with one note. The CPU equivalence runs are in
test_shard.py; these are the acceptance check where the memory matters."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

import dflash
from conftest import ROOT, tiny_qwen3, write_data

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS == 0, reason="needs CUDA")

# a target that dominates a rank's memory: ~0.9B params (1.8 GB in bf16), a small drafter over it
BIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
           num_key_value_heads=4, head_dim=128, vocab_size=4096, max_position_embeddings=4096)
FLAGS = ["--mask_token_id", "4095", "--num_draft_layers", "2", "--target_layer_ids", "1,14", "--num_heads", "8",
         "--num_kv_heads", "2", "--head_dim", "64", "--intermediate_size", "2048", "--block_size", "8",
         "--num_anchors", "64", "--max_steps", "8", "--batch_size", "1", "--grad_accum", "2", "--log_every", "1",
         "--eval_fraction", "0.1", "--eval_walk_prompts", "3", "--eval_walk_tokens", "16", "--eval_every", "0",
         "--save_every", "0", "--compile", "off"]


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_shard")
    return d, tiny_qwen3(d / "target", **BIG), write_data(d / "data.jsonl", 41)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run(args, nproc):
    cmd = [sys.executable, os.path.join(ROOT, "dflash.py")] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
         str(29500 + random.randrange(1000)), os.path.join(ROOT, "dflash.py")]
    p = subprocess.run(cmd + args, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    return p


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_two_gpus_shard_target_memory_time_and_losses(big):
    """Peak memory (torch.cuda.max_memory_allocated, rank 0) drops by at least a third of the target's bf16 decoder
    (half of it sits on the other GPU), the losses and held-out metrics are equal, and the step time is
    printed side by side (NVLink or PCIe decides it: the plan's all-gather line)."""
    d, target, data = big
    result = {}
    for name, extra in (("whole", []), ("shard", ["--shard_target"])):
        run(["--target", target, "--data", data, "--out", str(d / name), *FLAGS, *extra], nproc=2)
        result[name] = metrics(d / name)
    train = {k: [r for r in v if "loss" in r] for k, v in result.items()}
    losses = {k: [r["loss"] for r in v] for k, v in train.items()}
    assert max(abs(a - b) for a, b in zip(losses["whole"], losses["shard"])) <= 1e-4, losses
    evals = {k: [(r["eval_loss"], r["eval_walk_tau"]) for r in v if "eval_loss" in r] for k, v in result.items()}
    assert evals["whole"] == pytest.approx(evals["shard"], abs=1e-4)
    peak = {k: max(r["peak_mb"] for r in v) for k, v in train.items()}
    speed = {k: sum(r["tokens_per_s"] for r in v[1:]) / (len(v) - 1) for k, v in train.items()}
    decoder_mb = sum(p.numel() for p in dflash.load_target(target, "meta").layers.parameters()) * 2 / 2**20  # bf16
    print(f"\n2 GPUs: peak {peak['whole']:.0f} MB whole, {peak['shard']:.0f} MB sharded; "
          f"{speed['whole']:.0f} vs {speed['shard']:.0f} tokens/s")
    assert peak["whole"] - peak["shard"] > decoder_mb / 3, peak  # half of it is on the other GPU, less 2 layers


def test_one_gpu_shard_target_is_a_noop_with_a_note(big):
    """One process: the flag is ignored with one note, and the run trains as without it."""
    d, target, data = big
    p = run(["--target", target, "--data", data, "--out", str(d / "one"), *FLAGS, "--max_steps", "2",
             "--shard_target"], nproc=1)
    assert "--shard_target: one process, nothing to shard over" in p.stdout
    assert len([r for r in metrics(d / "one") if "loss" in r]) == 2
