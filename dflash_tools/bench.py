"""
dflash_tools/bench.py: the speed and memory of DFlash's training and evaluation paths, measured side by side in one
run.

Not part of the test run. What it measures (CPU, fp32, a small drafter: the shapes are printed):
  a. drafter training step (forward + loss + backward): ours (dflash.DFlashDrafter.forward, every anchor in one
     call, attention "dense": SDPA) vs a naive loop that drafts one block at a time the way inference does (the
     drafter's own blocks() per anchor, context keys/values sliced to [:a]); num_anchors 32/128/512 at a fixed
     length and lengths 512/2048/8192 at fixed anchors; time and peak memory;
  b. attention forward of one drafter layer: compiled flex_attention (dflash.compiled_flex_attention, taken when
     the mask is a BlockMask: attention "flex") vs dense-mask SDPA (attention "dense") at the same shapes; compile
     time apart from steady-state time (CPU flex has no backward);
  c. the loss at V = 248320: chunked vocabulary projection + CE (dflash.weighted_ce) vs full logits +
     F.cross_entropy, forward + backward; time and peak memory;
  d. tau on a tiny dense Qwen3 target: the exact method (eval.py mode "exact") vs the real decode loop ("loop");
     identical acceptance lengths, time ratio.
Then it checks the targets (PASS/MISS): training step about linear in num_anchors, chunked loss under 25% of the
unchunked peak memory, exact tau >= 5x faster than the loop with identical results.

    python dflash_tools/bench.py --quick               # < 5 min on a quiet 2-core CPU
    python dflash_tools/bench.py --json bench.json     # the full run (3 timed repeats everywhere)
    python dflash_tools/bench.py --quick --threads 1   # on a shared, oversubscribed machine (see --threads)
    bash dflash_tools/bench_gpu.sh                     # H200: flex vs dense at the Qwen3-8B drafter shape (--gpu)
    bash dflash_tools/bench_gpu.sh --dry-run           # the same script at tiny shapes on CPU

Peak memory on CPU: each measured configuration runs in a fresh process forked from this one before it has run
any torch op; the child builds its inputs, resets the kernel's peak-RSS counter (writing 5 to
/proc/self/clear_refs), notes its resident set, runs the step, and reports VmHWM (peak resident set) minus that
baseline: the extra memory the step needed on top of weights and inputs. torch's CPU allocator has no cache, so
freed tensors leave the resident set. On CUDA (--gpu) it is torch.cuda.max_memory_allocated().
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
from dflash_tools import plan  # noqa: E402

# -----------------------------------------------------------------------------
# Settings: the CPU drafter and the sweeps

ANCHOR_SWEEP = (32, 128, 512)      # num_anchors at the fixed length FIXED_LEN
LENGTH_SWEEP = (512, 2048, 8192)   # sequence lengths at the fixed FIXED_ANCHORS
# Every length here (and in --gpu) is its own dflash.padded_length (a power of two, at least 128), the one padding
# rule of flex shapes, and N*B is a multiple of 128: the compiled flex kernels are timed at shapes training runs.
FIXED_LEN, FIXED_ANCHORS = 2048, 128
BIG_VOCAB = 248320                 # Qwen3.5/3.6
H200_BF16_PEAK = 989e12            # dense bf16 FLOP/s


def cpu_config():
    """A small drafter with the real layout: a causal sliding layer and a bidirectional full layer, GQA."""
    return dflash.DFlashConfig(
        hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, vocab_size=4096, block_size=16, mask_token_id=4095, target_layer_ids=[1, 3, 5],
        num_target_layers=8, layer_types=["sliding_attention", "full_attention"], sliding_window=2048)


def describe(cfg):
    kinds = ", ".join(("sliding(W=%d)" % cfg.sliding_window if t == "sliding_attention" else "full")
                      + (" causal" if cfg.layer_kind(i)[0] else " bidirectional")
                      for i, t in enumerate(cfg.layer_types))
    return (f"D={cfg.hidden_size}, {cfg.num_hidden_layers} layers [{kinds}], {cfg.num_attention_heads} heads / "
            f"{cfg.num_key_value_heads} kv, head_dim {cfg.head_dim}, MLP {cfg.intermediate_size}, B={cfg.block_size}, "
            f"{len(cfg.target_layer_ids)} context layers, lm_head V={cfg.vocab_size}")


def machine():
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or model
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    s = (f"{model}, {os.cpu_count()} cores, {ram:.0f} GB RAM, torch {torch.__version__} "
         f"({torch.get_num_threads()} threads), python {platform.python_version()}")
    if torch.cuda.is_available():
        s += f", {torch.cuda.get_device_name()}"
    return s


# -----------------------------------------------------------------------------
# Measuring: best-of-N time, peak resident memory in a fresh forked process


def status_mb(field):
    """A field of /proc/self/status in MB: VmRSS (resident now) or VmHWM (peak resident since the last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


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
    With long_s (--quick): a first call longer than that is the measurement (its one-time costs are noise there)."""
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
        if long_s is not None and r == 0 and dt > long_s:
            break
    return {"seconds": min(times), "peak_mb": status_mb("VmHWM") - base, "peak_exact": exact_peak}


def _child(conn, fn, args):
    try:
        conn.send(fn(*args))
    except Exception as e:  # reported in the table, the run goes on
        conn.send({"error": f"{type(e).__name__}: {e}"})
    conn.close()


def in_fresh_process(fn, *args):
    """Run fn(*args) -> dict in a forked child: a clean heap for every configuration, so peaks are not hidden by
    memory an earlier configuration left in the allocator. The parent runs no torch op before the last fork."""
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
# a. The drafter training step: ours (all anchors in one call) vs one block at a time


def train_inputs(cfg, S, N, seed=0):
    """Random target features and tokens for one sequence of length S with N anchors (b = 1)."""
    g = torch.Generator().manual_seed(seed)
    D, B, V, m = cfg.hidden_size, cfg.block_size, cfg.vocab_size, len(cfg.target_layer_ids)
    embed = nn.Embedding(V, D).requires_grad_(False)
    lm_head = nn.Linear(D, V, bias=False).requires_grad_(False)
    with torch.no_grad():
        embed.weight.normal_(0, 0.02, generator=g)
        lm_head.weight.normal_(0, 0.02, generator=g)
    input_ids = torch.randint(0, V - 1, (1, S), generator=g)
    loss_mask = torch.ones(1, S, dtype=torch.long)
    anchors, valid = dflash.sample_anchors(loss_mask[0], N, g)
    anchors, valid = anchors[None], valid[None]                                            # (1, N)
    with torch.no_grad():
        x = embed(dflash.block_input_ids(input_ids, anchors, B, cfg.mask_token_id))        # (1, N, B, D)
    return SimpleNamespace(
        context=torch.randn(1, S, m * D, generator=g), x=x, anchors=anchors, valid=valid, lm_head=lm_head,
        labels=dflash.block_labels(torch.randint(0, V, (1, S), generator=g), anchors, B),
        weights=dflash.loss_weights(anchors, valid, loss_mask, B, gamma=4.0))


def naive_forward(drafter, context, x, anchors, valid):
    """One block at a time, as an inference loop drafts: the block anchored at a sees context keys [:a] and itself.
    The context keys/values are computed once (as eval.NeuralDrafter does); each block goes through the drafter's
    own blocks() (with its own attention, "dense" here) with the cache sliced to its anchor."""
    kv = drafter.context_kv(context)
    out = []
    for n, a in enumerate(anchors[0].tolist()):
        kv_a = [(k[:, :a], v[:, :a]) for k, v in kv]
        out.append(drafter.blocks(x[:, n:n + 1], anchors[:, n:n + 1], valid[:, n:n + 1], kv_a, a))
    return torch.cat(out, 1)                                                                # (1, N, B, D)


def train_step_case(impl, cfg, S, N, repeats, long_s=None):
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg, attention="dense").train()
    inp = train_inputs(cfg, S, N)
    w_total = inp.weights.sum()
    loss = {}

    def step():
        drafter.zero_grad(set_to_none=True)
        if impl == "ours":
            hidden = drafter(inp.context, inp.x, inp.anchors, inp.valid)
        else:
            hidden = naive_forward(drafter, inp.context, inp.x, inp.anchors, inp.valid)
        loss_sum, _ = dflash.weighted_ce(hidden, inp.lm_head, inp.labels, inp.weights)
        (loss_sum / w_total).backward()
        loss["value"] = (loss_sum / w_total).item()

    r = timed(step, repeats, long_s=long_s)
    return {**r, "loss": loss["value"]}


# -----------------------------------------------------------------------------
# b. Attention forward: compiled flex_attention vs dense-mask SDPA


def attention_case(cfg, S, N, repeats):
    """Forward of the attention module of the last drafter layer (full attention, bidirectional in the block: the
    layer every DFlash drafter has), masks built once outside the timing (a step shares them across layers)."""
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).eval()
    inp = train_inputs(cfg, S, N)
    i = cfg.num_hidden_layers - 1
    layer = drafter.layers[i]
    key = cfg.layer_kind(i)
    out, rows = {}, []
    with torch.no_grad():
        k, v = drafter.context_kv(inp.context)[i]
        pos = dflash.block_positions(inp.anchors, cfg.block_size)
        cos, sin = dflash.rope_cos_sin(drafter.inv_freq, drafter.rope_scale, pos, inp.x.dtype)
        x = layer.input_layernorm(inp.x)
        for path in ("dense", "flex"):
            t0 = time.perf_counter()
            mask = dflash.build_masks(cfg, inp.anchors, inp.valid, S, path)[key]
            mask_s = time.perf_counter() - t0
            call = lambda: layer.self_attn(x, cos, sin, k, v, mask)  # noqa: E731  (a BlockMask: flex)
            t0 = time.perf_counter()
            out[path] = call()                                      # flex: compiles for this shape
            first = time.perf_counter() - t0
            steady = min(_time(call) for _ in range(repeats))
            rows.append({"impl": path, "num_anchors": N, "seq_len": S, "seconds": steady,
                         "compile_seconds": max(first - steady, 0.0) if path == "flex" else None,
                         "mask_seconds": mask_s})
    rows[1]["max_abs_diff"] = (out["flex"] - out["dense"]).abs().max().item()  # flex vs dense outputs
    return rows


def _time(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# -----------------------------------------------------------------------------
# c. The loss at V = 248320: chunked projection + CE vs full logits


def loss_case(impl, D, V, tokens, repeats):
    """hidden (1, N, B, D) -> sum(w * CE) / sum(w), forward + backward; the lm_head is the target's (frozen).
    Both compute the same tokens (those with weight > 0), so only the chunking differs."""
    g = torch.Generator().manual_seed(0)
    B = 16
    N = tokens // B
    lm_head = nn.Linear(D, V, bias=False).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.normal_(0, 0.02, generator=g)
    anchors = (torch.arange(N) * B)[None]                       # disjoint blocks, all inside the sequence
    valid = torch.ones(1, N, dtype=torch.bool)
    loss_mask = torch.ones(1, N * B + B, dtype=torch.long)
    weights = dflash.loss_weights(anchors, valid, loss_mask, B, gamma=4.0)    # (1, N, B), 0 at offset 0
    labels = torch.randint(0, V, (1, N, B), generator=g)
    hidden = torch.randn(1, N, B, D, generator=g).requires_grad_(True)
    w_total = weights.sum()
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
            del logits
        (loss_sum / w_total).backward()
        loss["value"] = (loss_sum / w_total).item()

    r = timed(step, repeats, warmup=0)  # one big op: nothing to warm up that matters
    return {**r, "loss": loss["value"], "grad_norm": hidden.grad.norm().item()}


# -----------------------------------------------------------------------------
# d. tau: the exact method vs the real decode loop on a tiny dense target


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
    """A drafter briefly trained with dflash's own pieces on the target's greedy continuations of `prompts` (the
    evaluation prompts: a random target cannot be learned in seconds, but its continuations can be memorised), so
    that acceptance lengths vary and the exact-vs-loop comparison is not trivial (a random drafter accepts nothing).
    The resulting tau is no measure of quality."""
    cfg = dflash.DFlashConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, vocab_size=512, block_size=16, mask_token_id=511,
                              target_layer_ids=[1, 2], num_target_layers=4,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=2048,
                              max_position_embeddings=2048, rope_theta=10000.0)
    ids = torch.tensor(prompts)
    seqs = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new_tokens, pad_token_id=0)
    P = ids.shape[1]
    samples = [(s.tolist(), [0] * P + [1] * (len(s) - P)) for s in seqs]
    torch.manual_seed(seed)
    drafter = dflash.DFlashDrafter(cfg, attention="dense").train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for step in range(steps):
        batch = dflash.collate(samples, 0, keys=[step * len(samples) + r for r in range(len(samples))])
        anchors, valid = dflash.batch_anchors(batch, 64)
        loss, stats = dflash.dflash_loss(drafter, target, batch, anchors, valid, gamma=4.0, noise_std=0.0,
                                         labels="target")  # sum(w * CE) / sum(w) of the batch
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return drafter.eval(), dflash.summarize(stats)["tau"]


def eval_case(num_prompts, max_new_tokens, train_steps):
    """Both modes of eval.evaluate_drafters on the same prompts, for the trained drafter and prompt lookup."""
    target = tiny_qwen3_target()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 511, (12,), generator=g).tolist() for _ in range(num_prompts)]
    t0 = time.perf_counter()
    drafter, train_tau = train_tiny_drafter(target, prompts, max_new_tokens, train_steps)
    train_s = time.perf_counter() - t0
    drafters = {"drafter": drafter, tau_eval.PROMPT_LOOKUP: tau_eval.PromptLookupDrafter()}
    reports, wall = {}, {}
    for mode in ("exact", "loop"):
        t0 = time.perf_counter()
        reports[mode] = tau_eval.evaluate_drafters(target, drafters, prompts, max_new_tokens, mode=mode,
                                                   progress=False)
        wall[mode] = time.perf_counter() - t0
    ex, lp = reports["exact"], reports["loop"]
    identical = all(rl["matches_greedy"] and all(a["acceptance_lengths"] == b["acceptance_lengths"]
                                                 and a["continuation"] == b["continuation"]
                                                 for a, b in zip(rx["prompts"], rl["prompts"]))
                    for rx, rl in zip(ex["results"], lp["results"]))
    rx, rl = ex["results"][0], lp["results"][0]  # the neural drafter
    return {
        # per drafter: the target's plain greedy generation runs once per prompt in both modes (exact: the truth;
        # loop: the reference its output must equal) and is shared by every drafter evaluated: reported apart
        "exact_seconds": ex["timing"]["features_s"] + rx["time_s"],
        "loop_seconds": rl["time_s"],
        "identical": bool(identical),
        "generate_seconds": ex["timing"]["generate_s"],
        "exact_wall_seconds": wall["exact"], "loop_wall_seconds": wall["loop"],
        "tau": rx["tau"], "steps": rx["steps"], "tokens": rx["tokens"], "histogram": rx["histogram"],
        "prompt_lookup_tau": ex["results"][1]["tau"], "train_seconds": train_s, "train_tau_estimate": train_tau,
        "num_prompts": num_prompts, "max_new_tokens": max_new_tokens}


# -----------------------------------------------------------------------------
# e. The memory plan (dflash_tools/plan.py) against measurement, and --grad_checkpoint's saving

# (name, drafter config overrides of cpu_config(), seq_len, num_anchors, batch)
PLAN_CHECKS = (("bench drafter, short", {}, 512, 32, 1),
               ("bench drafter, long", {}, 2048, 128, 1),
               ("3 narrow layers, GQA 4:1", dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3,
                                                 num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                                 block_size=8, target_layer_ids=[1, 3], layer_types=[
                                                     "sliding_attention"] * 2 + ["full_attention"]), 1024, 64, 2))
# the demo's drafter (dflash_tools/demo.py: D 128, MLP 384, 2 layers, 4/2 heads of 32, B 8, 32 anchors, 16 x 128
# tokens) and the bench drafter at 2048 tokens, 256 anchors
DEMO_SHAPE = (dict(hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   block_size=8, target_layer_ids=[0, 1, 2], num_target_layers=4, vocab_size=1024,
                   mask_token_id=1023), 128, 32, 16)
CKPT_SHAPES = (("demo shape", *DEMO_SHAPE), ("larger shape", {}, 2048, 256, 1))


def plan_estimate(cfg, S, N, b, grad_checkpoint):
    """The plan's drafter-side terms on CPU (one rank, fp32 activations, dense attention), from plan_rows()."""
    import dataclasses
    d = plan.drafter_sizes(dataclasses.asdict(cfg), dflash.expected_shapes(cfg))
    t = dict(params=0, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             vocab_size=cfg.vocab_size, context_layers=d["context_layers"])
    run = dict(world=1, zero=False, grad_checkpoint=grad_checkpoint, num_anchors=N, batch_size=b, max_len=S,
               attention="dense", target_bytes=4, act_bytes=4)
    rows = {name: v for name, v, _ in plan.plan_rows(t, d, run)}
    state = rows["drafter weights"] + rows["drafter gradients"] + rows["AdamW moments"]
    return {"state_mb": state / 2**20, "activations_mb": rows["drafter activations"] / 2**20,
            "backward_mb": rows["backward working set"] / 2**20}


def batch_inputs(cfg, S, N, b):
    """train_inputs() for b sequences (the first one repeated)."""
    inp = train_inputs(cfg, S, N)
    rep = lambda x: x.repeat(b, *[1] * (x.dim() - 1))  # noqa: E731
    return SimpleNamespace(**{k: rep(v) if k != "lm_head" else v for k, v in vars(inp).items()})


def memory_case(cfg, S, N, b, grad_checkpoint):
    """One training step (forward, chunked loss, backward, AdamW) in this (fresh) process. Measured two ways:
    exact: bytes of the tensors saved for backward (saved_tensors_hooks, each storage once, parameters excluded) plus
    the parameters, gradients and AdamW state; rss: peak resident set minus the one before the drafter existed."""
    gc.collect()
    exact_peak = reset_peak_rss()
    base = status_mb("VmRSS")
    torch.manual_seed(0)
    inp = batch_inputs(cfg, S, N, b)
    drafter = dflash.DFlashDrafter(cfg, attention="dense").train()
    drafter.grad_checkpoint = grad_checkpoint
    opt = torch.optim.AdamW(drafter.parameters())
    skip = {p.untyped_storage().data_ptr() for p in [*drafter.parameters(), inp.lm_head.weight]}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = drafter(inp.context, inp.x, inp.anchors, inp.valid)
        loss_sum, _ = dflash.weighted_ce(hidden, inp.lm_head, inp.labels, inp.weights)
    (loss_sum / inp.weights.sum()).backward()
    opt.step()
    tensors = [*drafter.parameters(), *(p.grad for p in drafter.parameters())]
    tensors += [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    state = sum(t.numel() * t.element_size() for t in tensors)
    return {"state_mb": state / 2**20, "saved_mb": sum(saved.values()) / 2**20,
            "rss_mb": status_mb("VmHWM") - base, "peak_exact": exact_peak}


def run_plan_check(args):
    """The plan's drafter-side estimate vs the exact count (and peak RSS) for PLAN_CHECKS; peak RSS with and
    without --grad_checkpoint at CKPT_SHAPES."""
    print(f"memory plan vs measurement on {machine()}: fp32, dense attention, one rank, no autocast")
    report = {"plan_check": [], "grad_checkpoint": []}
    print(f"{'configuration':<28} {'b x S, N':>16} {'plan_MB':>9} {'exact_MB':>9} {'plan/exact':>10} {'plan+bwd':>9}"
          f" {'rss_MB':>8} {'ratio':>6}")
    for name, over, S, N, b in PLAN_CHECKS:
        cfg = dflash.DFlashConfig(**{**vars(cpu_config()), **over})
        est = plan_estimate(cfg, S, N, b, False)
        m = in_fresh_process(memory_case, cfg, S, N, b, False)
        if "error" in m:
            print(f"{name:<28} {m['error']}")
            continue
        p_mb, x_mb = est["state_mb"] + est["activations_mb"], m["state_mb"] + m["saved_mb"]
        report["plan_check"].append({"name": name, "seq_len": S, "num_anchors": N, "batch": b, "plan": est, **m})
        pb = p_mb + est["backward_mb"]
        print(f"{name:<28} {f'{b} x {S}, {N}':>16} {p_mb:9.1f} {x_mb:9.1f} {p_mb / x_mb:10.2f} {pb:9.1f}"
              f" {m['rss_mb']:8.1f} {pb / m['rss_mb']:6.2f}")
    print(f"\n{'--grad_checkpoint':<28} {'b x S, N':>16} {'rss_off':>9} {'rss_on':>9} {'on/off':>10} "
          f"{'plan_off':>8} {'plan_on':>8}")
    for name, over, S, N, b in CKPT_SHAPES:
        cfg = dflash.DFlashConfig(**{**vars(cpu_config()), **over})
        off, on = (in_fresh_process(memory_case, cfg, S, N, b, c) for c in (False, True))
        po, pn = (plan_estimate(cfg, S, N, b, c) for c in (False, True))
        tot = lambda e: e["state_mb"] + e["activations_mb"] + e["backward_mb"]  # noqa: E731
        report["grad_checkpoint"].append({"name": name, "seq_len": S, "num_anchors": N, "batch": b, "off": off,
                                          "on": on, "plan_off": po, "plan_on": pn})
        print(f"{name:<28} {f'{b} x {S}, {N}':>16} {off['rss_mb']:9.1f} {on['rss_mb']:9.1f} "
              f"{on['rss_mb'] / off['rss_mb']:10.2f} {tot(po):8.1f} {tot(pn):8.1f}")
    print("plan: weights + gradients + AdamW + activations (saved for backward); exact: the saved-for-backward bytes "
          "(saved_tensors_hooks) + parameters, gradients, AdamW state; plan+bwd: plus the plan's backward working set; "
          "rss: peak resident set above the one before the drafter and its inputs existed (fresh forked process); "
          "plan_off/plan_on: the plan's plan+bwd")
    return report


# -----------------------------------------------------------------------------
# The CPU run: all sections, one table, the targets


def run_cpu(args):
    quick = args.quick
    cfg = cpu_config()
    repeats = 1 if quick else 3
    loss_tokens = 4096
    report = {"machine": machine(), "train_step": [], "attention": [], "loss": None, "eval": None}
    print(f"DFlash bench ({'quick' if quick else 'full'}) on {report['machine']}")
    print(f"drafter: {describe(cfg)}; fp32, 1 sequence, anchors drawn uniformly")
    print(f"seconds: best of {repeats} after 1 warmup{' (a first run over 2 s is timed itself)' if quick else ''}; "
          f"peak_MB: peak resident memory (VmHWM) above the resident baseline, each configuration in a fresh forked "
          f"process (torch's CPU allocator returns freed memory)")
    t_start = time.time()

    # a. training step (forked children: the parent runs no torch op before the last fork)
    shapes = [(FIXED_LEN, n) for n in ANCHOR_SWEEP] + [(s, FIXED_ANCHORS) for s in LENGTH_SWEEP]
    shapes = list(dict.fromkeys(shapes))
    exact_peaks = []
    for S, N in shapes:
        for impl in ("ours", "naive"):
            r = in_fresh_process(train_step_case, impl, cfg, S, N, repeats, 2.0 if quick else None)
            report["train_step"].append({"impl": impl, "num_anchors": N, "seq_len": S, "seconds": r.get("seconds"),
                                         "peak_mb": r.get("peak_mb"), "loss": r.get("loss"),
                                         **({"error": r["error"]} if "error" in r else {})})
            exact_peaks.append(r.get("peak_exact", True))
            progress(f"train step {impl:5s} anchors {N:4d} len {S:5d}", r)

    # c. loss at the big vocabulary
    loss = {"vocab": BIG_VOCAB, "tokens": loss_tokens, "hidden_size": cfg.hidden_size}
    for impl in ("chunked", "unchunked"):
        r = in_fresh_process(loss_case, impl, cfg.hidden_size, BIG_VOCAB, loss_tokens, 1)
        loss[impl] = {"seconds": r.get("seconds"), "peak_mb": r.get("peak_mb"), "loss": r.get("loss"),
                      **({"error": r["error"]} if "error" in r else {})}
        exact_peaks.append(r.get("peak_exact", True))
        progress(f"loss {impl}", r)
    report["loss"] = loss

    # b. attention (in this process from here on: compiled kernels are timed, not memory); a fresh inductor cache
    # so that compile times are what a first run pays, not a cache hit from an earlier run
    cache = None
    if args.fresh_compile_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_inductor_")
    for S, N in shapes:
        rows = attention_case(cfg, S, N, repeats)
        report["attention"] += rows
        progress(f"attention anchors {N:4d} len {S:5d}", {"seconds": rows[1]["seconds"]})
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]

    # d. eval
    report["eval"] = eval_case(num_prompts=4, max_new_tokens=128, train_steps=40)
    progress("eval", {"seconds": report["eval"]["loop_seconds"]})

    print_table(report)
    if not all(exact_peaks):
        print("note: /proc/self/clear_refs was not writable: peaks include the setup of each configuration")
    targets = check_targets(report)
    print(f"total {time.time() - t_start:.0f}s")
    return report, targets


def progress(what, r):
    msg = r.get("error") or f"{r['seconds']:.3f}s"
    print(f"  .. {what}: {msg}", file=sys.stderr, flush=True)


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_table(rep):
    ts, at = rep["train_step"], rep["attention"]
    find = lambda rows, impl, S, N: next((r for r in rows if r["impl"] == impl and r["seq_len"] == S  # noqa: E731
                                          and r["num_anchors"] == N), {})
    print()
    print(f"{'what':<34} {'impl':<9} {'anchors':>7} {'seq_len':>7} {'seconds':>9} {'peak_MB':>9}  note")
    for r in ts:
        note = r.get("error", "")
        if r["impl"] == "naive" and not note:
            ours = find(ts, "ours", r["seq_len"], r["num_anchors"])
            if ours.get("seconds") and r.get("seconds"):
                note = f"naive/ours time {r['seconds'] / ours['seconds']:.2f}x"
                if ours.get("peak_mb") and r.get("peak_mb"):
                    note += f", memory {r['peak_mb'] / ours['peak_mb']:.2f}x"
        print(f"{'train step fwd+bwd (fp32)':<34} {r['impl']:<9} {r['num_anchors']:>7} {r['seq_len']:>7} "
              f"{fmt(r['seconds'], '9.3f')} {fmt(r['peak_mb'], '9.0f')}  {note}")
    for r in at:
        if r["impl"] == "flex":
            dense = find(at, "dense", r["seq_len"], r["num_anchors"])
            note = (f"compile {r['compile_seconds']:.1f}s, mask {r['mask_seconds']:.2f}s; "
                    f"dense/flex {dense['seconds'] / r['seconds']:.2f}x")
        else:
            note = f"mask {r['mask_seconds']:.2f}s"
        print(f"{'attention fwd, full layer':<34} {r['impl']:<9} {r['num_anchors']:>7} {r['seq_len']:>7} "
              f"{r['seconds']:>9.3f} {'':>9}  {note}")
    ls = rep["loss"]
    for impl in ("chunked", "unchunked"):
        r = ls[impl]
        note = r.get("error") or (f"{ls['tokens']} block tokens ({ls['tokens'] * 15 // 16} weighted), "
                                  f"D={ls['hidden_size']}, loss {fmt(r['loss'], '.6f')}")
        print(f"{'loss fwd+bwd, V=%d' % ls['vocab']:<34} {impl:<9} {'':>7} {'':>7} "
              f"{fmt(r['seconds'], '9.3f')} {fmt(r['peak_mb'], '9.0f')}  {note}")
    ev = rep["eval"]
    print(f"{'tau, tiny Qwen3 target':<34} {'exact':<9} {'':>7} {'':>7} {ev['exact_seconds']:>9.3f} {'':>9}  "
          f"tau {ev['tau']:.3f}, {ev['steps']} steps / {ev['tokens']} tokens, {ev['num_prompts']} prompts")
    print(f"{'':<34} {'loop':<9} {'':>7} {'':>7} {ev['loop_seconds']:>9.3f} {'':>9}  "
          f"identical: {ev['identical']} (this drafter and prompt lookup, tau {ev['prompt_lookup_tau']:.3f}); "
          f"+ greedy generation {ev['generate_seconds']:.2f}s in each mode, shared by all drafters")
    pairs = [(r, find(ts, "naive", r["seq_len"], r["num_anchors"])) for r in ts if r["impl"] == "ours"]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in pairs if a.get("loss") is not None and b.get("loss") is not None]
    attn = [r["max_abs_diff"] for r in at if "max_abs_diff" in r]
    print(f"cross-checks: train loss ours vs naive max |diff| {fmt(max(diffs, default=None), '.1e')}; attention "
          f"output flex vs dense max |diff| {fmt(max(attn, default=None), '.1e')}")


