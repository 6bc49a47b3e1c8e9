"""The memory plan of a DFlash training run: what one rank holds, term by term, from the configs alone.

An optional extra of dflash.py. plan_rows() is the arithmetic: plain numbers and dicts in, table rows out, so a GPU
test can compare it with torch.cuda.max_memory_allocated(). memory_plan() is what dflash.py's train() calls
before any weight loads (--plan prints and exits; a CUDA run prints it and stops early if it cannot fit).

Per rank, with P_t target parameters, P_d drafter parameters, R ranks, T = batch * anchors * block tokens:
  target weights    P_t x target dtype (text model only: no vision tower); with --shard_target the decoder layers
                    / R + the embedding, final norm and lm_head whole, plus two gathered layers during its forward
  drafter weights   P_d x 4 (fp32 master weights; autocast runs the matmuls in bf16)
  gradients         P_d x 4
  DDP buckets       P_d x 4, or 0 when they are views of the gradients (gradient_as_bucket_view=True: ours)
  AdamW moments     2 x P_d x 4, divided by R with --zero (ZeroRedundancyOptimizer)
  activations       the drafter's tensors saved for backward (per layer ~T(6D + 7Q + 4K + 4I) + the context
                    keys/values; with --grad_checkpoint only each layer's input plus one layer recomputed)
  backward          the gradients of one layer's saved tensors, alive while that layer runs backward
  loss buffers      one chunk of logits (vocab_chunk rows x V, fp32, and its bf16 original)
  target forward    the target pass under no_grad: captured features plus one layer's working set
With --features (a capture on disk, dflash_tools/features.py) the target weights are its embedding and lm_head alone
and the target forward is the batch's features as read: what remains is the drafter's, the embedding and lm_head.
Every term but the weights grows linearly with --max_len at fixed anchors (flex: block-sparse; dense: each group
of blocks' scores over its span of the context); the plan prices 4k to 256k and says where a run stops fitting.
The peak is the static terms plus the larger of (activations + backward + loss buffers) and the target forward.
"""
import os
import sys

import torch

import dflash

GB = 1e9
CUDA_ALLOWANCE = 4 * GB   # CUDA context, NCCL buffers, allocator fragmentation: not computed, allowed for


def count_params(*modules):
    """Parameters of the modules, each tensor once (a tied lm_head is the embedding)."""
    return sum(p.numel() for p in {id(p): p for m in modules for p in m.parameters()}.values())


