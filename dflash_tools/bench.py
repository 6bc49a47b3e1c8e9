"""
dflash_tools/bench.py: the speed and memory of DFlash's training and evaluation paths, measured side by side in one
run, printed as one table and written as JSON. It measures and judges nothing: what must hold is in tests/ (the
memory plan against measurement in tests/test_plan.py, the default CUDA configuration in tests/test_gpu.py).

CPU, fp32, a small drafter (the shapes are printed):
  train      drafter training step (forward + chunked loss + backward) at anchors 32/128/512 x length 2048 and
             lengths 512/2048/8192 x 128 anchors, three ways: ours (dflash.DFlashDrafter.forward, every anchor in one
             call, attention "dense": two_part_attention); copy (the dense path before it, kept here as the baseline:
             the context keys/values expanded per anchor, SDPA on [context ; own block]); naive (one block at a time
             as an inference loop drafts: the drafter's own blocks() on [context[:a] ; block] per anchor); best time
             and peak memory
  attention  forward of one full-attention layer: compiled flex_attention vs dense, compile time apart
  loss       at V = 248320: chunked vocabulary projection + CE (dflash.weighted_ce) vs full logits, fwd + bwd
  tau        on a tiny Qwen3 target: eval.py's exact method vs the real decode loop
--gpu: the training step at the Qwen3-8B drafter shape (bf16 autocast), everything built on the GPU: the compiled
drafter step first (MFU, its FLOP accounting), a Qwen3-8B-shaped target forward, dflash.train_step with both, then
eager flex and dense (bench_gpu.sh). --dry-run: the same flow at tiny shapes on the CPU.

    python dflash_tools/bench.py --quick --threads 1            # a few minutes on a 2-core CPU
    python dflash_tools/bench.py --parts train --json t.json    # one section, 3 timed repeats
    bash dflash_tools/bench_gpu.sh [--dry-run]                  # tests/test_gpu.py, then --gpu
    python dflash_tools/bench.py --shard_memory                 # --shard_target's memory per rank, 2 CPU ranks

Peak memory on CPU: each training-step and loss configuration runs in a fresh process forked before the parent ran
any torch op; the child builds its inputs, resets the kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs),
notes its resident set, runs the step, and reports VmHWM (peak resident set) minus that baseline: the extra memory
the step needed on top of weights and inputs (torch's CPU allocator has no cache: freed tensors leave the resident
set). On CUDA: torch.cuda.max_memory_allocated().
"""

import argparse
import gc
import json
import multiprocessing as mp
import os
import platform
import shutil
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root: dflash.py, eval.py
sys.path.insert(0, ROOT)

import dflash  # noqa: E402
import eval as tau_eval  # noqa: E402

# Every length is its own dflash.padded_length and N*B a multiple of 128: flex is timed at shapes training runs.
ANCHOR_SWEEP, LENGTH_SWEEP = (32, 128, 512), (512, 2048, 8192)  # at FIXED_LEN; at FIXED_ANCHORS
FIXED_LEN, FIXED_ANCHORS = 2048, 128
TRAIN_IMPLS = ("ours", "copy", "naive")
BIG_VOCAB = 248320                 # Qwen3.5/3.6
H200_BF16_PEAK = 989e12            # dense bf16 FLOP/s


def cpu_config():
    """A small drafter with the real layout: a causal sliding layer and a bidirectional full layer, GQA."""
    return dflash.DFlashConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=4096, block_size=16, mask_token_id=4095, target_layer_ids=[1, 3, 5],
        num_target_layers=8, layer_types=["sliding_attention", "full_attention"], sliding_window=2048)


def gpu_config(tiny):
    """The Qwen3-8B drafter (D=4096, 5 full-attention layers, 32/8 heads of 128, MLP 12288, fc 20480 -> 4096, vocab
    151936); tiny: the same layout at D=64 for the CPU dry run."""
    shape = dict(num_hidden_layers=5, block_size=16, target_layer_ids=[1, 9, 17, 25, 33], num_target_layers=36,
                 layer_types=["full_attention"] * 5, sliding_window=None)
    if tiny:
        return dflash.DFlashConfig(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1,
                                   head_dim=16, vocab_size=1000, mask_token_id=999, **shape)
    return dflash.DFlashConfig(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                               head_dim=128, vocab_size=151936, mask_token_id=151669, rope_theta=1e6,
                               max_position_embeddings=40960, **shape)


def describe(cfg):
    kinds = ", ".join(("sliding(W=%d)" % cfg.sliding_window if t == "sliding_attention" else "full")
                      + (" causal" if cfg.layer_kind(i)[0] else " bidirectional")
                      for i, t in enumerate(cfg.layer_types))
    return (f"D={cfg.hidden_size}, {cfg.num_hidden_layers} layers [{kinds}], {cfg.num_attention_heads} heads / "
            f"{cfg.num_key_value_heads} kv, head_dim {cfg.head_dim}, MLP {cfg.intermediate_size}, B={cfg.block_size}, "
            f"{len(cfg.target_layer_ids)} context layers, lm_head V={cfg.vocab_size}")