def check_targets(rep):
    """PASS/MISS of each target, from the measured figures."""
    out = []

    def verdict(name, ok, detail):
        out.append({"target": name, "pass": bool(ok), "detail": detail})
        print(f"{'PASS' if ok else 'MISS'}  {name}: {detail}")

    print()
    t = {r["num_anchors"]: r["seconds"] for r in rep["train_step"] if r["impl"] == "ours" and r["seq_len"] == FIXED_LEN}
    if t.get(128) and t.get(512):
        ratio = t[512] / t[128]
        verdict("training step about linear in num_anchors", ratio < 8,
                f"time(512)/time(128) = {ratio:.2f} at length {FIXED_LEN} (linear: <= 4, quadratic: 16; PASS below "
                f"8, their geometric mean)" + (f"; time(128)/time(32) = {t[128] / t[32]:.2f}" if t.get(32) else ""))
    else:
        verdict("training step about linear in num_anchors", False, "not measured (error)")
    ls = rep["loss"]
    c, u = ls["chunked"].get("peak_mb"), ls["unchunked"].get("peak_mb")
    if c and u:
        verdict("chunked loss peak memory < 25% of unchunked", c < 0.25 * u,
                f"{c:.0f} MB vs {u:.0f} MB = {100 * c / u:.1f}% at V={ls['vocab']}, {ls['tokens']} tokens")
    else:
        verdict("chunked loss peak memory < 25% of unchunked", False, "not measured (error)")
    ev = rep["eval"]
    speed = ev["loop_seconds"] / max(ev["exact_seconds"], 1e-9)
    wall = ev["loop_wall_seconds"] / max(ev["exact_wall_seconds"], 1e-9)
    verdict("exact tau >= 5x faster than the loop, identical results", speed >= 5 and ev["identical"],
            f"loop/exact per drafter {speed:.1f}x ({ev['loop_seconds']:.2f}s vs {ev['exact_seconds']:.2f}s), "
            f"identical acceptance lengths and outputs: {ev['identical']}; whole evaluate_drafters() calls incl. the "
            f"shared greedy generation: {wall:.2f}x")
    return out


