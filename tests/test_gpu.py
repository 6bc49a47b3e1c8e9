"""The default CUDA configuration (compiled drafter, flex_attention, bf16 autocast) on a real GPU, at the Qwen3.6
drafter geometry (DFlashConfig() defaults: 4 sliding + 1 full layer) and the Qwen3-8B drafter shape: one graph and
no recompile over fresh anchors, peak memory with fused AdamW, flex's gradients against eager dense, bf16 q/k/v in
both directions, held-out evaluation compiling flex once, dflash.py end to end with --resume and under torchrun,
tau on the GPU equal to the CPU's, the compiled chunked CE against the eager one, one compiled step with
--grad_checkpoint equal to the step without, and the memory plan against torch.cuda.max_memory_allocated. Skipped
without CUDA; `bash dflash_tools/bench_gpu.sh` runs them on one H200 (a few minutes) after the timing. Every big
tensor is built on the GPU, and one drafter is built and compiled once for the tests that share it: no dynamo reset
between them (each would compile it again)."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import dflash
import eval as tau_eval
from dflash_tools import plan
from dflash_tools.bench import gpu_config, tiny_qwen3_target, train_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EAGER_FLEX = "flex_attention called without torch.compile"  # flex warns this when it runs unfused
S, N, REAL = 4096, 512, 3072  # the training shape: 512 anchors over 3,072 tokens padded to 4,096


def inputs(cfg, n, seed):
    """Random features, blocks, anchors, labels, weights and lm_head for one sequence, built on the GPU (bf16)."""
    t = train_inputs(cfg, S, n, seed, device="cuda", dtype=torch.bfloat16, real=REAL)
    return [t.context, t.x, t.anchors, t.valid, t.labels, t.weights, t.lm_head]


def loss_of(model, inp):
    ctx, x, a, v, y, w, head = inp
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return dflash.weighted_ce(model(ctx, x, a, v), head, y, w)[0] / w.sum()


@pytest.fixture(scope="module")
def big():
    """The Qwen3.6 drafter geometry (DFlashConfig() defaults: 4 sliding + 1 full layer), built on the GPU, and its
    compiled model: one for the module."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        d = dflash.DFlashDrafter(dflash.DFlashConfig(), "flex").train()
    yield d, torch.compile(d)
    torch.cuda.empty_cache()


def grads_of(drafter, model, inp):
    drafter.zero_grad(set_to_none=True)
    loss_of(model, inp).backward()
    grads = {k: p.grad.float() for k, p in drafter.named_parameters()}
    drafter.zero_grad(set_to_none=True)
    return grads


def worst_relative(a, b):  # the worst per-tensor relative L2 difference of two gradient dicts
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)).item() for k in a)


def test_grad_checkpoint_under_compile_equals_without():
    """One compiled step with --grad_checkpoint (each layer recomputed in backward, a flex BlockMask among its inputs:
    pytorch#167116 reports failures there) gives the gradients of the compiled step without it. A 2-layer drafter
    (sliding + full) at the training shape: the two compiles stay short. It runs first and resets dynamo after it,
    so the module's drafter compiles at static shapes (a compile of another geometry first would make them dynamic)."""
    cfg = dflash.DFlashConfig(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=128, vocab_size=4096, mask_token_id=4095,
                              target_layer_ids=[1, 3], num_target_layers=4,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=2048)
    torch.manual_seed(0)
    with torch.device("cuda"):
        drafter = dflash.DFlashDrafter(cfg, "flex").train()
    model, inp, grads, peaks = torch.compile(drafter), inputs(cfg, N, seed=0), [], []
    try:
        for ckpt in (False, True):
            drafter.grad_checkpoint = ckpt
            torch.cuda.reset_peak_memory_stats()
            grads.append(grads_of(drafter, model, inp))
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    finally:
        torch._dynamo.reset()
    rel = worst_relative(grads[1], grads[0])
    print(f"\n--grad_checkpoint under compile: worst per-tensor relative gradient difference {rel:.2e}; peak "
          f"{peaks[1]:.2f} GiB against {peaks[0]:.2f} GiB without")
    assert rel < 1e-2, f"worst per-tensor relative L2 difference {rel:.2e}"