def machine():
    model = platform.processor() or "unknown CPU"
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    s = (f"{model}, {os.cpu_count()} cores, {ram:.0f} GB RAM, load average {os.getloadavg()[0]:.1f}, torch "
         f"{torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}")
    return s + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "")


# -----------------------------------------------------------------------------
# Measuring: best-of-N time, peak resident memory in a fresh forked process


def status_mb(field):
    """A field of /proc/self/status in MB: VmRSS (resident now) or VmHWM (peak resident since the last reset)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))


def reset_peak_rss():
    """Reset VmHWM to the current resident set (Linux >= 4.0). False if not allowed: the peak then includes setup."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def timed(step, repeats, warmup=1, long_s=None):
    """Best wall time of `repeats` calls after `warmup` untimed ones, and the peak extra resident memory (MB).
    long_s (--quick): a first call longer than that is the measurement (its one-time costs are noise there)."""
    gc.collect()
    exact_peak = reset_peak_rss()
    base = status_mb("VmRSS")
    times = []
    for r in range(warmup + repeats):
        t0 = time.perf_counter()
        step()
        dt = time.perf_counter() - t0
        if r >= warmup or (long_s is not None and dt > long_s):
            times.append(dt)
            if long_s is not None and dt > long_s:
                break
    return {"seconds": min(times), "peak_mb": status_mb("VmHWM") - base, "peak_exact": exact_peak}


def _child(conn, fn, args):
    try:
        conn.send(fn(*args))
    except Exception as e:  # reported in the table, the run goes on
        conn.send({"error": f"{type(e).__name__}: {e}"})
    conn.close()


def in_fresh_process(fn, *args):
    """fn(*args) -> dict in a forked child: a clean heap for every configuration, so that no memory an earlier one
    left behind hides a peak. The parent runs no torch op before the last fork."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(send, fn, args))
    p.start()
    send.close()
    try:
        out = recv.recv()
    except EOFError:
        out = {"error": "the process died (out of memory?)"}
    p.join()
    return out


# -----------------------------------------------------------------------------
# train: ours (all anchors in one call) vs the per-anchor-copy baseline vs one block at a time


def train_inputs(cfg, S, N, seed=0, device="cpu", dtype=torch.float32, real=None):
    """Random target features and tokens for one sequence of length S with N anchors (b = 1), built on `device` in
    `dtype` (the V x D embedding and lm_head too: no CPU set-up for a GPU run). real: the sequence's real length
    (anchors and labels within it, the context zero past it, as dflash_loss pads it to S)."""
    g, gd = torch.Generator().manual_seed(seed), torch.Generator(device).manual_seed(seed)
    D, B, V, m, real = cfg.hidden_size, cfg.block_size, cfg.vocab_size, len(cfg.target_layer_ids), real or S
    embed = torch.empty(V, D, device=device, dtype=dtype).normal_(0, 0.02, generator=gd)
    lm_head = nn.Linear(D, V, bias=False, device=device, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.normal_(0, 0.02, generator=gd)
    input_ids = torch.randint(0, V - 1, (1, real), generator=g)
    loss_mask = torch.ones(1, real, dtype=torch.long)
    anchors, valid = (t[None] for t in dflash.sample_anchors(loss_mask[0], N, g))      # (1, N)
    block_ids = dflash.block_input_ids(input_ids, anchors, B, cfg.mask_token_id).to(device)
    context = torch.randn(1, S, m * D, generator=gd, device=device, dtype=dtype)
    context[:, real:] = 0
    labels = dflash.block_labels(torch.randint(0, V, (1, real), generator=g), anchors, B)
    weights = dflash.loss_weights(anchors, valid, loss_mask, B, gamma=4.0)
    return SimpleNamespace(context=context, x=F.embedding(block_ids, embed), anchors=anchors.to(device),
                           valid=valid.to(device), lm_head=lm_head, labels=labels.to(device),
                           weights=weights.to(device), input_ids=input_ids, block_ids=block_ids)


def per_anchor_copy_attention(self, x, cos, sin, k_ctx, v_ctx, mask):
    """dflash.Attention.forward's dense path before two_part_attention (the baseline): the context keys/values
    expanded once per anchor, (b, N, S, hk, hd) each, and SDPA on [context ; own block] per block with the bool mask
    (b, N, B, S+B)."""
    b, N, B, _ = x.shape
    S, h, hk, hd = k_ctx.shape[1], self.h, self.hk, self.hd
    q = dflash.apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (h, hd))), cos, sin)  # (b, N, B, h, hd)
    k_blk, v_blk = self.keys_values(x, cos, sin)                                         # (b, N, B, hk, hd)
    k = torch.cat([k_ctx[:, None].expand(b, N, S, hk, hd), k_blk], 2).transpose(2, 3)    # (b, N, hk, S+B, hd)
    v = torch.cat([v_ctx[:, None].expand(b, N, S, hk, hd), v_blk], 2).transpose(2, 3)
    out = F.scaled_dot_product_attention(q.transpose(2, 3).reshape(b * N, h, B, hd), k.reshape(b * N, hk, S + B, hd),
                                         v.reshape(b * N, hk, S + B, hd), attn_mask=mask.reshape(b * N, 1, B, S + B),
                                         enable_gqa=True)
    return self.o_proj(out.reshape(b, N, h, B, hd).transpose(2, 3).reshape(b, N, B, h * hd))


def use_per_anchor_copy():
    """Switch this (forked) process's dense path to the baseline: one (b, N, B, S+B) mask, the copying forward."""
    build_masks = dflash.build_masks
    dflash.build_masks = lambda *a: {kind: torch.cat(m[:2], -1) for kind, m in build_masks(*a).items()}
    dflash.Attention.forward = per_anchor_copy_attention