# -----------------------------------------------------------------------------
# --gpu: flex (compiled) vs dense SDPA training step at the Qwen3-8B drafter shape (bench_gpu.sh)


def gpu_config(dry_run):
    if dry_run:  # tiny, but the same layout: 5 layers, GQA 4:1, 5 context layers
        return dflash.DFlashConfig(
            hidden_size=64, intermediate_size=192, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1,
            head_dim=16, vocab_size=1000, block_size=16, mask_token_id=999, target_layer_ids=[1, 9, 17, 25, 33],
            num_target_layers=36, layer_types=["full_attention"] * 5, sliding_window=None)
    # Qwen3-8B drafter: D=4096, 5 layers, 32/8 heads, head_dim 128, MLP 12288, fc 20480 -> 4096; Qwen3-8B has no
    # sliding window, so all layers are full attention; vocab 151936
    return dflash.DFlashConfig(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=151936, block_size=16, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
        num_target_layers=36, layer_types=["full_attention"] * 5, sliding_window=None, rope_theta=1e6,
        max_position_embeddings=40960)


def visible_pairs(cfg, anchors, valid, S):
    """(query, key) pairs the mask lets through, per layer kind, summed over layers (the useful attention work)."""
    total = 0
    for i in range(cfg.num_hidden_layers):
        mod = dflash.make_mask_mod(anchors, valid, S, cfg.block_size, *cfg.layer_kind(i))
        total += int(dflash.dense_mask(mod, *anchors.shape, S, cfg.block_size, anchors.device).sum())
    return total