def params_text(n):
    """A parameter count in the unit that fits it: 1.73B, 8.19M, 45.1K, 512."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{2 if n < 100 * size else 0}f}{unit}"
    return f"{n:,.0f}"


def activation_elems(d, T, b, S, attention, grad_checkpoint):
    """Elements the drafter saves for backward (d: drafter sizes; T block tokens, b sequences, S context length).
    Returns (elements, bool-mask bytes, elements of one decoder layer)."""
    D, I, L, B = d["hidden_size"], d["intermediate_size"], d["num_hidden_layers"], d["block_size"]
    Q, K, m = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"], d["context_layers"]
    if attention == "flex":  # one query sequence against [context ; all blocks]: q, k, v, out, lse
        attn = 2 * b * (S + T) * K + T * d["num_attention_heads"]
        masks = 0
    else:  # dense (two_part_attention): each head's softmax weights against [context ; own block]
        attn = d["num_attention_heads"] * T * (S + B)
        masks = len(set(d["layer_kinds"])) * T * (S + B)
    layer = T * (6 * D + 7 * Q + 4 * K + 4 * I) + attn          # one decoder layer, everything it saves
    taps, groups = d.get("conv_kernel_size", 0), D // max(d.get("conv_group_size", 0), 1)
    if taps:  # DFlash2: two convolutions a layer, each keeps its taps' shifted inputs and sums, both sides
        layer += 2 * (2 * (taps + 1) * T * D + T * 2 * taps * groups)
    ctx_kv = 4 * b * S * K                                       # k_proj -> k_norm -> RoPE of the context, per layer
    shared = b * S * m * D + 3 * b * S * D + 3 * T * D + T * D + 2 * T * d["head_dim"]  # fc in, norms, CE grad, RoPE
    r, k = d.get("selector_rank", 0), d.get("selector_top_k", 0)
    shared += T * (2 * k * r + 3 * r + 3 * k)  # DFlash2's selector: the candidates' codebook rows, H(h), A[pred]
    if grad_checkpoint:  # each layer keeps its input and its context keys/values; backward recomputes one layer
        return shared + L * (ctx_kv + T * D + 2 * b * S * K) + layer, masks, layer
    return shared + L * (layer + ctx_kv), masks, layer


def plan_rows(target, drafter, run):
    """The per-rank memory terms, in bytes: [(name, bytes, note)], the last row the peak.
    target: params, hidden_size, intermediate_size, vocab_size, context_layers (captured h[t]); with
      run["shard_target"] also decoder_params (all decoder layers) and layer_params (the largest one).
    drafter: params and the DFlashConfig fields hidden_size, intermediate_size, num_hidden_layers,
      num_attention_heads, num_key_value_heads, head_dim, block_size, layer_kinds, context_layers.
    run: world, zero, grad_checkpoint, shard_target (optional), num_anchors, batch_size, max_len, attention
      ("flex" | "dense"), target_bytes, act_bytes (activation dtype: 2 under bf16 autocast, 4 in fp32), cuda (adds
      an allowance)."""
    Pd, R, ab, tb = drafter["params"], run["world"], run["act_bytes"], run["target_bytes"]
    b, V, Dt = run["batch_size"], target["vocab_size"], target["hidden_size"]
    S = dflash.padded_length(run["max_len"]) if run["attention"] == "flex" else run["max_len"]
    T = b * run["num_anchors"] * drafter["block_size"]
    acts, mask_bytes, layer = activation_elems(drafter, T, b, S, run["attention"], run["grad_checkpoint"])
    chunk = dflash.vocab_chunk(V)
    # one chunk of logits in fp32 (and its bf16 original when the lm_head is bf16)
    logits = lambda rows: min(chunk, rows) * V * (4 + (tb if tb != 4 else 0))  # noqa: E731
    weights = ("target weights", target["params"] * tb, f"{params_text(target['params'])} params x {tb} bytes")
    gathered = ("gathered target layers", 0, "not sharded")
    if run.get("shard_target") and R > 1:  # (target: also decoder_params, layer_params: the largest layer)
        decoder, rest = target["decoder_params"], target["params"] - target["decoder_params"]
        weights = ("target weights", (decoder / R + rest) * tb,
                   f"{params_text(decoder)} decoder / {R} ranks + {params_text(rest)} whole, {tb} bytes")
        gathered = ("gathered target layers", 2 * target["layer_params"] * tb, "the running layer and the next one")
    if run.get("features"):  # --features: the embedding and lm_head alone; a batch of captured features read
        weights = ("target weights", target["io_params"] * tb, f"{params_text(target['io_params'])} params: embedding "
                   f"and lm_head only (--features)")
    rows = [weights,
            ("drafter weights", Pd * 4, f"{params_text(Pd)} params, fp32"),
            ("drafter gradients", Pd * 4, "fp32"),
            ("DDP gradient buckets", 0, "views of the gradients (gradient_as_bucket_view)" if R > 1 else "one rank"),
            ("AdamW moments", 2 * Pd * 4 / (R if run["zero"] and R > 1 else 1),
             f"2 x fp32{f', sharded over {R} ranks (--zero)' if run['zero'] and R > 1 else ''}"),
            ("drafter activations", acts * ab + mask_bytes,
             f"{T:,} block tokens x {drafter['num_hidden_layers']} layers, {ab}-byte"
             f"{', --grad_checkpoint' if run['grad_checkpoint'] else ''}"),
            ("backward working set", layer * ab, "gradients of one layer's saved tensors while it runs backward"),
            ("chunked-loss buffers", logits(T), f"{min(chunk, T)} rows x V={V} logits"),
            ("target-forward buffers", (b * S * (target["context_layers"] + 3) * Dt + 3 * b * S *
                                        target["intermediate_size"]) * tb + logits(b * S),
             f"captured features + one layer, {b} x {S} tokens"), gathered]
    if run.get("features"):  # no target forward: the batch's features and labels, as read
        rows[-2] = ("target-forward buffers", b * S * (target["context_layers"] * Dt * tb + 8),
                    f"--features: the batch's features and labels read, {b} x {S} tokens")
    if run.get("cuda"):
        rows.append(("CUDA context, NCCL, fragmentation", CUDA_ALLOWANCE, "allowance"))
    v = {name: value for name, value, _ in rows}
    transient = ("drafter activations", "backward working set", "chunked-loss buffers", "target-forward buffers",
                 "gathered target layers")
    static = sum(value for name, value in v.items() if name not in transient)
    peak = static + max(v["drafter activations"] + v["backward working set"] + v["chunked-loss buffers"],
                        v["target-forward buffers"] + v["gathered target layers"])
    return rows + [("peak per rank", peak, "static + max(activations + backward + loss, target forward)")]


# What a sharded target forward costs: assumed rates, not measured here
NVLINK, PCIE = 350e9, 20e9  # all-gather bus bandwidth, bytes/s: H100/H200 NVLink (NVSwitch), PCIe 4.0 x16 via host
FLOPS = 400e12              # bf16 dense matmul rate a target forward reaches (about 40% of an H100's peak)


def shard_traffic(target, run):
    """--shard_target: bytes each rank receives per target forward (every decoder layer gathered once: (R-1)/R of
    it), their time over NVLink and over PCIe, and the forward's compute time at the run's shape (2 x active decoder
    params x batch x max_len FLOPs: an MoE token runs through k of E experts) that the prefetch can hide them
    behind. Seconds."""
    R, tokens = run["world"], run["batch_size"] * run["max_len"]
    gathered = target["decoder_params"] * run["target_bytes"] * (R - 1) / R
    return gathered, gathered / NVLINK, gathered / PCIE, 2 * target["active_params"] * tokens / FLOPS


OPTIONS = ([], ["--zero"], ["--grad_checkpoint"], ["--zero", "--grad_checkpoint"])


def options(world):
    """The memory-flag sets to try, cheapest first. --shard_target comes after the others: it costs an all-gather
    of the decoder per target forward (hidden on NVLink, not on PCIe), and means nothing on one rank."""
    return OPTIONS + tuple(f + ["--shard_target"] for f in OPTIONS) if world > 1 else OPTIONS


def option_run(run, flags, anchors=None):
    return {**run, "zero": "--zero" in flags, "grad_checkpoint": "--grad_checkpoint" in flags,
            "shard_target": "--shard_target" in flags, "num_anchors": anchors or run["num_anchors"]}


def fitting_flags(target, drafter, run, gpu_bytes):
    """The fewest memory flags (then fewer anchors) with which the plan fits, or None."""
    anchors = [run["num_anchors"]] + [n for n in (256, 128, 64, 32) if n < run["num_anchors"]]
    for n in anchors:
        for flags in options(run["world"]):
            if plan_rows(target, drafter, option_run(run, flags, n))[-1][1] <= gpu_bytes:
                return flags + ([f"--num_anchors {n}"] if n != run["num_anchors"] else [])
    return None


LONG_LENGTHS = (4096, 16384, 32768, 65536, 131072, 262144)  # the --max_len values the plan also prices


def longest_fitting(target, drafter, run, gpu_bytes, top=1 << 22):
    """The longest --max_len whose plan fits (every term grows with it: the target's grad-free forward over max_len
    tokens, the captured features, the drafter's context keys/values and its attention), or 0; a binary search."""
    fits = lambda n: plan_rows(target, drafter, {**run, "max_len": n})[-1][1] <= gpu_bytes  # noqa: E731
    if not fits(2):
        return 0
    lo, hi = 2, top
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def length_line(target, drafter, run, gpu_bytes):
    """The peak at each of LONG_LENGTHS, and where the run stops fitting, for the run's flags and anchors."""
    peaks = "  ".join(f"{n // 1024}k {plan_rows(target, drafter, {**run, 'max_len': n})[-1][1] / GB:.1f}"
                      for n in LONG_LENGTHS)
    longest = longest_fitting(target, drafter, run, gpu_bytes)
    return (f"  by --max_len (GB, these flags, {run['num_anchors']} anchors): {peaks}; fits up to --max_len "
            f"{longest:,}" if longest else f"  by --max_len (GB, these flags): {peaks}; no length fits")


def format_plan(rows, world, gpu_bytes, where):
    lines = [f"memory plan per rank ({world} rank(s), {gpu_bytes / GB:.0f} GB each, {where}):"]
    lines += [f"  {name:<40} {v / GB:8.2f} GB  {note}" for name, v, note in rows]
    return "\n".join(lines)


def target_sizes(meta_target, context_layers):
    """Numbers of the text target from its meta-device model (a dflash Target: backbone, lm_head, model)."""
    tc = meta_target.model.config.get_text_config()
    V, D = meta_target.lm_head.weight.shape
    return {"params": count_params(meta_target.backbone, meta_target.lm_head), "hidden_size": D, "vocab_size": V,
            "intermediate_size": getattr(tc, "intermediate_size", None) or 4 * D, "context_layers": context_layers,
            "decoder_params": count_params(meta_target.layers), "io_params": count_params(meta_target.embed,
                                                                                           meta_target.lm_head), "active_params": active_params(meta_target),
            "layer_params": max(count_params(layer) for layer in meta_target.layers)}


def active_params(meta_target):
    """Decoder parameters one token runs through: all of them, less the routed experts it is not sent to (an MoE
    target: num_experts_per_tok of num_experts; the routed experts are the parameters under an `experts` module)."""
    tc = meta_target.model.config.get_text_config()
    E, k = getattr(tc, "num_experts", None), getattr(tc, "num_experts_per_tok", None)
    routed = sum(p.numel() for name, p in meta_target.layers.named_parameters() if ".experts." in f".{name}")
    return count_params(meta_target.layers) - (routed * (1 - k / E) if E and k else 0)


def drafter_sizes(cfg, shapes):
    """cfg: the drafter config as a dict (dataclasses.asdict); shapes: dflash.expected_shapes(cfg)."""
    kinds = [(t == "sliding_attention") for t in cfg["layer_types"]]
    dflash2 = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return {**{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "block_size")},
            **{k: cfg.get(k, 0) for k in dflash2},
            "params": sum(int(torch.Size(s).numel()) for s in shapes.values()), "layer_kinds": kinds,
            "context_layers": len(cfg["target_layer_ids"])}