def naive_forward(drafter, context, x, anchors, valid):
    """One block at a time: the block anchored at a sees context keys [:a] (computed once, as eval.NeuralDrafter
    does) and itself, through the drafter's own blocks()."""
    kv = drafter.context_kv(context)
    out = []
    for n, a in enumerate(anchors[0].tolist()):
        kv_a = [(k[:, :a], v[:, :a]) for k, v in kv]
        out.append(drafter.blocks(x[:, n:n + 1], anchors[:, n:n + 1], valid[:, n:n + 1], kv_a, a))
    return torch.cat(out, 1)                                                                # (1, N, B, D)


def train_step_case(impl, cfg, S, N, repeats, long_s=None):
    if impl == "copy":
        use_per_anchor_copy()
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg, attention="dense").train()
    inp = train_inputs(cfg, S, N)
    loss = {}

    def step():
        drafter.zero_grad(set_to_none=True)
        if impl == "naive":
            hidden = naive_forward(drafter, inp.context, inp.x, inp.anchors, inp.valid)
        else:
            hidden = drafter(inp.context, inp.x, inp.anchors, inp.valid)
        loss_sum, _ = dflash.weighted_ce(hidden, inp.lm_head, inp.labels, inp.weights)
        (loss_sum / inp.weights.sum()).backward()
        loss["value"] = (loss_sum / inp.weights.sum()).item()

    return {**timed(step, repeats, long_s=long_s), "loss": loss["value"]}


# -----------------------------------------------------------------------------
# attention: compiled flex_attention vs the dense path, forward of one layer