def train_step_flops(cfg, S, N, weighted_tokens, pairs):
    """Matmul FLOPs of one drafter training step (forward + backward), b = 1. A matmul (m x k) @ (k x n) is 2mkn
    forward and 4mkn backward (input and weight gradients).
      context (S tokens): fc (m*D -> D), no input gradient: 2 + 2; per layer k/v projections of ctx: 2 + 4
      blocks (N*B tokens), per layer: q, k, v, o projections and the SwiGLU MLP: 2 + 4
      attention: QK^T and PV over the visible (query, key) pairs only: 4*head_dim*heads per pair forward, 2x that
        backward (what flex computes; dense SDPA also computes the masked-out pairs, not counted)
      lm_head on the weighted tokens (frozen): logits 2*D*V forward, the gradient w.r.t. hidden 2*D*V."""
    D, I, L, B = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.block_size
    h, hk, hd, m = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, len(cfg.target_layer_ids)
    ctx = S * (m * D * D * 4 + L * 2 * D * hk * hd * 6)
    blk = N * B * L * (D * (2 * h * hd + 2 * hk * hd) + 3 * D * I) * 6
    attn = pairs * 4 * hd * h * 3
    head = weighted_tokens * D * cfg.vocab_size * 4
    return ctx + blk + attn + head