def test_compiled_drafter_one_graph_and_fits(big):
    """Three steps with fresh anchors: at most one new graph, no graph break, no recompile (an error here); the peak
    with fused AdamW well inside the device."""
    drafter, model = big
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=True)
    torch.cuda.reset_peak_memory_stats()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for i in range(3):
            loss_of(model, inputs(drafter.cfg, N, seed=i)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert counters["stats"]["unique_graphs"] - graphs <= 1 and sum(counters["graph_break"].values()) == breaks
    assert torch.cuda.max_memory_allocated() < 0.9 * torch.cuda.get_device_properties(0).total_memory
    del opt
    torch.cuda.empty_cache()


def test_compiled_flex_gradients_equal_eager_dense(big):
    """The compiled flex kernel's gradients against the dense path's at the training shape (bf16: within 5e-2)."""
    drafter, model = big
    inp = inputs(drafter.cfg, N, seed=0)  # the compiled shape: no recompile
    flex = grads_of(drafter, model, inp)
    drafter.attention = "dense"
    try:
        dense = grads_of(drafter, drafter, inp)
    finally:
        drafter.attention = "flex"
    rel = worst_relative(flex, dense)
    assert rel < 5e-2, f"worst per-tensor relative L2 difference {rel:.2e}"


def test_compiled_chunked_ce_equals_eager_in_less_memory(monkeypatch):
    """The chunked CE as build_drafter compiles it on CUDA (torch.compile(dflash.loss_rows, dynamic=True)) at the
    Qwen3-8B lm_head (V 151,936, D 4,096, bf16) on 7,669 weighted tokens: the eager loss and gradient, at a lower
    peak (no fp32 copy of a chunk's logits), and no recompile for a second token count."""
    V, D, T = 151936, 4096, 7669
    torch.manual_seed(0)
    with torch.device("cuda"):
        head = torch.nn.Linear(D, V, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        torch.nn.init.normal_(head.weight, std=0.02)
        hidden = torch.randn(1, T + 100, 1, D, dtype=torch.bfloat16)
        labels = torch.randint(0, V, (1, T + 100, 1))
    compiled = torch.compile(dflash.loss_rows, dynamic=True)

    def run(rows, n=T):
        monkeypatch.setattr(dflash.ChunkedLMHead, "rows", rows)
        weights = torch.zeros(1, T + 100, 1)
        weights[:, :n] = 1.0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        h = hidden.clone().requires_grad_(True)
        loss = dflash.weighted_ce(h, head, labels, weights)[0] / n
        loss.backward()
        torch.cuda.synchronize()
        return loss.item(), h.grad.float(), torch.cuda.max_memory_allocated() - base

    run(compiled, T + 37)  # compiles (dynamic: the next count must not recompile)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run(compiled)
    ref = run(dflash.loss_rows)
    print(f"chunked CE peak: compiled {got[2] / 2**20:.0f} MiB, eager {ref[2] / 2**20:.0f} MiB")
    assert abs(got[0] - ref[0]) <= 1e-3 * abs(ref[0])
    assert (got[1] - ref[1]).norm() <= 1e-2 * ref[1].norm()
    assert got[2] < ref[2], f"compiled peak {got[2] / 2**20:.0f} MiB >= eager {ref[2] / 2**20:.0f} MiB"


def test_flex_gets_bf16_both_ways(big, monkeypatch):
    """Under autocast the fp32 norm weights would promote q and k: flex must get bf16 q/k/v forward, and bf16
    gradients flow back through them."""
    seen, compiled = [], dflash.compiled_flex_attention

    def recording(q, k, v, **kw):
        seen.append(("forward", q.dtype, k.dtype, v.dtype))
        for t in (q, k, v):
            t.register_hook(lambda g: seen.append(("backward", g.dtype)))
        return compiled(q, k, v, **kw)

    drafter = big[0]
    monkeypatch.setattr(dflash, "compiled_flex_attention", recording)
    loss_of(drafter, inputs(drafter.cfg, 16, seed=3)).backward()
    drafter.zero_grad(set_to_none=True)
    assert {d for s in seen for d in s[1:]} == {torch.bfloat16}
    assert sum(s[0] == "backward" for s in seen) == 3 * sum(s[0] == "forward" for s in seen) > 0


def test_evaluation_compiles_flex_once():
    """Held-out evaluation at 6 distinct lengths (and a ragged last batch): one graph per mask kind for flex and
    its block masks, no recompile-limit hit, never unfused (the warning is an error here)."""
    target = tiny_qwen3_target()
    target.model.to("cuda", torch.bfloat16)
    cfg = dflash.new_drafter_config(target, 3, mask_token_id=511, target_layer_ids=[0, 1, 2], num_heads=4,
                                    num_kv_heads=2, head_dim=16, sliding_window=64)
    drafter = dflash.DFlashDrafter(cfg, "flex").cuda().eval()
    g = torch.Generator().manual_seed(0)
    lengths = (90, 130, 170, 210, 250, 300)
    samples = [(torch.randint(0, 500, (n,), generator=g).tolist(), [0] * 20 + [1] * (n - 20)) for n in lengths]
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_FLEX)
        m = dflash.evaluate(drafter, target, samples, 4, 32, 0, 0, 0, 1, gamma=4.0, labels="target",
                            pad_to=dflash.padded_length(max(lengths)))
    kinds = len({cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)})
    assert counters["stats"]["unique_graphs"] - graphs <= 2 * kinds and m["tau"] >= 1.0