def attention_case(cfg, S, N, repeats):
    """Forward of the attention module of the last drafter layer (full attention, bidirectional in the block: the
    layer every DFlash drafter has), masks built once outside the timing (a step shares them across layers)."""
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).eval()
    inp = train_inputs(cfg, S, N)
    i = cfg.num_hidden_layers - 1
    layer, out, row = drafter.layers[i], {}, {"num_anchors": N, "seq_len": S}
    with torch.no_grad():
        k, v = drafter.context_kv(inp.context)[i]
        cos, sin = dflash.rope_cos_sin(drafter.inv_freq, drafter.rope_scale,
                                       dflash.block_positions(inp.anchors, cfg.block_size), inp.x.dtype)
        x = layer.input_layernorm(inp.x)
        for path in ("dense", "flex"):
            t0 = time.perf_counter()
            mask = dflash.build_masks(cfg, inp.anchors, inp.valid, S, path)[cfg.layer_kind(i)]
            row[f"{path}_mask_seconds"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            out[path] = layer.self_attn(x, cos, sin, k, v, mask)  # flex: compiles for this shape
            first = time.perf_counter() - t0
            row[f"{path}_seconds"] = min(seconds(lambda: layer.self_attn(x, cos, sin, k, v, mask))
                                         for _ in range(repeats))
            row[f"{path}_first_call_seconds"] = first
    row["max_abs_diff"] = (out["flex"] - out["dense"]).abs().max().item()
    return row


def seconds(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -----------------------------------------------------------------------------
# loss: chunked projection + CE vs full logits at V = 248320


def loss_case(impl, D, V, tokens):
    """hidden (1, N, B, D) -> sum(w * CE) / sum(w), forward + backward; the lm_head is the target's (frozen).
    Both compute the same tokens (those with weight > 0), so only the chunking differs."""
    g = torch.Generator().manual_seed(0)
    B, N = 16, tokens // 16
    lm_head = nn.Linear(D, V, bias=False).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.normal_(0, 0.02, generator=g)
    anchors, valid = (torch.arange(N) * B)[None], torch.ones(1, N, dtype=torch.bool)  # disjoint blocks
    weights = dflash.loss_weights(anchors, valid, torch.ones(1, N * B + B, dtype=torch.long), B, gamma=4.0)
    labels = torch.randint(0, V, (1, N, B), generator=g)
    hidden = torch.randn(1, N, B, D, generator=g).requires_grad_(True)
    loss = {}

    def step():
        hidden.grad = None
        if impl == "chunked":
            loss_sum, _ = dflash.weighted_ce(hidden, lm_head, labels, weights)
        else:
            w = weights.flatten()
            sel = (w > 0).nonzero().squeeze(1)
            logits = lm_head(hidden.reshape(-1, D)[sel])                                   # (T, V) at once
            loss_sum = (F.cross_entropy(logits, labels.flatten()[sel], reduction="none") * w[sel]).sum()
        (loss_sum / weights.sum()).backward()
        loss["value"] = (loss_sum / weights.sum()).item()

    return {**timed(step, 1, warmup=0), "loss": loss["value"]}  # one big op: nothing to warm up that matters


# -----------------------------------------------------------------------------
# tau: the exact method vs the real decode loop on a tiny dense target


def tiny_qwen3_target(seed=0):
    """A random 4-layer Qwen3ForCausalLM built in-process (init range 0.1: varied greedy continuations)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    tc = Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                     initializer_range=0.1, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    return dflash.Target(model, model.model, model.get_input_embeddings(), model.lm_head, None,
                         "tiny random Qwen3 (4 layers, D=64, V=512)")


def train_tiny_drafter(target, prompts, new_tokens, steps, seed=0):
    """A drafter briefly trained with dflash's own pieces on the target's greedy continuations of `prompts` (a
    random target cannot be learned in seconds, but its continuations can be memorised), so that acceptance
    lengths vary and both modes do real work (a random drafter accepts nothing). Its tau is no measure of quality."""
    cfg = dflash.DFlashConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=512, block_size=16, mask_token_id=511,
                              target_layer_ids=[1, 2], num_target_layers=4,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=2048,
                              max_position_embeddings=2048, rope_theta=10000.0)
    ids = torch.tensor(prompts)
    seqs = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=0)
    samples = [(s.tolist(), [0] * ids.shape[1] + [1] * (len(s) - ids.shape[1])) for s in seqs]
    torch.manual_seed(seed)
    drafter = dflash.DFlashDrafter(cfg, attention="dense").train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        batch = dflash.collate(samples, 0, keys=[step * len(samples) + r for r in range(len(samples))])
        anchors, valid = dflash.batch_anchors(batch, 64)
        loss, _ = dflash.dflash_loss(drafter, cfg, target, batch, anchors, valid,
                                     dflash.loss_weights(anchors, valid, batch["loss_mask"], cfg.block_size, 4.0))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return drafter.eval()


def tau_case(num_prompts, max_new_tokens, train_steps):
    """Both modes of eval.evaluate_drafters on the same prompts, for the trained drafter and prompt lookup."""
    target = tiny_qwen3_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 511, (12,), generator=g).tolist() for _ in range(num_prompts)]
    drafters = {"drafter": train_tiny_drafter(target, prompts, max_new_tokens, train_steps),
                tau_eval.PROMPT_LOOKUP: tau_eval.PromptLookupDrafter()}
    row = {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens}
    for mode in ("exact", "loop"):
        rep = tau_eval.evaluate_drafters(target, drafters, prompts, max_new_tokens, mode=mode, progress=False)
        drafter = rep["results"][0]
        # per drafter: the target's plain greedy generation (exact: the truth; loop: the reference its output must
        # equal) runs once per prompt in both modes and is shared by every drafter: reported apart
        row[mode] = {"seconds": drafter["time_s"] + (rep["timing"]["features_s"] if mode == "exact" else 0.0),
                     "tau": drafter["tau"], "steps": drafter["steps"], "generate_seconds": rep["timing"]["generate_s"],
                     "prompt_lookup_tau": rep["results"][1]["tau"]}
    return row


# -----------------------------------------------------------------------------
# --gpu: the training step at the Qwen3-8B drafter shape (bench_gpu.sh)


def visible_pairs(cfg, anchors, valid, S):
    """(query, key) pairs the mask lets through, summed over layers (the useful attention work)."""
    total = 0
    for i in range(cfg.num_hidden_layers):
        mod = dflash.make_mask_mod(anchors, valid, S, cfg.block_size, *cfg.layer_kind(i))
        total += sum(int(m.sum()) for m in dflash.dense_masks(mod, *anchors.shape, S, cfg.block_size, anchors.device))
    return total


def drafter_flops(cfg, S, N, weighted_tokens, pairs):
    """Matmul FLOPs of one drafter training step (forward + backward), b = 1, by part. A matmul (m x k) @ (k x n) is
    2mkn forward and 4mkn backward (input and weight gradients).
      linear: context (S padded tokens): fc (m*D -> D), no input gradient: 2 + 2; per layer the k/v projections of
        the context: 2 + 4. Blocks (N*B tokens), per layer: q, k, v, o projections and the SwiGLU MLP: 2 + 4
      lm_head CE on the weighted tokens (frozen head): logits 2*D*V forward, the gradient w.r.t. hidden 2*D*V
      attention: QK^T and PV over the visible (query, key) pairs only, 4*head_dim*heads per pair forward, 2x that
        backward (what a fused kernel must do; masked tiles it still computes are not counted)"""
    D, I, L, B = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.block_size
    h, hk, hd, m = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(cfg.target_layer_ids)
    context = S * (m * D * D * 4 + L * 2 * D * hk * hd * 6)
    blocks = N * B * L * (D * (2 * h * hd + 2 * hk * hd) + 3 * D * I) * 6
    return {"linear": context + blocks, "lm_head_ce": weighted_tokens * D * cfg.vocab_size * 4,
            "attention": pairs * 4 * hd * h * 3}


def target_flops(target, S):
    """FLOPs of the target's grad-free forward on S tokens with its greedy labels: 2 per parameter per token for
    the decoder layers and the lm_head (the embedding is a lookup), and causal attention, QK^T and PV over S*S/2
    pairs per layer: 2 * S^2 * heads * head_dim per layer."""
    cfg = target.model.config
    layers = sum(p.numel() for p in target.layers.parameters())
    attn = 2 * S * S * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    return 2 * S * (layers + target.lm_head.weight.numel()) + attn


def qwen3_target(cfg, device, dtype):
    """A Qwen3ForCausalLM of the drafter's target shape (Qwen3-8B at the GPU shape), random weights, built on
    `device` in `dtype` (no CPU set-up), as a dflash.Target."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tc = Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_target_layers, num_attention_heads=cfg.num_attention_heads,
                     num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                     max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(tc).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(default)
    return dflash.Target(model, model.model, model.get_input_embeddings(), model.lm_head, None,
                         f"random Qwen3 ({tc.num_hidden_layers} layers, D={tc.hidden_size}, V={tc.vocab_size})")


def matmul_rate(dev, n=8192, reps=20, dtype=torch.bfloat16):
    """The device's matmul rate (FLOP/s) in dtype: n x n x n products, the best of 4 runs of `reps` (the first warms
    up); on the CPU with torch.get_num_threads() threads, as a step runs."""
    a, b = (torch.randn(n, n, device=dev, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if torch.device(dev).type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(4):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 * reps / best


def run_gpu(args):
    """The training step at the Qwen3-8B drafter shape (5 full-attention layers, 512 anchors x 16, a 3,072-token
    sequence padded to 4,096), in the order of value: the compiled drafter step as training runs it on CUDA (flex
    inside torch.compile(model), bf16 autocast, compiled chunked CE, backward, fused AdamW) with its MFU; a
    Qwen3-8B-shaped target forward (random weights) beside it; dflash.train_step with both (the same compiled graph:
    no recompile); then the chunked CE eager, eager flex and dense while --budget lasts. Everything is built on the
    device. --dry-run: the same flow at tiny shapes on the CPU (the dense path with aot_eager: CPU flex has no
    backward)."""
    cpu = args.dry_run or not torch.cuda.is_available()
    dev = torch.device("cpu" if cpu else "cuda")
    cfg = gpu_config(tiny=cpu)
    S_real, S, N = (200, 256, 16) if cpu else (3072, 4096, 512)
    dt = torch.float32 if cpu else torch.bfloat16  # the target's dtype: features, embeddings, lm_head
    sync = (lambda: None) if cpu else torch.cuda.synchronize
    t_start = time.time()
    report = {"machine": machine(), "device": str(dev), "dry_run": cpu, "config": describe(cfg), "seq_len": S_real,
              "padded_len": S, "num_anchors": N, "dtype": "fp32" if cpu else "bf16 autocast, fp32 weights", "gpu": []}
    print(f"DFlash GPU bench{' (dry run on CPU)' if cpu else ''} on {report['machine']}\ndrafter: {describe(cfg)}; "
          f"{S_real} tokens padded to {S}, {N} anchors, {report['dtype']}")
    if not cpu:
        report["matmul_tflops"] = matmul_rate(dev) / 1e12
        print(f"bf16 matmul 8192^3: {report['matmul_tflops']:.0f} TFLOP/s measured (dense peak "
              f"{H200_BF16_PEAK / 1e12:.0f}; expected ~790)")
    torch.manual_seed(0)
    path = "dense" if cpu else "flex"
    with torch.device(dev):
        drafter = dflash.DFlashDrafter(cfg, path).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5, betas=(0.9, 0.95), fused=not cpu)
    inp = train_inputs(cfg, S, N, device=dev, dtype=dt, real=S_real)
    ctx, x, a, valid, y, w = inp.context, inp.x, inp.anchors, inp.valid, inp.labels, inp.weights
    parts = drafter_flops(cfg, S, N, int((w > 0).sum()), visible_pairs(cfg, a, valid, S))
    flops = sum(parts.values())
    report.update(params=sum(p.numel() for p in drafter.parameters()), step_flops=flops, flops_by_part=parts)
    print(f"{report['params'] / 1e6:,.1f}M drafter parameters; FLOP per step (matmuls, fwd + bwd): " + ", ".join(
        f"{k} {v / 1e12:.2f}T" for k, v in parts.items()) + f"; total {flops / 1e12:.2f} TFLOP "
        "(formulas: bench.drafter_flops)")

    def drafter_step(model):
        """forward (autocast) + chunked CE + backward + AdamW, as dflash_loss and train_step run them."""
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not cpu):
            hidden = model(ctx, x, a, valid)
        ce_w, _ = drafter.block_loss(hidden, inp.lm_head, y, w, inp.block_ids)
        (ce_w / w.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return ce_w.detach() / w.sum()

    def measure(name, fn, step_flops, reps=5):
        """The first call (compiles), then `reps` timed calls (1 on the CPU): a row with the median, MFU, peak."""
        row, reps = {"impl": name}, 1 if cpu else reps
        try:
            if not cpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            fn()
            sync()
            row["first_call_seconds"] = time.perf_counter() - t0
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                out = fn()
                sync()
                times.append(time.perf_counter() - t0)
            row.update(seconds=sorted(times)[len(times) // 2], best_seconds=min(times), flops=step_flops)
            row["tflops"] = step_flops / row["seconds"] / 1e12
            if isinstance(out, torch.Tensor) and out.numel() == 1:
                row["loss"] = out.item()  # one sync, after the timing
            if not cpu:
                row["mfu"] = step_flops / row["seconds"] / H200_BF16_PEAK
                row["of_matmul_rate"] = row["tflops"] / report["matmul_tflops"]
                row["peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
        except Exception as e:  # out of memory, a compile error: reported, the other rows go on
            drafter.zero_grad(set_to_none=True)
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        report["gpu"].append(row)
        save_json(report, args.json)  # a hard timeout later keeps what was measured
        print(f"  {name:<50} " + (row.get("error") or
              f"first call {row['first_call_seconds']:6.1f}s  step {1e3 * row['seconds']:8.1f} ms (median of {reps})"
              f"  {row['tflops']:7.1f} TFLOP/s" + (f"  MFU {100 * row['mfu']:5.1f}% ({100 * row['of_matmul_rate']:.0f}%"
                                                    f" of matmul)  peak {row['peak_mb'] / 1024:6.1f} GiB" if not cpu
                                                    else "") + (f"  loss {row['loss']:.4f}" if "loss" in row else "")),
              flush=True)
        return row

    backend = {"backend": "aot_eager"} if cpu else {}
    compiled = torch.compile(drafter, **backend)
    # the chunked CE compiled as build_drafter compiles it on CUDA (the rows after train_step's run it eagerly)
    dflash.ChunkedLMHead.rows = torch.compile(dflash.loss_rows, dynamic=True, **backend)
    measure(f"{path} + compile(model), drafter step", lambda: drafter_step(compiled), flops)

    target = qwen3_target(cfg, dev, dt)
    ids = inp.input_ids.to(dev)
    fwd = lambda: dflash.greedy_labels(dflash.target_features(target, ids, cfg.target_layer_ids)[1],  # noqa: E731
                                       target.lm_head)
    t_flops = target_flops(target, S_real)
    report["target_flops"] = t_flops
    print(f"target: {target.name}, {sum(p.numel() for p in target.model.parameters()) / 1e9:.2f}B parameters; "
          f"forward + greedy labels on {S_real} tokens: {t_flops / 1e12:.2f} TFLOP (formula: bench.target_flops)")
    measure("target forward + greedy labels", fwd, t_flops, reps=3)

    batch = dflash.collate([(inp.input_ids[0].tolist(), [1] * S_real)], 0, keys=[0])
    kw = dict(noise_std=0.0, labels="target", raw_model=drafter, pad_to=S)  # (loss: the method's CE)

    def whole_step():  # what dflash.train runs per step, loss and all
        total = dflash.train_step(compiled, opt, target, cfg, [batch], 1e-5, N, 1.0, 1, 4.0, **kw)[0]
        return total["ce_w"] / total["w"]
    measure("train_step (target + compiled drafter)", whole_step, flops + t_flops, reps=3)
    del target
    dflash.ChunkedLMHead.rows = dflash.loss_rows
    for name, p, model in (("compile(model), eager chunked CE", path, compiled),
                           ("flex (compiled kernel), eager model", "flex", drafter),
                           ("dense, eager model", "dense", drafter)):
        if cpu and p == "flex":
            continue
        if time.time() - t_start > args.budget:
            print(f"  {name:<50} skipped (--budget {args.budget:g}s)")
            continue
        drafter.attention = p
        measure(name + ", drafter step", lambda: drafter_step(model), flops, reps=3)
    report["total_seconds"] = time.time() - t_start
    print(f"MFU against {H200_BF16_PEAK / 1e12:.0f} TFLOP/s (H200 dense bf16 peak); goal for the compiled drafter "
          f"step: >= 45% (dflash_tools/bench_gpu_expected.md); total {report['total_seconds']:.0f}s")
    return report


# -----------------------------------------------------------------------------
# The CPU run: the sections asked for, one table, JSON


def run_cpu(args):
    cfg, repeats = cpu_config(), 1 if args.quick else 3
    long_s = 2.0 if args.quick else None
    report = {"machine": machine(), "config": describe(cfg), "repeats": repeats}
    print(f"DFlash bench ({'quick' if args.quick else 'full'}) on {report['machine']}\ndrafter: {describe(cfg)}; fp32, "
          f"1 sequence, anchors drawn uniformly; seconds: best of {repeats} after 1 warmup"
          + (" (a first run over 2 s is timed itself)" if args.quick else ""))
    shapes = list(dict.fromkeys([(FIXED_LEN, n) for n in ANCHOR_SWEEP] + [(s, FIXED_ANCHORS) for s in LENGTH_SWEEP]))
    t_start = time.time()
    if "train" in args.parts:  # forked children first: the parent runs no torch op before the last fork
        report["train_step"] = []
        for S, N in shapes:
            row = {"seq_len": S, "num_anchors": N}
            for impl in TRAIN_IMPLS:
                row[impl] = in_fresh_process(train_step_case, impl, cfg, S, N, repeats, long_s)
                progress(f"train step {impl:5s} anchors {N:4d} len {S:5d}", row[impl])
            report["train_step"].append(row)
    if "loss" in args.parts:
        report["loss"] = {"vocab": BIG_VOCAB, "tokens": 4096, "hidden_size": cfg.hidden_size}
        for impl in ("chunked", "unchunked"):
            report["loss"][impl] = in_fresh_process(loss_case, impl, cfg.hidden_size, BIG_VOCAB, 4096)
            progress(f"loss {impl}", report["loss"][impl])
    if "attention" in args.parts:  # in this process: compiled kernels are timed here, not memory
        cache = None  # a fresh inductor cache: compile times are what a first run pays, not a cache hit
        if args.fresh_compile_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_inductor_")
        report["attention"] = [attention_case(cfg, S, N, repeats) for S, N in shapes]
        if cache:
            shutil.rmtree(cache, ignore_errors=True)
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        progress("attention", {"seconds": sum(r["dense_seconds"] for r in report["attention"])})
    if "tau" in args.parts:
        report["tau"] = tau_case(num_prompts=4, max_new_tokens=128, train_steps=40)
        progress("tau", report["tau"]["loop"])
    report["total_seconds"] = time.time() - t_start
    print_table(report)
    return report


def progress(what, r):
    print(f"  .. {what}: {r.get('error') or '%.3fs' % r['seconds']}", file=sys.stderr, flush=True)


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def ratio(a, b):
    return a / b if a is not None and b else None


def print_table(rep):
    print()
    if rep.get("train_step"):
        print("train step, forward + chunked loss + backward (fp32): seconds, peak MB above weights and inputs")
        print(f"{'anchors':>7} {'seq_len':>7} | {'ours':>7} {'MB':>6} | {'copy':>7} {'MB':>6} | {'naive':>7} "
              f"{'MB':>6} | {'naive/ours':>10} {'copy/ours':>9} {'mem ours/naive':>14}")
        for r in rep["train_step"]:
            o, c, n = (r[k] for k in TRAIN_IMPLS)
            print(f"{r['num_anchors']:>7} {r['seq_len']:>7} | " + " | ".join(
                f"{fmt(x.get('seconds'), '7.3f')} {fmt(x.get('peak_mb'), '6.0f')}" for x in (o, c, n))
                + f" | {fmt(ratio(n.get('seconds'), o.get('seconds')), '9.2f')}x"
                f" {fmt(ratio(c.get('seconds'), o.get('seconds')), '8.2f')}x"
                f" {fmt(ratio(o.get('peak_mb'), n.get('peak_mb')), '13.2f')}x"
                + "".join(f"  {k}: {x['error']}" for k, x in zip(TRAIN_IMPLS, (o, c, n)) if "error" in x))
        t = {r["num_anchors"]: r["ours"].get("seconds") for r in rep["train_step"] if r["seq_len"] == FIXED_LEN}
        print(f"ours, time(512 anchors) / time(128) at length {FIXED_LEN}: {fmt(ratio(t.get(512), t.get(128)), '.2f')}"
              f" (linear: 4, quadratic: 16)")
    if rep.get("loss"):
        ls = rep["loss"]
        c, u = ls["chunked"], ls["unchunked"]
        print(f"\nloss forward + backward at V={ls['vocab']}, {ls['tokens']} block tokens, D={ls['hidden_size']}: "
              f"chunked {fmt(c.get('seconds'), '.3f')}s {fmt(c.get('peak_mb'), '.0f')} MB, unchunked "
              f"{fmt(u.get('seconds'), '.3f')}s {fmt(u.get('peak_mb'), '.0f')} MB: memory "
              f"{fmt(ratio(c.get('peak_mb'), u.get('peak_mb')), '.2f')}x")
    if rep.get("attention"):
        print(f"\nattention forward, one full layer: {'anchors':>7} {'seq_len':>7} {'dense_s':>8} {'flex_s':>8} "
              f"{'compile_s':>9} {'dense/flex':>10} {'max|diff|':>9}")
        for r in rep["attention"]:
            print(f"{'':34} {r['num_anchors']:>7} {r['seq_len']:>7} {r['dense_seconds']:8.3f} {r['flex_seconds']:8.3f}"
                  f" {r['flex_first_call_seconds'] - r['flex_seconds']:9.1f} "
                  f"{r['dense_seconds'] / r['flex_seconds']:9.2f}x {r['max_abs_diff']:9.1e}")
    if rep.get("tau"):
        ex, lp = rep["tau"]["exact"], rep["tau"]["loop"]
        print(f"\ntau on a tiny Qwen3 target, {rep['tau']['num_prompts']} prompts x {rep['tau']['max_new_tokens']} "
              f"tokens, per drafter: exact {ex['seconds']:.3f}s (tau {ex['tau']:.3f}), loop {lp['seconds']:.3f}s "
              f"(tau {lp['tau']:.3f}): {lp['seconds'] / ex['seconds']:.1f}x; greedy generation "
              f"{ex['generate_seconds']:.2f}s in each mode, shared by all drafters")
    print(f"total {rep['total_seconds']:.0f}s")


def save_json(report, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


# -----------------------------------------------------------------------------
# --shard_memory: what --shard_target saves per rank, on 2 CPU ranks (gloo), at a size where the target dominates

SHARD_TARGET = dict(vocab_size=1000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=1024)


def shard_worker(target_dir):
    """Under torchrun: the target loaded whole or sharded (SHARD env), then 3 target forwards of 512 tokens. Prints
    one JSON line per rank: the target bytes this rank holds (exact, from its tensors), RssAnon (private resident
    memory) after them, VmHWM (peak resident, which includes the whole-model load on the CPU before sharding)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, shard = dist.get_rank(), os.environ["SHARD"] == "1"
    target = dflash.load_target(target_dir, "cpu", torch.float32, shard=shard)
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in target.model.parameters())
    ids = torch.randint(0, SHARD_TARGET["vocab_size"], (1, 512), generator=torch.Generator().manual_seed(rank))
    t0 = time.perf_counter()
    for _ in range(3):
        dflash.target_features(target, ids, [1, 8, 14])
    dist.barrier()
    print(json.dumps({"rank": rank, "shard": shard, "target_mb": held / 2**20, "rss_anon_mb": status_mb("RssAnon"),
                      "peak_mb": status_mb("VmHWM"), "forwards_s": time.perf_counter() - t0}), flush=True)
    dist.destroy_process_group()


def shard_memory(args):
    """A bf16 checkpoint of 0.25B params loaded in fp32 (a private copy per rank, as the copy to a GPU is: a
    same-dtype CPU load stays a memory map of the file, shared by the ranks' page cache, so there is nothing to
    save), run on 2 ranks without and with --shard_target. glibc's heap keeps the freed whole layers after sharding
    unless its mmap threshold is fixed (MALLOC_MMAP_THRESHOLD_), so it is."""
    import subprocess
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = tempfile.mkdtemp(prefix="shard_memory_")
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**SHARD_TARGET)).to(torch.bfloat16).save_pretrained(d)
    rows = []
    for shard in ("0", "1"):
        env = {**os.environ, "SHARD": shard, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__,
                            "--shard_worker", d], env=env, capture_output=True, text=True)
        rows += [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")] or [p.stderr[-2000:]]
    shutil.rmtree(d)
    for r in rows:
        print(r if isinstance(r, str) else f"rank {r['rank']} {'--shard_target' if r['shard'] else 'whole':<15} "
              f"target {r['target_mb']:7.0f} MB  RssAnon {r['rss_anon_mb']:7.0f} MB  peak {r['peak_mb']:7.0f} MB  "
              f"3 forwards {r['forwards_s']:.1f} s")
    return {"shard_memory": rows}


def get_parser():
    p = dflash.ArgumentParser(description="Speed and memory of DFlash training and evaluation, side by side.")
    p.add_argument("--quick", action="store_true", help="one timed repeat, none after a first run over 2 s")
    p.add_argument("--parts", default="train,loss,attention,tau", type=lambda s: s.split(","),
                   help="the CPU sections to run, comma-separated: train, loss, attention, tau")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default). On a machine shared with other jobs, 1 avoids "
                        "OpenMP threads waiting on each other, which makes small ops orders of magnitude slower")
    p.add_argument("--no_fresh_compile_cache", dest="fresh_compile_cache", action="store_false",
                   help="reuse the inductor cache (compile times then measure a warm cache)")
    p.add_argument("--gpu", action="store_true", help="the training step at the Qwen3-8B drafter shape on CUDA")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="--gpu at tiny shapes on the CPU")
    p.add_argument("--budget", type=float, default=150, help="--gpu: seconds after which the eager rows are skipped")
    p.add_argument("--shard_memory", action="store_true", help="resident memory per rank with and without "
                   "--shard_target, 2 CPU ranks (torchrun, gloo)")
    p.add_argument("--shard_worker", default=None, help=argparse.SUPPRESS)  # --shard_memory's ranks
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.shard_worker:
        return shard_worker(args.shard_worker)
    report = shard_memory(args) if args.shard_memory else run_gpu(args) if args.gpu or args.dry_run else run_cpu(args)
    save_json(report, args.json)
    if args.json:
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