def run_gpu(args):
    """One training step of the Qwen3-8B-shaped drafter, flex vs dense, then the gradients compared. --dry-run: the
    same code at tiny shapes on CPU, where flex has no backward (flex is timed forward only and compared on the
    forward outputs; the gradient comparison runs on dense vs the compiled dense model instead)."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    cpu = dev.type == "cpu"
    if cpu and not args.dry_run:
        print("no CUDA device: running the --dry-run sizes on CPU")
    cfg = gpu_config(dry_run=cpu)
    S, N = (256, 16) if cpu else (4096, 512)
    t_start = time.time()
    report = {"machine": machine(), "device": str(dev), "dry_run": cpu, "config": describe(cfg), "seq_len": S,
              "num_anchors": N, "dtype": "fp32" if cpu else "bf16 autocast, fp32 weights", "results": []}
    print(f"DFlash GPU bench{' (dry run on CPU)' if cpu else ''} on {report['machine']}")
    print(f"drafter: {describe(cfg)}; {S} tokens, {N} anchors, {report['dtype']}; target features random")
    print("acceptance checks (the default CUDA configuration):")
    acceptance(args, dev, cpu, report)
    save_json(report, args.json)
    if cpu:
        torch._dynamo.reset()  # the timing below starts from a clean compile cache

    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).to(dev).train()
    report["params"] = sum(p.numel() for p in drafter.parameters())
    feat_dtype = torch.float32 if cpu else torch.bfloat16       # the target's dtype

    def make_inputs(num_anchors):
        inp = train_inputs(cfg, S, num_anchors)
        t = SimpleNamespace(N=num_anchors, lm_head=inp.lm_head.to(dev, feat_dtype),
                            context=inp.context.to(dev, feat_dtype), x=inp.x.to(dev, feat_dtype),
                            **{k: getattr(inp, k).to(dev) for k in ("anchors", "valid", "labels", "weights")})
        t.w_total = t.weights.sum()
        t.flops = train_step_flops(cfg, S, num_anchors, int((t.weights > 0).sum()),
                                   visible_pairs(cfg, t.anchors, t.valid, S))
        return t

    cur = make_inputs(N)
    report["step_flops"] = cur.flops
    print(f"{report['params'] / 1e6:,.1f}M drafter parameters; {cur.flops / 1e12:.4g} TFLOP per step (bench.py "
          f"train_step_flops: matmuls only, attention over visible pairs); MFU = FLOP/s / {H200_BF16_PEAK / 1e12:.0f} "
          f"TFLOP/s (H200 dense bf16)")

    def forward(model, path):
        getattr(model, "_orig_mod", model).attention = path  # on the drafter itself, under a compiled wrapper
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not cpu):
            hidden = model(cur.context, cur.x, cur.anchors, cur.valid)
            loss_sum, _ = dflash.weighted_ce(hidden, cur.lm_head, cur.labels, cur.weights)
        return hidden, loss_sum / cur.w_total

    def step(model, path):
        drafter.zero_grad(set_to_none=True)
        hidden, loss = forward(model, path)
        loss.backward()
        return hidden.detach(), loss.detach()

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    def measure(name, model, path, backward=True, repeats=3):
        """First call (includes compilation) and the best of `repeats` steps. Returns the last step's gradients (on
        the CPU, so they do not add to the next run's memory) and hidden states; (None, None) if it failed."""
        run = (lambda: step(model, path)) if backward else torch.no_grad()(lambda: forward(model, path))
        if not cpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        try:
            t0 = time.perf_counter()
            run()
            sync()
            first = time.perf_counter() - t0
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                hidden, loss = run()
                sync()
                times.append(time.perf_counter() - t0)
        except Exception as e:  # out of memory, a compile error: reported, the other runs go on
            drafter.zero_grad(set_to_none=True)
            row = {"impl": name, "num_anchors": cur.N, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            print(f"  {name:<32} {row['error']}")
            report["results"].append(row)
            save_json(report, args.json)
            return None, None
        t = min(times)
        row = {"impl": name, "num_anchors": cur.N, "backward": backward, "first_call_seconds": first,
               "compile_seconds": max(first - t, 0.0), "step_seconds": t, "tokens_per_s": S / t,
               "block_tokens_per_s": cur.N * cfg.block_size / t, "tflops": cur.flops / t / 1e12 if backward else None,
               "mfu": cur.flops / t / H200_BF16_PEAK if backward and not cpu else None,
               "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if not cpu else None,
               "peak_extra_mb": (torch.cuda.max_memory_allocated() - base) / 2**20 if not cpu else None,
               "loss": loss.item()}
        report["results"].append(row)
        save_json(report, args.json)  # a hard timeout later keeps what was measured
        print(f"  {name:<32} first call {first:7.2f}s  step {t:7.3f}s  {row['tokens_per_s']:8.0f} tok/s"
              + (f"  {row['tflops']:7.1f} TFLOP/s" if backward else "")
              + (f"  MFU {100 * row['mfu']:5.1f}%  peak {row['peak_mb']:7.0f} MB (+{row['peak_extra_mb']:.0f} "
                 f"over weights and inputs)" if not cpu else "") + f"  loss {row['loss']:.5f}")
        grads = {k: p.grad.detach().float().cpu() for k, p in drafter.named_parameters()} if backward else None
        drafter.zero_grad(set_to_none=True)
        return grads, hidden.float().cpu()

    def compare_grads(name, g1, g2):
        diff = max((g1[k] - g2[k]).abs().max().item() for k in g1)
        scale = max(g.abs().max().item() for g in g2.values())
        rel = max(((g1[k] - g2[k]).norm() / g2[k].norm().clamp(min=1e-30)).item() for k in g1)
        report["gradients"] = {"compared": name, "num_anchors": cur.N, "max_abs_diff": diff, "max_abs_grad": scale,
                               "max_rel_l2_diff": rel}
        print(f"  gradients, {name} ({cur.N} anchors): max |diff| {diff:.3e} (largest |grad| {scale:.3e}); worst "
              f"per-tensor relative L2 difference {rel:.3e}")
        save_json(report, args.json)

    if cpu:
        print("CPU: flex_attention has no backward here: flex is timed forward only and compared with dense on the "
              "forward outputs; the gradient check compares dense eager with the compiled dense drafter")
        g_a, h_dense = measure("dense (SDPA)", drafter, "dense")
        _, h_flex = measure("flex (compiled kernel), fwd only", drafter, "flex", backward=False)
        # the whole drafter traced by dynamo (as train() compiles it on CUDA); aot_eager because inductor's CPU flex
        # template cannot lower a flex call inside a larger graph in torch 2.13 (choose_flex_template assumes a 4-d
        # query buffer); the CUDA (Triton) lowering is another code path
        g_b, _ = measure("dense + compile(model)", torch.compile(drafter, backend="aot_eager"), "dense")
        _, h_flex_c = measure("flex + compile(model), fwd only", torch.compile(drafter, backend="aot_eager"), "flex",
                              backward=False)
        report["forward_max_abs_diff"] = (h_flex - h_dense).abs().max().item()
        report["compiled_forward_max_abs_diff"] = (h_flex_c - h_dense).abs().max().item()
        print(f"  forward outputs, flex vs dense: max |diff| {report['forward_max_abs_diff']:.2e}; compiled flex vs "
              f"dense: {report['compiled_forward_max_abs_diff']:.2e}")
        compare_grads("dense eager vs dense compiled", g_a, g_b)
    else:
        g_flex, _ = measure("flex (compiled kernel)", drafter, "flex")
        g_dense, _ = measure("dense (SDPA)", drafter, "dense")
        fallback = g_flex is not None and g_dense is None
        if fallback:  # dense did not fit: compare the gradients at fewer anchors
            cur = make_inputs(N // 4)
            g_flex, _ = measure("flex (compiled kernel)", drafter, "flex")
            g_dense, _ = measure("dense (SDPA)", drafter, "dense")
        if g_flex is not None and g_dense is not None:
            compare_grads("flex vs dense", g_flex, g_dense)
        del g_flex, g_dense
        if fallback:
            cur = make_inputs(N)
        if time.time() - t_start < args.budget / 2:  # what train() runs on CUDA: the whole drafter compiled
            measure("flex + compile(model)", torch.compile(drafter), "flex")
        else:
            print("  flex + compile(model): skipped (time budget)")
    report["total_seconds"] = time.time() - t_start
    print(f"total {report['total_seconds']:.0f}s")
    save_json(report, args.json)
    return report


# -----------------------------------------------------------------------------
# --gpu acceptance: the default CUDA configuration (compiled drafter, flex, bf16 autocast), one PASS/FAIL/SKIP line
# per check. bench_gpu.sh runs it under TORCH_LOGS=recompiles,graph_breaks, so any recompile is also in the log.

EAGER_FLEX = "flex_attention called without torch.compile"  # flex warns this when it runs unfused


def verdict(report, name, ok, detail):
    word = "SKIP" if ok is None else "PASS" if ok else "FAIL"
    report.setdefault("acceptance", []).append({"check": name, "result": word, "detail": detail})
    print(f"{word} {name}: {detail}", flush=True)


def accept_config(cpu):
    """The Qwen3.6 drafter geometry (DFlashConfig() defaults: 4 sliding + 1 full layer); tiny on the CPU."""
    if not cpu:
        return dflash.DFlashConfig()
    return dflash.DFlashConfig(hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=1,
                               head_dim=16, vocab_size=1000, mask_token_id=999, sliding_window=64)


def acceptance(args, dev, cpu, report):
    from torch._dynamo.utils import counters
    cfg, ac = accept_config(cpu), torch.autocast("cuda", dtype=torch.bfloat16, enabled=not cpu)
    S, N = (256, 16) if cpu else (4096, 512)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg, "flex").to(dev).train()
    fdt = torch.float32 if cpu else torch.bfloat16

    def inputs(n, seed):
        t = train_inputs(cfg, S, n, seed)
        return [x.to(dev, fdt) if x.is_floating_point() else x.to(dev) for x in
                (t.context, t.x, t.anchors, t.valid, t.labels, t.weights)] + [t.lm_head.to(dev, fdt)]

    def loss_of(model, inp):
        ctx, x, a, v, y, w, head = inp
        with ac:
            return dflash.weighted_ce(model(ctx, x, a, v), head, y, w)[0] / w.sum()

    # 1+3. the whole drafter compiled, 3 steps with fresh anchors: one graph, no recompile; peak memory with AdamW
    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(drafter, backend="aot_eager") if cpu else torch.compile(drafter)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=not cpu)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for i in range(3):
                inp = inputs(N, seed=i)
                if cpu:  # flex has no backward on the CPU
                    with torch.no_grad():
                        loss_of(model, inp)
                else:
                    loss_of(model, inp).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        verdict(report, "compiled drafter, 3 steps, fresh anchors", graphs == 1 and breaks == 0,
                f"{graphs} graph(s), {breaks} graph break(s), no recompile ({S} tokens, {N} anchors, "
                f"{cfg.layer_types.count('sliding_attention')} sliding layers)")
    except Exception as e:
        verdict(report, "compiled drafter, 3 steps, fresh anchors", False, f"{type(e).__name__}: {str(e)[:300]}")
    if cpu:
        verdict(report, "peak memory with fused AdamW", None, "CPU: no CUDA memory counters")
    else:
        peak, total = torch.cuda.max_memory_allocated(), torch.cuda.get_device_properties(dev).total_memory
        report["acceptance_peak_gib"] = peak / 2**30
        verdict(report, "peak memory with fused AdamW", peak < 0.9 * total, f"{peak / 2**30:.1f} GiB of "
                f"{total / 2**30:.0f} GiB")
    del opt

    # 2. its gradients against eager dense attention at 128 anchors
    if cpu:
        verdict(report, "compiled flex gradients vs eager dense", None, "CPU: flex_attention has no backward")
    else:
        torch._dynamo.reset()
        inp, grads = inputs(128, seed=7), []
        for m, path in ((torch.compile(drafter), "flex"), (drafter, "dense")):
            drafter.attention = path
            drafter.zero_grad(set_to_none=True)
            loss_of(m, inp).backward()
            grads.append({k: p.grad.float() for k, p in drafter.named_parameters()})
        drafter.attention = "flex"
        drafter.zero_grad(set_to_none=True)
        rel = max(((grads[0][k] - grads[1][k]).norm() / grads[1][k].norm().clamp(min=1e-30)).item()
                  for k in grads[0])
        verdict(report, "compiled flex gradients vs eager dense", rel < 5e-2,
                f"worst per-tensor relative L2 difference {rel:.2e} at 128 anchors (limit 5e-2, bf16)")
        del grads

    # 4. flex receives bf16 q/k/v in forward and backward (the eager drafter around the compiled kernel)
    seen, compiled = [], dflash.compiled_flex_attention

    def recording(q, k, v, **kw):
        seen.append(("forward", q.dtype, k.dtype, v.dtype))
        for t in (q, k, v):
            if t.requires_grad:
                t.register_hook(lambda g: seen.append(("backward", g.dtype)))
        return compiled(q, k, v, **kw)

    dflash.compiled_flex_attention = recording
    try:
        inp = inputs(16, seed=3)
        if cpu:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                drafter(*inp[:4])
        else:
            loss_of(drafter, inp).backward()
            drafter.zero_grad(set_to_none=True)
    finally:
        dflash.compiled_flex_attention = compiled
    dts = {d for s in seen for d in s[1:]}
    back = [s for s in seen if s[0] == "backward"]
    verdict(report, "flex q/k/v dtype", dts == {torch.bfloat16} and (cpu or len(back) > 0),
            f"{sorted(map(str, dts))} in {len(seen) - len(back)} forward calls"
            + (" (CPU autocast; backward SKIP: flex has no backward on the CPU)" if cpu else
               f" and {len(back)} backward gradients"))
    del drafter, model
    eval_check(report, dev, cpu, counters)
    end_to_end(report, cpu)
    loop_check(report, dev, cpu)
    plan_vs_cuda(report, dev, cpu)