@pytest.fixture
def tiny_run(tmp_path):
    """A tiny Qwen3 target in tmp/target, pre-tokenized data in tmp/data.jsonl (random 20-token prompts, then
    the loss tokens), and the dflash.py flags of a small drafter for them."""
    tiny_qwen3_target().model.save_pretrained(tmp_path / "target")
    g = torch.Generator().manual_seed(1)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(40):
            n = 60 + 7 * i
            f.write(json.dumps({"input_ids": torch.randint(0, 500, (n,), generator=g).tolist(),
                                "loss_mask": [0] * 20 + [1] * (n - 20)}) + "\n")
    return ["--target", str(tmp_path / "target"), "--data", str(tmp_path / "data.jsonl"), "--batch_size", "2",
            "--grad_accum", "1", "--eval_fraction", "0.2", "--max_len", "512", "--mask_token_id", "511",
            "--num_heads", "4", "--num_kv_heads", "2", "--head_dim", "16", "--sliding_window", "64", "--num_anchors",
            "16", "--log_every", "1", "--num_draft_layers", "3", "--target_layer_ids", "0,1,2"]


def test_end_to_end_then_resume(tiny_run, tmp_path):
    """dflash.py --max_steps 3 --eval_every 2, then --resume to step 5: clean logs (no unfused flex, no recompile
    limit, no traceback), and the second run resumes."""
    base = [sys.executable, os.path.join(ROOT, "dflash.py"), *tiny_run, "--out", str(tmp_path / "out"),
            "--eval_every", "2", "--save_every", "2"]
    for extra in (["--max_steps", "3"], ["--max_steps", "5", "--resume"]):
        r = subprocess.run(base + extra, capture_output=True, text=True, timeout=240)
        log = r.stdout + r.stderr
        assert r.returncode == 0, log[-2000:]
        assert not [s for s in (EAGER_FLEX, "recompile_limit", "cache_size_limit", "Traceback") if s in log], log
    assert "resumed from" in log


def test_torchrun_compiled_loop_and_tau_equal_to_cpu(tiny_run, tmp_path):
    """torchrun --nproc_per_node=1 dflash.py with compile on for 40 steps: the loss falls; the checkpoint loads in
    eval.py, and its exact tau on the GPU equals the CPU's (same prompts and continuations, fp32 on both)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port",
           str(29400 + os.getpid() % 500), os.path.join(ROOT, "dflash.py"), *tiny_run, "--out", str(out),
           "--max_steps", "40", "--lr", "3e-3", "--eval_every", "0", "--compile", "on"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-2000:]
    with open(out / "metrics.jsonl") as f:
        losses = [rec["loss"] for rec in map(json.loads, f) if "loss" in rec]
    assert len(losses) == 40 and losses[-1] < losses[0]
    with open(tmp_path / "data.jsonl") as f:
        prompts = [json.loads(line)["input_ids"][:20] for line in f][:6]
    ref = dflash.load_target(str(tmp_path / "target"), "cpu", torch.float32)
    conts = [dflash.greedy_continuation(ref, p, 32, ref.eos_ids()) for p in prompts]
    walks = []
    for dev, path in (("cpu", "dense"), ("cuda", "flex")):
        t = dflash.load_target(str(tmp_path / "target"), dev, torch.float32)
        ds = tau_eval.load_drafters([dflash.latest_checkpoint(str(out))], t, torch.float32, False, path)
        res = tau_eval.evaluate_drafters(t, ds, prompts, 32, continuations=conts, progress=False)["results"][0]
        walks.append([p["acceptance_lengths"] for p in res["prompts"]])
    assert walks[0] == walks[1]


def test_memory_plan_matches_max_memory_allocated():
    """The plan's drafter-side terms against torch.cuda.max_memory_allocated at the Qwen3-8B drafter shape (4096
    tokens, 512 anchors, flex, bf16 autocast, one fused AdamW step): within 25%."""
    import dataclasses
    torch.cuda.empty_cache()
    cfg = gpu_config(tiny=False)
    inp = inputs(cfg, N, seed=0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.device("cuda"):
        drafter = dflash.DFlashDrafter(cfg, "flex").train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=True)
    loss_of(drafter, inp).backward()
    opt.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    d = plan.drafter_sizes(dataclasses.asdict(cfg), dflash.expected_shapes(cfg))
    t = dict(params=0, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             vocab_size=cfg.vocab_size, context_layers=d["context_layers"])
    run = dict(world=1, zero=False, grad_checkpoint=False, num_anchors=N, batch_size=1, max_len=S, attention="flex",
               target_bytes=2, act_bytes=2, cuda=False)
    rows = {name: b for name, b, _ in plan.plan_rows(t, d, run)}
    planned = sum(rows[k] for k in ("drafter weights", "drafter gradients", "AdamW moments", "drafter activations",
                                    "backward working set", "chunked-loss buffers"))
    assert 0.75 <= planned / measured <= 1.25, f"plan {planned / 2**30:.2f} GiB vs {measured / 2**30:.2f} GiB"