def machine_bytes(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# what is left when no flag fits: the rows above say which term is too big
NOTHING_FITS = ("the target's bf16 weights (every rank holds a whole target) or the drafter's fp32 weights, grads and "
                "AdamW take the GPU; try more ranks with --zero, a smaller drafter (--num_draft_layers, "
                "--intermediate_size), --max_len 1024, or GPUs with more memory")

def memory_plan(args, cfg, shapes, meta_target, world, device):
    """Print the plan for the run's flags (rank 0), and the options that would fit; --plan: exit after.
    A CUDA run that cannot fit stops here with one error naming the flags that would. args: vars(args)."""
    on_gpu = device.type == "cuda" or args["plan_gpu_gb"] is not None
    world = args["plan_world_size"] or world
    gpu_bytes = args["plan_gpu_gb"] * GB if args["plan_gpu_gb"] is not None else machine_bytes(device)
    tb = {"bf16": 2, "fp16": 2, "fp32": 4}.get(args["dtype"], 2 if on_gpu else 4)
    attention = args["attention"] if args["attention"] != "auto" else "flex" if on_gpu else "dense"
    run = {"world": world, "zero": args["zero"], "grad_checkpoint": args["grad_checkpoint"],
           "shard_target": args["shard_target"], "features": bool(args.get("features")) and not args.get(
               "capture_missing"),
           "num_anchors": args["num_anchors"], "batch_size": args["batch_size"], "max_len": args["max_len"],
           "attention": attention, "target_bytes": tb, "act_bytes": 2 if on_gpu else 4, "cuda": on_gpu}
    d = drafter_sizes(cfg, shapes)
    t = target_sizes(meta_target, d["context_layers"])
    rows = plan_rows(t, d, run)
    where = "planned GPUs" if args["plan_gpu_gb"] is not None else str(device)
    rank0 = not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0
    say = print if rank0 else (lambda *a: None)
    say(format_plan(rows, world, gpu_bytes, where))
    for flags in options(world):
        peak = plan_rows(t, d, option_run(run, flags))[-1][1]
        say(f"  {' '.join(flags) or 'plain DDP':<40} {peak / GB:8.2f} GB  "
            f"{'fits' if peak <= gpu_bytes else 'does not fit'}")
    fit = fitting_flags(t, d, run, gpu_bytes)
    fits = rows[-1][1] <= gpu_bytes
    say(f"  verdict: {'fits' if fits else 'does not fit'}"
        + ("" if fits else f"; fits with {' '.join(fit)}" if fit else f"; nothing fits: {NOTHING_FITS}"))
    say(length_line(t, d, run, gpu_bytes))
    if world > 1 and (run["shard_target"] or "--shard_target" in (fit or []) and not fits):
        gathered, nvlink, pcie, compute = shard_traffic(t, run)
        say(f"  --shard_target: each target forward all-gathers {gathered / GB:.1f} GB per rank: {nvlink:.2f} s over "
            f"NVLink ({NVLINK / GB:.0f} GB/s), {pcie:.2f} s over PCIe ({PCIE / GB:.0f} GB/s), against {compute:.2f} s "
            f"of compute at {run['batch_size']} x {run['max_len']} tokens ({FLOPS / 1e12:.0f} TFLOP/s): "
            f"{'hidden by the prefetch' if nvlink < compute else 'not hidden'} on NVLink, "
            f"{'hidden' if pcie < compute else 'dominant'} on PCIe; the walk gathers once per generated token")
    sys.stdout.flush()
    if args["plan"]:
        raise SystemExit(0)
    if device.type == "cuda" and not fits:
        hint = f"add {' '.join(fit)}" if fit else f"even {' '.join(options(world)[-1])} --num_anchors 32 does " \
            f"not fit: {NOTHING_FITS}"
        raise dflash.DFlashError(f"the memory plan needs {rows[-1][1] / GB:.1f} GB per GPU, this device has "
                    f"{gpu_bytes / GB:.1f} GB: {hint} (or check with --plan)")
    return rows