def eval_check(report, dev, cpu, counters):
    """5. held-out evaluation at 6 distinct lengths (and a ragged last batch): no recompile-limit hit, never unfused."""
    import warnings
    target = tiny_qwen3_target()
    target.model.to(dev, torch.float32 if cpu else torch.bfloat16)
    cfg = dflash.new_drafter_config(target, 3, mask_token_id=511, target_layer_ids=[1, 2, 3], num_heads=4,
                                    num_kv_heads=2, head_dim=16, sliding_window=64)
    drafter = dflash.DFlashDrafter(cfg, "flex").to(dev).eval()
    g = torch.Generator().manual_seed(0)
    lengths = (90, 130, 170, 210, 250, 300)
    samples = [(torch.randint(0, 500, (n,), generator=g).tolist(), [0] * 20 + [1] * (n - 20)) for n in lengths]
    torch._dynamo.reset()
    counters.clear()
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings():
            warnings.filterwarnings("error", message=EAGER_FLEX)
            m = dflash.evaluate(drafter, target, samples, 4, 32, 0, 0, 0, 1, gamma=4.0, labels="target",
                                pad_to=dflash.padded_length(max(lengths)))
        kinds = len({cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)})
        graphs = counters["stats"]["unique_graphs"]
        verdict(report, "evaluation at 6 lengths, fused flex", graphs <= 2 * kinds, f"{graphs} graph(s) for {kinds} "
                f"mask kinds (flex + block masks), no recompile-limit hit, never unfused; tau {m['tau']:.3f}")
    except Exception as e:
        verdict(report, "evaluation at 6 lengths, fused flex", False, f"{type(e).__name__}: {str(e)[:300]}")


def tiny_run_flags(d, cpu, rows=40):
    """A tiny Qwen3 target saved in d/target and pre-tokenized data in d/data.jsonl (random 20-token prompts, then
    the loss tokens); the dflash.py flags of a small drafter for it."""
    tiny_qwen3_target().model.save_pretrained(os.path.join(d, "target"))
    g = torch.Generator().manual_seed(1)
    with open(os.path.join(d, "data.jsonl"), "w") as f:
        for i in range(rows):
            n = 60 + 7 * i
            f.write(json.dumps({"input_ids": torch.randint(0, 500, (n,), generator=g).tolist(),
                                "loss_mask": [0] * 20 + [1] * (n - 20)}) + "\n")
    return ["--target", os.path.join(d, "target"), "--data", os.path.join(d, "data.jsonl"), "--batch_size", "2",
            "--grad_accum", "1", "--eval_fraction", "0.2", "--max_len", "512", "--mask_token_id", "511",
            "--num_heads", "4", "--num_kv_heads", "2", "--head_dim", "16", "--sliding_window", "64", "--num_anchors",
            "16", "--log_every", "1", "--num_draft_layers", "3", "--target_layer_ids", "1,2,3",
            *(["--device", "cpu"] if cpu else [])]


def loop_check(report, dev, cpu):
    """7. `torchrun --nproc_per_node=1 dflash.py` with compile on for a few dozen steps on a tiny target: the loss
    falls; the checkpoint loads in eval.py; its exact tau on this device equals its tau on the CPU (same checkpoint,
    prompts and continuations, fp32 on both). The CPU dry run trains uncompiled (flex has no backward there)."""
    import subprocess
    d = tempfile.mkdtemp(prefix="dflash_loop_")
    try:
        out, steps = os.path.join(d, "out"), 6 if cpu else 40
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_port",
               str(29400 + os.getpid() % 500), os.path.join(ROOT, "dflash.py"), *tiny_run_flags(d, cpu), "--out", out,
               "--max_steps", str(steps), "--lr", "3e-3", "--eval_every", "0", "--compile", "off" if cpu else "on"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        losses = []
        if os.path.isfile(os.path.join(out, "metrics.jsonl")):
            with open(os.path.join(out, "metrics.jsonl")) as f:
                losses = [rec["loss"] for rec in map(json.loads, f) if "loss" in rec]
        falls = r.returncode == 0 and len(losses) == steps and losses[-1] < losses[0]
        verdict(report, f"torchrun loop, compile {'off' if cpu else 'on'}, {steps} steps: loss falls", falls,
                f"rc {r.returncode}, {len(losses)} logged steps, loss "
                + (f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-")
                + ("" if r.returncode == 0 else f"; tail: {(r.stdout + r.stderr)[-600:]!r}"))
        ckpt = dflash.latest_checkpoint(out)
        with open(os.path.join(d, "data.jsonl")) as f:
            prompts = [json.loads(line)["input_ids"][:20] for line in f][:6]
        ref = dflash.load_target(os.path.join(d, "target"), "cpu", torch.float32)
        conts = [tau_eval.greedy_continuation(ref, p, 32, ref.eos_ids()) for p in prompts]
        taus = {}
        for where in ["cpu"] + ([] if cpu else [str(dev)]):
            t = dflash.load_target(os.path.join(d, "target"), where, torch.float32)
            ds = tau_eval.load_drafters([ckpt], t, torch.float32, False, "dense" if where == "cpu" else "flex")
            res = tau_eval.evaluate_drafters(t, ds, prompts, 32, continuations=conts, progress=False)["results"][0]
            taus[where] = (res["tau"], [e["acceptance_lengths"] for e in res["prompts"]])
        same = len(set(map(str, taus.values()))) == 1
        verdict(report, "checkpoint loads in eval.py; exact tau on the device == on the CPU", same if not cpu else None,
                ", ".join(f"{w}: tau {v[0]:.4f}" for w, v in taus.items())
                + (" (CPU dry run: no second device to compare)" if cpu else ", identical acceptance lengths"
                   if same else ", acceptance lengths differ"))
    except Exception as e:
        verdict(report, "torchrun loop / eval.py / tau on device", False, f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def plan_vs_cuda(report, dev, cpu):
    """8. The memory plan's drafter-side terms against torch.cuda.max_memory_allocated at the Qwen3-8B drafter shape
    (4096 tokens, 512 anchors, flex, bf16 autocast, one fused AdamW step): within 25%."""
    if cpu:
        return verdict(report, "memory plan vs max_memory_allocated (Qwen3-8B drafter)", None, "CPU: no CUDA counters")
    import dataclasses
    cfg, S, N = gpu_config(dry_run=False), 4096, 512
    inp = train_inputs(cfg, S, N)
    ctx, x = inp.context.to(dev, torch.bfloat16), inp.x.to(dev, torch.bfloat16)
    a, v, y, w = (getattr(inp, k).to(dev) for k in ("anchors", "valid", "labels", "weights"))
    head = inp.lm_head.to(dev, torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    drafter = dflash.DFlashDrafter(cfg, "flex").to(dev).train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-5, fused=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = dflash.weighted_ce(drafter(ctx, x, a, v), head, y, w)[0] / w.sum()
    loss.backward()
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
    ratio = planned / measured
    verdict(report, "memory plan vs max_memory_allocated (Qwen3-8B drafter)", 0.75 <= ratio <= 1.25,
            f"plan {planned / 2**30:.2f} GiB vs measured {measured / 2**30:.2f} GiB: {ratio:.2f}x (limit 25%)")
    del drafter, opt, loss
    torch.cuda.empty_cache()


def end_to_end(report, cpu):
    """6. dflash.py --max_steps 3 --eval_every 2 on a tiny Qwen3 target, then --resume (to step 5)."""
    import subprocess
    d = tempfile.mkdtemp(prefix="dflash_accept_")
    try:
        base = [sys.executable, os.path.join(ROOT, "dflash.py"), *tiny_run_flags(d, cpu), "--out",
                os.path.join(d, "out"), "--eval_every", "2", "--save_every", "2"]
        for name, extra in (("end to end, 3 steps", ["--max_steps", "3"]),
                            ("end to end, --resume", ["--max_steps", "5", "--resume"])):
            t0 = time.time()
            r = subprocess.run(base + extra, capture_output=True, text=True, timeout=240)
            log = r.stdout + r.stderr
            recompiles = log.count("Recompiling function")
            bad = [s for s in (EAGER_FLEX, "recompile_limit", "cache_size_limit", "Traceback") if s in log]
            ok = r.returncode == 0 and not bad and ("resumed from" in log if "--resume" in extra else True)
            verdict(report, name, ok, f"rc {r.returncode}, {time.time() - t0:.0f}s, {recompiles} recompile log "
                    f"line(s)" + (f", found {bad}" if bad else "") + ("" if ok else f"; tail: {log[-600:]!r}"))
    except Exception as e:
        verdict(report, "end to end", False, f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -----------------------------------------------------------------------------


def get_parser():
    p = argparse.ArgumentParser(description="Speed and memory of DFlash training and evaluation, side by side.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one timed repeat, none after a first run over 2 s (< 5 min on a quiet 2-core CPU)")
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument("--threads", type=int, default=0,
                   help="torch CPU threads (0: torch's default). On a machine shared with other jobs, 1 avoids "
                        "OpenMP threads waiting on each other, which makes small ops orders of magnitude slower")
    p.add_argument("--no_fresh_compile_cache", dest="fresh_compile_cache", action="store_false",
                   help="reuse the inductor cache (compile times then measure a warm cache)")
    p.add_argument("--plan_check", action="store_true",
                   help="only the memory plan against measurement, and peak memory with/without --grad_checkpoint")
    p.add_argument("--gpu", action="store_true", help="flex vs dense training step at the Qwen3-8B drafter shape")
    p.add_argument("--dry-run", dest="dry_run", action="store_true", help="--gpu at tiny shapes on CPU")
    p.add_argument("--budget", type=float, default=420, help="--gpu: seconds after which optional parts are skipped")
    return p


def save_json(report, path):
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)


def warn_if_oversubscribed():
    """Small ops with several OpenMP threads crawl when other jobs hold the cores (measured here: 64 forwards of
    a tiny model took 50 s with 2 threads instead of 0.5 s with 1); the figures would measure the neighbours."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if torch.get_num_threads() > 1 and load > cores:
        print(f"warning: load average {load:.1f} on {cores} cores with {torch.get_num_threads()} torch threads: "
              f"timings measure the other jobs; rerun on a quiet machine or with --threads 1", file=sys.stderr)


def main(argv=None):
    args = get_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warn_if_oversubscribed()
    if args.gpu or args.dry_run:
        report = run_gpu(args)
    elif args.plan_check:
        report = run_plan_check(args)
        save_json(report, args.json)
    else:
        report, _ = run_cpu(args)
        save_json(report, args.json)
    if args.json:
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
