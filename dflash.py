"""
DFlash: train a block-diffusion speculative-decoding drafter against a frozen target LLM (arXiv 2602.06036).

Quick start
    python dflash.py                      # CPU demo: tiny hybrid target, train a drafter, measure tau (< 10 min)
    python dflash.py --target Qwen/Qwen3-8B --data train.jsonl --out runs/q3-8b --mask_token_id 151669 \
        --sliding_window 0                # one GPU
    torchrun --nproc_per_node=8 dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl --out runs/q36 \
        --mask_token_id 248070            # 8 GPUs (the z-lab Qwen3.6-27B-DFlash geometry by default)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 dflash.py ...
    torchrun --nproc_per_node=8 dflash.py ... --resume   # continue <out>/latest after an interruption
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000   # tau of a checkpoint

The method in ten lines
    The target runs as usual. The drafter proposes the next B-1 tokens in ONE forward pass: its input is a block
    [tok[a], M, M, ..., M] (the anchor token a, then B-1 mask tokens) embedded with the target's embedding, and
    its output at block offset i goes through the target's lm_head to predict the token at position a+i.
    It conditions on context features: the outputs h[t] of a few target layers t in target_layer_ids,
    concatenated and projected by fc + hidden_norm into one hidden vector per position, which every drafter
    layer sees as extra keys/values. Visibility: a block token sees the context positions j < a (the target has
    not yet computed the anchor's hidden state when drafting) and tokens of its own block (all of them, or
    only earlier ones in a causal layer); sliding layers also drop keys more than W positions away.
    Training draws many anchors per sequence and runs every block in one call. The loss is hard cross-entropy
    against the target's own greedy tokens, weighted w = exp(-(i-1)/gamma) at offset i (early offsets matter
    most: one wrong draft rejects the rest): loss = sum(w * CE) / sum(w) over the whole global batch.
"""

import argparse
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# Plumbing that is not the method (one-line errors, flag ranges, files that may be corrupt, atomic writes, SIGTERM,
# chat-template rendering, the config.json field reader) lives in dflash_tools/plumbing.py, input checks in checks.py.
from dflash_tools.checks import (LAYER_TYPES, check_config_fields, check_run_dir, layer_type_list,
                                 read_train_state_file, target_load_error, target_load_errors)
from dflash_tools.plumbing import (ArgumentParser, DFlashError, StopFlag, add_stats, all_reduce_sum, atomic_dir,
                                   chat_ids, chat_sample, check_ids, check_tensors, check_writable_dir, config_fields,
                                   int_list, latest_checkpoint, mix_seed, peak_memory_mb, pick_device, read_json,
                                   load_tokenizer, read_jsonl, read_safetensors, run_main, setup_distributed,
                                   show_data, split_eval, template_kwargs, write_latest, yarn_rope)
from dflash_tools.hub import resolve_drafter
from dflash_tools.walk import held_out_walk, walk_tau  # the exact walked tau, shared with eval.py
from dflash_tools.plan import add_plan_flags, checkpointed, make_optimizer, memory_plan, model_loader  # memory


# -----------------------------------------------------------------------------
# Drafter config: mirrors the z-lab config.json (a Qwen3 config plus the DFlash fields)

def default_target_layer_ids(num_target_layers, num_draft_layers):
    """Spread the context layers evenly from layer 1 to layer L-3: L=64, n=5 -> [1, 16, 31, 46, 61]."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]

def check_target_layer_ids(ids, num_target_layers):
    if not ids:
        raise DFlashError("target_layer_ids is empty; give at least one target layer")
    if list(ids) != sorted(set(ids)):
        raise DFlashError(f"target_layer_ids {list(ids)} must be strictly increasing without duplicates")
    if ids[0] < 0 or ids[-1] >= num_target_layers:
        raise DFlashError(f"target_layer_ids {list(ids)} out of range: the target has {num_target_layers} "
                          f"decoder layers (valid ids 0..{num_target_layers - 1})")

@dataclass
class DFlashConfig:
    hidden_size: int = 5120              # D, equal to the target's hidden size
    intermediate_size: int = 17408
    num_hidden_layers: int = 5           # n drafter layers
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 248320             # the target's vocabulary (embedding and lm_head are the target's)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    rope_scaling: dict | None = None     # None (plain RoPE over the full head_dim) or {"rope_type": "yarn", ...}
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    block_size: int = 16                 # B
    mask_token_id: int = 248070          # M
    target_layer_ids: list = field(default_factory=lambda: [1, 16, 31, 46, 61])  # T
    num_target_layers: int = 64          # L
    layer_types: list = field(default_factory=lambda: ["sliding_attention"] * 4 + ["full_attention"])
    sliding_window: int | None = 2048    # W
    is_causal: bool | None = None        # None: a layer is causal iff it is a sliding layer

    def __post_init__(self):  # every config, from config.json or from flags, passes through here
        def need(ok, msg):
            if not ok:
                raise DFlashError(msg)
        need(self.block_size >= 2, f"block_size must be >= 2 (one anchor token plus drafts), got {self.block_size}")
        need(len(self.layer_types) == self.num_hidden_layers, f"layer_types has {len(self.layer_types)} entries but "
             f"num_hidden_layers is {self.num_hidden_layers}; give one entry per drafter layer")
        bad = [t for t in self.layer_types if t not in ("full_attention", "sliding_attention")]
        need(not bad, f"unknown layer type {bad[:1]}; use full_attention or sliding_attention")
        need("sliding_attention" not in self.layer_types or bool(self.sliding_window),
             "layer_types has sliding_attention layers but sliding_window is not set")
        need(self.num_attention_heads % self.num_key_value_heads == 0, f"num_attention_heads "
             f"{self.num_attention_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}")
        need(0 <= self.mask_token_id < self.vocab_size, f"mask_token_id {self.mask_token_id} is outside the "
             f"vocabulary [0, {self.vocab_size}); pass --mask_token_id with an id the target's embedding has")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        need(rope_type in ("default", "yarn"), f"rope type {rope_type!r} is not supported (only default, yarn); "
             f"refusing to fall back silently to plain RoPE")

    def layer_kind(self, i):
        """(causal, window) of layer i: what its attention mask depends on."""
        sliding = self.layer_types[i] == "sliding_attention"
        causal = bool(self.is_causal) if self.is_causal is not None else sliding
        return causal, self.sliding_window if sliding else None

    def to_json(self):
        """The z-lab config.json layout: Qwen3-style fields plus the DFlash ones."""
        d = asdict(self)
        d["rope_parameters"] = {**(self.rope_scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta}
        if not self.rope_scaling:  # transformers-4 readers (z-lab's code) look for rope_scaling
            d.pop("rope_scaling")
        if self.is_causal is None:
            d.pop("is_causal")
        d["dflash_config"] = {"mask_token_id": d.pop("mask_token_id"), "target_layer_ids": d.pop("target_layer_ids")}
        return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
                "tie_word_embeddings": False, "use_sliding_window": "sliding_attention" in self.layer_types,
                "attention_dropout": 0.0, **d}

    @classmethod
    def from_json(cls, d, where="config.json"):
        """Read a z-lab or our config.json: values from dflash_config first, then the top level (config_fields reads
        them, with their legacy spellings); target_layer_ids missing: the default spread."""
        kw = check_config_fields(config_fields(d, where), where)
        kw["target_layer_ids"] = kw["target_layer_ids"] or default_target_layer_ids(kw["num_target_layers"],
                                                                                     kw["num_hidden_layers"])
        try:
            return cls(**kw)
        except TypeError as e:
            raise DFlashError(f"{where}: a field has the wrong type ({e})") from None

# -----------------------------------------------------------------------------
# Attention visibility, written once as a flex_attention mask_mod; the dense path evaluates the same function.
# Queries are N blocks of B tokens (query q_idx is offset i = q_idx % B of block n = q_idx // B, at position a+i);
# keys are [S context positions ; the N blocks of B tokens].

def make_mask_mod(anchors, anchor_valid, S, B, causal, window):
    """anchors, anchor_valid (b, N). A key is visible to block token i of the block anchored at a iff
    - it is a context position j < a (the target has no hidden state for the anchor itself yet at inference), or
      a token i' of the same block (any i' in a bidirectional layer, i' <= i in a causal one);
    - and, in a sliding layer, it lies within the window by position: q_pos - k_pos < W for every key (context and
      block alike, as vLLM and SGLang serve it), and also k_pos - q_pos < W when the sliding layer is bidirectional;
    - and the anchor is real (padding anchors see nothing)."""

    def mask_mod(b, h, q_idx, kv_idx):
        n, i = q_idx // B, q_idx % B
        a = anchors[b, n]
        is_ctx = kv_idx < S
        k_off = (kv_idx - S) % B                       # a block key's offset i': its position is a + i'
        ctx_ok = is_ctx & (kv_idx < a)
        blk_ok = ~is_ctx & ((kv_idx - S) // B == n)
        if causal:
            blk_ok = blk_ok & (k_off <= i)
        if window is not None:                         # q_pos - k_pos < W; for block keys that is i - i' < W
            ctx_ok = ctx_ok & (a + i - kv_idx < window)
            blk_ok = blk_ok & (i - k_off < window)
            if not causal:
                blk_ok = blk_ok & (k_off - i < window)
        return anchor_valid[b, n] & (ctx_ok | blk_ok)

    return mask_mod

def dense_masks(mask_mod, b, N, S, B, device):
    """The rule evaluated where the dense path computes scores: every block query against the S context keys,
    (b, N, B, S), and each block's queries against its own B keys, (b, N, B, B). Keys of other blocks are never
    visible, so nothing else is needed."""
    q_idx = torch.arange(N * B, device=device).view(N, B, 1)  # query n*B + i
    ctx_idx = torch.arange(S, device=device)                    # context key j
    own_idx = S + q_idx.view(N, 1, B)                           # block n's own keys: S + n*B + i'
    bi = torch.arange(b, device=device).view(b, 1, 1, 1)
    return mask_mod(bi, 0, q_idx, ctx_idx), mask_mod(bi, 0, q_idx, own_idx)

CONTEXT_TILE = 256  # context keys per group of blocks in the dense path (context_spans)

def context_spans(ctx_visible):
    """Split the N blocks into about S / CONTEXT_TILE groups of consecutive blocks, each with the span [lo, hi) of
    context keys its queries see: (n0, n1, lo, hi) per group. Anchors come sorted (sample_anchors, every anchor in
    eval), so a group of later blocks sees further, and its scores need only its own span: on a long context about
    half of one (N*B) x S product for full layers, the window's band for sliding ones. Exact in any order: a span
    covers every key its queries see. The spans are data (one host sync); a compiled graph keeps static shapes,
    so under torch.compile all blocks are one group over the whole context."""
    b, N, B, S = ctx_visible.shape
    G = min(N, S // CONTEXT_TILE)
    if G <= 1 or torch.compiler.is_compiling():
        return [(0, N, 0, S)]
    ends = [N * g // G for g in range(G + 1)]
    seen = torch.stack([ctx_visible[:, n0:n1].any((0, 1, 2)) for n0, n1 in zip(ends, ends[1:])])  # (G, S)
    lo = torch.where(seen.any(1), seen.int().argmax(1), 0)                       # first key seen (0 if none)
    hi = torch.where(seen.any(1), S - seen.flip(1).int().argmax(1), 0)           # one past the last
    return [(n0, n1, l, h) for n0, n1, l, h in zip(ends, ends[1:], lo.tolist(), hi.tolist())]


# flex_attention runs fused only when compiled (eager flex materialises the full score matrix), and it compiles
# one kernel per shape. So both are compiled once, here, outside any traced region, and every flex input is padded
# to padded_length(): training pads to padded_length(max_len) (one shape per run), eval.py to a power of two.
compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
compiled_create_block_mask = torch.compile(create_block_mask)

def padded_length(S):
    """The one padding rule for flex shapes: the next power of two, at least 128 (flex's tile size)."""
    return max(128, 1 << (S - 1).bit_length())

def build_masks(cfg, anchors, anchor_valid, S, attention):
    """One mask per distinct (causal, window) layer kind: a BlockMask ("flex"), or ("dense") dense_masks' pair and
    the context_spans of its groups of blocks."""
    b, N = anchors.shape
    B, masks = cfg.block_size, {}
    for kind in {cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}:
        mod = make_mask_mod(anchors, anchor_valid, S, B, *kind)
        if attention == "flex":
            make = compiled_create_block_mask if anchors.is_cuda else create_block_mask  # compiling on CPU: slow
            masks[kind] = make(mod, b, None, N * B, S + N * B, device=anchors.device)
        else:
            ctx_visible, own_visible = dense_masks(mod, b, N, S, B, anchors.device)
            masks[kind] = ctx_visible, own_visible, context_spans(ctx_visible)
    return masks


# -----------------------------------------------------------------------------
# The drafter: Qwen3 decoder layers whose keys/values also see the target's context features

class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in fp32 like Hugging Face's Qwen3RMSNorm."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

def rope_inv_freq(cfg):
    """RoPE over the full head_dim: inverse frequencies (head_dim/2,) and the cos/sin scale; yarn_rope if scaled."""
    if cfg.rope_scaling:
        return yarn_rope(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    return 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim), 1.0

def rope_cos_sin(inv_freq, scale, positions, dtype):
    """positions (...,) -> cos, sin (..., head_dim)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

def apply_rope(x, cos, sin):
    """x (..., T, heads, hd); cos/sin (..., T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(-2) + torch.cat([-x2, x1], dim=-1) * sin.unsqueeze(-2)

def two_part_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_visible, own_visible):
    """Each block's queries attend to [context ; own block]: one softmax over both, computed in two parts so that
    the context keys/values are shared by all blocks instead of copied per block. Exact: both parts use one max
    per query row m, and softmax = (sum_ctx e^(s-m) v + sum_own e^(s-m) v) / (sum_ctx e^(s-m) + sum_own e^(s-m)).
    q (b, N, B, h, hd); k_ctx, v_ctx (b, S, hk, hd); k_blk, v_blk (b, N, B, hk, hd); ctx_visible (b, N, B, S),
    own_visible (b, N, B, B) bool. Returns (b, N, B, h, hd); a row that sees nothing (a padding anchor) gives 0."""
    b, N, B, h, hd = q.shape
    S, hk = k_ctx.shape[1], k_ctx.shape[2]
    g = h // hk  # GQA: query head kk*g + gg reads kv head kk, so the g query heads of a kv head share its keys
    q = (q * hd ** -0.5).view(b, N, B, hk, g, hd).permute(0, 3, 4, 1, 2, 5)            # (b, hk, g, N, B, hd)
    # 1. all N*B block queries against the S context keys at once: (b, hk, g*N*B, S), a view (b, hk, g, N, B, S)
    s_ctx = (q.reshape(b, hk, g * N * B, hd) @ k_ctx.permute(0, 2, 3, 1)).view(b, hk, g, N, B, S)
    s_ctx = torch.where(ctx_visible[:, None, None], s_ctx, float("-inf"))
    # 2. each block's queries against its own B keys: (b, hk, g, N, B, B)
    s_own = q @ k_blk.permute(0, 3, 1, 4, 2)[:, :, None]                                 # keys (b, hk, 1, N, hd, B)
    s_own = torch.where(own_visible[:, None, None], s_own, float("-inf"))
    # the shift m only keeps exp() in range (the result does not depend on it): no gradient through it. A row that
    # sees nothing has m = -inf; shifting by 0 instead gives it all-zero weights and, below, a zero output.
    m = s_own.detach().amax(-1)
    if S:  # S = 0 when inference drafts at position 0: no context yet
        m = torch.maximum(m, s_ctx.detach().amax(-1))
    m = m.nan_to_num(neginf=0.0)[..., None]                                             # (b, hk, g, N, B, 1)
    p_ctx, p_own = s_ctx.sub_(m).exp_(), s_own.sub_(m).exp_()  # in place: one buffer of scores per part
    denom = p_ctx.sum(-1, keepdim=True) + p_own.sum(-1, keepdim=True)  # (b, hk, g, N, B, 1); >= 1 if a key is seen
    out = (p_ctx.view(b, hk, g * N * B, S) @ v_ctx.transpose(1, 2)).view(b, hk, g, N, B, hd)
    out = out + p_own @ v_blk.permute(0, 3, 1, 2, 4)[:, :, None]                         # values (b, hk, 1, N, B, hd)
    out = out / denom.clamp(min=torch.finfo(denom.dtype).tiny)                         # padding rows: 0 / tiny
    return out.permute(0, 3, 4, 1, 2, 5).reshape(b, N, B, h, hd)

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.hk, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.h * self.hd, bias=bias)
        self.k_proj = nn.Linear(D, self.hk * self.hd, bias=bias)
        self.v_proj = nn.Linear(D, self.hk * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.h * self.hd, D, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """x (..., T, D) -> k, v (..., T, hk, hd)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.hk, self.hd)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.hk, self.hd))

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        """x (b, N, B, D) normed block hidden states; k_ctx/v_ctx (b, S, hk, hd) context keys/values;
        mask: a BlockMask (flex) or build_masks' (ctx_visible, own_visible, spans) (dense)."""
        b, N, B, _ = x.shape
        h, hk, hd = self.h, self.hk, self.hd
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (h, hd))), cos, sin)  # (b, N, B, h, hd)
        k_blk, v_blk = self.keys_values(x, cos, sin)                                  # (b, N, B, hk, hd)
        # the fp32 norm weights promote q and k under autocast while v stays bf16: one dtype for the kernel
        q, k_blk, k_ctx, v_ctx = (t.to(v_blk.dtype) for t in (q, k_blk, k_ctx, v_ctx))
        if isinstance(mask, BlockMask):
            # all blocks as one query sequence against [context ; all blocks]; the BlockMask skips the rest
            q = q.reshape(b, N * B, h, hd).transpose(1, 2)
            k = torch.cat([k_ctx, k_blk.reshape(b, N * B, hk, hd)], 1).transpose(1, 2)
            v = torch.cat([v_ctx, v_blk.reshape(b, N * B, hk, hd)], 1).transpose(1, 2)
            out = compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=True)  # (b, h, N*B, hd)
            out = out.transpose(1, 2).reshape(b, N, B, h * hd)
        else:
            # each group of blocks against its span of the context (context_spans) and its own keys
            ctx_visible, own_visible, spans = mask
            out = torch.cat([two_part_attention(q[:, n0:n1], k_ctx[:, lo:hi], v_ctx[:, lo:hi], k_blk[:, n0:n1],
                                                v_blk[:, n0:n1], ctx_visible[:, n0:n1, :, lo:hi], own_visible[:, n0:n1])
                             for n0, n1, lo, hi in spans], 1).reshape(b, N, B, h * hd)
        return self.o_proj(out)

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class DecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

class DFlashDrafter(nn.Module):
    """Holds no embedding and no lm_head: both are the target's (frozen, passed in by the caller).
    attention: "flex" (block-sparse, CUDA) or "dense" (two_part_attention: [context ; own block]; anywhere, also
    backward on CPU where flex has none). Chosen once, here; it is not part of the checkpoint."""

    def __init__(self, cfg, attention="dense"):
        super().__init__()
        self.cfg, self.attention, self.grad_checkpoint = cfg, attention, False
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def context_kv(self, context_features, start=0):
        """(b, S, m*D) concatenated target features h[t] -> ctx = hidden_norm(fc(.)), the same for every layer,
        -> per-layer context keys/values (k_norm + RoPE at positions start..start+S-1)."""
        ctx = self.hidden_norm(self.fc(context_features))
        pos = torch.arange(start, start + ctx.shape[1], device=ctx.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, context_features, block_embeds, anchors, anchor_valid):
        """Training-mode forward: every block of every sequence in one call.
        context_features (b, S, m*D); block_embeds (b, N, B, D) = embed([tok[a], M, ..., M]);
        anchors (b, N) long; anchor_valid (b, N) bool. Returns final-normed hidden states (b, N, B, D)."""
        kv = self.context_kv(context_features)
        return self.blocks(block_embeds, anchors, anchor_valid, kv, context_features.shape[1])

    def blocks(self, x, anchors, anchor_valid, kv, S):
        """The decoder layers over the blocks, given per-layer context keys/values for S positions."""
        pos = anchors[..., None] + torch.arange(self.cfg.block_size, device=anchors.device)  # (b, N, B): a+i
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, x.dtype)
        masks = build_masks(self.cfg, anchors, anchor_valid, S, self.attention)
        for i, layer in enumerate(self.layers):  # --grad_checkpoint: keep each layer's inputs, recompute the rest
            a = (x, cos, sin, *kv[i], masks[self.cfg.layer_kind(i)])
            x = checkpointed(layer, *a) if self.grad_checkpoint and self.training else layer(*a)
        return self.norm(x)


# -----------------------------------------------------------------------------
# Checkpoints: a drafter directory in the z-lab layout (config.json + model.safetensors, no "model." prefix)

def expected_shapes(cfg):
    D, hd, h, hk, I = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    shapes = {"fc.weight": (D, len(cfg.target_layer_ids) * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (h * hd, D), p + "self_attn.k_proj.weight": (hk * hd, D),
                       p + "self_attn.v_proj.weight": (hk * hd, D), p + "self_attn.o_proj.weight": (D, h * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, D), p + "mlp.up_proj.weight": (I, D),
                       p + "mlp.down_proj.weight": (D, I)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (h * hd,), p + "self_attn.k_proj.bias": (hk * hd,),
                           p + "self_attn.v_proj.bias": (hk * hd,), p + "self_attn.o_proj.bias": (D,)})
    return shapes

def read_drafter_config(path):
    if not os.path.isdir(path):
        raise DFlashError(f"drafter directory {path!r} does not exist (expected config.json + model.safetensors)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise DFlashError(f"{path!r} has no config.json; is it a DFlash drafter directory?")
    d = read_json(cfg_path, "drafter config")
    if not isinstance(d, dict):
        raise DFlashError(f"{cfg_path}: expected a JSON object")
    return DFlashConfig.from_json(d, where=cfg_path)

def load_drafter(path, device="cpu", dtype=torch.float32, attention="dense"):
    """Load a z-lab or our drafter directory strictly: every tensor present with its exact shape."""
    cfg = read_drafter_config(path)
    tensors, expected = read_safetensors(path), expected_shapes(cfg)
    fc_why = f"len(target_layer_ids) * hidden_size = {len(cfg.target_layer_ids)} * {cfg.hidden_size}"
    check_tensors(tensors, expected, path, {"fc.weight": fc_why})
    with torch.device("meta"):  # no random init of weights about to be overwritten (1.7B for Qwen3.6-27B)
        drafter = DFlashDrafter(cfg, attention)
    drafter.load_state_dict(tensors, strict=True, assign=True)
    drafter.inv_freq = rope_inv_freq(cfg)[0]  # the non-persistent RoPE buffer, rebuilt off the meta device
    return drafter.to(device=device, dtype=dtype)

def save_drafter(drafter, path, dtype=torch.bfloat16, extra_files=None):
    """Write config.json + model.safetensors (bf16 or fp32) and any {name: torch object} extra files, atomically."""
    from safetensors.torch import save_file
    with atomic_dir(path) as tmp:
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**drafter.cfg.to_json(), "torch_dtype": str(dtype).removeprefix("torch.")}, f, indent=2)
        for name, obj in (extra_files or {}).items():
            torch.save(obj, os.path.join(tmp, name))
    return path


# -----------------------------------------------------------------------------
# The target: frozen, loaded through AutoModelForCausalLM; forward hooks capture h[t] and the final hidden state f

@dataclass
class Target:
    model: nn.Module        # the full HF model (generation, eval)
    backbone: nn.Module     # the decoder stack without lm_head (what training runs)
    embed: nn.Module
    lm_head: nn.Module
    tokenizer: object
    name: str

    def __post_init__(self):  # layers; the final norm, whose output f feeds lm_head; sizes
        self.layers, self.norm = self.backbone.layers, getattr(self.backbone, "norm", None)
        self.num_layers, (self.vocab_size, self.hidden_size) = len(self.layers), self.lm_head.weight.shape

    def eos_ids(self):
        """The token ids that end a generation (the generation_config's eos_token_id, an int or a list), as a set."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}

def find_decoder(model):
    """The text decoder stack, found by inspection rather than by model name: the module holding `layers` (a
    ModuleList), a final `norm` and the input embedding. Qwen3/Llama/Qwen3.5 text: model.model; the Qwen3.5/3.6
    multimodal class: model.model.language_model."""
    embed = model.get_input_embeddings()
    for _, m in model.named_modules():
        if (isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module)
                and any(c is embed for c in m.children())):
            return m
    raise DFlashError(f"cannot find the decoder layers of {type(model).__name__}: no submodule holds `layers`, "
                      f"`norm` and the input embedding")

def load_target(name, device="cpu", dtype=None, trust_remote_code=False):
    """A local path or hub id; frozen, in eval mode; bf16 on CUDA and fp32 on CPU unless dtype says otherwise."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if (name.startswith((".", "/", "~")) or os.path.exists(name)) and not os.path.isfile(f"{name}/config.json"):
        raise DFlashError(f"target {name!r} is not a model directory (no config.json); give a local path or a hub id")
    try:
        model = model_loader(device)(name, dtype=dtype, trust_remote_code=trust_remote_code)  # meta: config only
    except target_load_errors() as e:  # a missing, corrupt (truncated, garbage) or unsupported target
        raise target_load_error(name, e) from None
    model.to(device).eval().requires_grad_(False)
    tokenizer = load_tokenizer(name, trust_remote_code)  # None: pre-tokenized data only
    if model.get_output_embeddings() is None:
        raise DFlashError(f"target {name!r} has no lm_head (get_output_embeddings() is None)")
    return Target(model, find_decoder(model), model.get_input_embeddings(), model.get_output_embeddings(),
                  tokenizer, name)

def check_compatible(cfg, target, where="drafter"):
    """A drafter made for another target must fail loudly, not draft garbage."""
    for what, ours, theirs in (("hidden size", cfg.hidden_size, target.hidden_size),
                               ("vocab", cfg.vocab_size, target.vocab_size),
                               ("num_target_layers", cfg.num_target_layers, target.num_layers)):
        if ours != theirs:
            raise DFlashError(f"{where} {what} {ours} != the target's {theirs}; the drafter was made for another "
                              f"target")
    check_target_layer_ids(cfg.target_layer_ids, target.num_layers)

@contextmanager
def capture_hidden(target, layer_ids):
    """Forward hooks on decoder layers `layer_ids` (their outputs h[t]) and on the final norm (its output f, what
    feeds lm_head). Yields {t: h[t], "final": f}; the hooks are removed on exit so the target generates as usual."""
    store = {}
    hook = lambda key: lambda m, i, out: store.__setitem__(key, out[0] if isinstance(out, tuple) else out)  # noqa
    handles = [target.layers[t].register_forward_hook(hook(t)) for t in layer_ids]
    handles.append(target.backbone.norm.register_forward_hook(hook("final")))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()

@torch.no_grad()
def target_features(target, input_ids, layer_ids):
    """One pass of the target's decoder stack (no lm_head, no all-hidden-states) -> context (b, S, m*D) =
    concat_t h[t], and f (b, S, D). Right padding needs no attention mask: pads only follow real tokens."""
    with capture_hidden(target, layer_ids) as store:
        target.backbone(input_ids=input_ids, use_cache=False)
    return torch.cat([store[t] for t in layer_ids], dim=-1), store["final"]

def vocab_chunk(vocab_size, budget=2**27):
    """Rows per chunk so one chunk of logits holds about `budget` floats (0.5 GB in fp32): the [tokens, V]
    logits never exist at once (V = 248320 for Qwen3.5/3.6)."""
    return max(1, budget // vocab_size)

@torch.no_grad()
def greedy_labels(final, lm_head, chunk=None):
    """y[j] = argmax lm_head(f[j-1]): the target's greedy token at j, exactly what greedy verification accepts.
    final (b, S, D) -> (b, S) long; y[0] = -1 (never a label)."""
    b, S, D = final.shape
    f = final[:, :-1].reshape(-1, D)
    chunk = chunk or vocab_chunk(lm_head.weight.shape[0])
    out = torch.cat([lm_head(f[s:s + chunk]).argmax(-1) for s in range(0, f.shape[0], chunk)])
    return torch.cat([out.new_full((b, 1), -1), out.view(b, S - 1)], dim=1)


# -----------------------------------------------------------------------------
# Data: JSONL -> (input_ids, loss_mask) per sample; one sample per row (HF targets do not separate packed samples)

def encode_sample(record, tokenizer, enable_thinking=None, eos_ids=(), where="sample", vocab_size=None):
    """One JSONL record -> (input_ids, loss_mask); loss_mask is 1 on the tokens the drafter learns to predict.
    Formats: {"messages": [...]} (loss on the assistant turns), {"prompt", "response"}, {"text"} (loss everywhere),
    {"input_ids", "loss_mask"?} (pre-tokenized; ids checked against vocab_size when given). Chat data is rendered
    as at inference (enable_thinking passed as eval.py passes it); a turn ends at the tokenizer's eos or any of
    eos_ids (e.g. the target's generation_config.eos_token_id). The stable entry point for every format."""
    if not isinstance(record, dict):
        raise DFlashError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "input_ids" in record:
        ids = check_ids(record["input_ids"], vocab_size, where)
        mask = record.get("loss_mask", [1] * len(ids))
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise DFlashError(f"{where}: loss_mask must be a list as long as input_ids ({len(ids)})")
        return ids, [int(bool(m)) for m in mask]
    if tokenizer is None and any(k in record for k in ("messages", "prompt", "text")):
        raise DFlashError(f"{where}: the target has no tokenizer; use pre-tokenized {{\"input_ids\": [...]}} lines")
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise DFlashError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
        if not tokenizer.chat_template:
            raise DFlashError(f"{where}: messages need a chat template, and the target's tokenizer has none")
        eos = {*eos_ids, tokenizer.eos_token_id} - {None}
        return chat_sample(messages, tokenizer, template_kwargs(tokenizer, enable_thinking), eos, where)
    if "prompt" in record and "response" in record:
        if tokenizer.chat_template:
            return encode_sample({"messages": [{"role": "user", "content": record["prompt"]},
                                               {"role": "assistant", "content": record["response"]}]},
                                 tokenizer, enable_thinking, eos_ids, where)
        p, r = encode(record["prompt"]), encode(record["response"])
        return p + r, [0] * len(p) + [1] * len(r)
    if "text" in record:
        ids = encode(record["text"])
        return ids, [1] * len(ids)
    raise DFlashError(f"{where}: none of the known fields (messages | prompt+response | text | input_ids); "
                      f"got keys {sorted(record)}")

def load_samples(path, tokenizer, max_len, log=print, enable_thinking=None, eos_ids=(), vocab_size=None):
    """Read a JSONL file through encode_sample; truncate to max_len; skip (and count) samples with nothing to learn."""
    samples, skipped, lines = [], 0, 0
    for where, rec in read_jsonl(path, "data", "; pass --data with a JSONL file"):
        lines += 1
        ids, mask = encode_sample(rec, tokenizer, enable_thinking, eos_ids, where, vocab_size)
        ids, mask = check_ids(ids[:max_len], vocab_size, where), mask[:max_len]  # tokenizer output too
        if any(mask[j] and mask[j + 1] for j in range(len(ids) - 1)):  # at least one anchor (see sample_anchors)
            samples.append((ids, mask))
        else:
            skipped += 1
    if not lines:
        raise DFlashError(f"data file {path!r} is empty; it needs one JSON object per line")
    if not samples:
        raise DFlashError(f"{path}: no usable samples ({skipped} skipped: fewer than 2 tokens or no two consecutive "
                          f"response tokens); check the file and the loss_mask")
    if skipped:
        log(f"{path}: skipped {skipped} samples with fewer than 2 response tokens, kept {len(samples)}")
    return samples

def collate(samples, pad_id, keys=None):
    """Right-pad to the longest sample: the target runs at the batch's natural length (right padding never changes a
    causal target's real positions). keys: one random key per sample for its anchors and noise."""
    S = max(len(ids) for ids, _ in samples)
    input_ids = torch.full((len(samples), S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), S, dtype=torch.long)
    for r, (ids, mask) in enumerate(samples):
        input_ids[r, :len(ids)], loss_mask[r, :len(mask)] = torch.tensor(ids), torch.tensor(mask)
    keys = keys if keys is not None else list(range(len(samples)))
    return {"input_ids": input_ids, "loss_mask": loss_mask, "keys": keys, "tokens": sum(len(i) for i, _ in samples)}

class Batches:
    """Epoch-shuffled global batches of batch_size * grad_accum * world samples; micro-step m of rank r takes its
    own slice. Deterministic for a given seed, so the data position is just the step number."""

    def __init__(self, samples, batch_size, grad_accum, rank, world, seed, pad_id):
        self.samples, self.bs, self.accum, self.rank, self.world = samples, batch_size, grad_accum, rank, world
        self.seed, self.pad_id = seed, pad_id
        self.global_batch = batch_size * grad_accum * world
        self.steps_per_epoch = len(samples) // self.global_batch
        if self.steps_per_epoch == 0:
            raise DFlashError(f"{len(samples)} training samples are fewer than one global batch "
                              f"({batch_size} x grad_accum {grad_accum} x {world} ranks); lower --batch_size")
        self._order = (None, None)

    def get(self, step, micro):
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.samples), generator=g).tolist())
        start = k * self.global_batch + (micro * self.world + self.rank) * self.bs
        idx = self._order[1][start:start + self.bs]
        return collate([self.samples[i] for i in idx], self.pad_id, [mix_seed(self.seed, epoch, i) for i in idx])


# -----------------------------------------------------------------------------
# Anchors, labels, context noise, and the corrected loss

def sample_anchors(loss_mask, num_anchors, generator):
    """loss_mask (S,) -> anchors (num_anchors,) long, valid (num_anchors,) bool. Candidates are positions with
    loss_mask[a] = loss_mask[a+1] = 1 (the anchor and at least its first draft are response tokens), drawn uniformly
    without replacement, fresh every step; padded to a fixed count (fixed shapes for torch.compile)."""
    cand = ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(1)
    pick = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
    anchors, valid = torch.zeros(num_anchors, dtype=torch.long), torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:len(pick)], valid[:len(pick)] = pick, True
    return anchors, valid

def batch_anchors(batch, num_anchors, salt=0):
    """Anchors (b, N) and valid (b, N) for every row, each from a generator keyed by the sample (and a salt)."""
    rows = [sample_anchors(m, num_anchors, torch.Generator().manual_seed(mix_seed(k, salt)))
            for m, k in zip(batch["loss_mask"], batch["keys"])]
    return torch.stack([a for a, _ in rows]), torch.stack([v for _, v in rows])

def block_positions(anchors, B):
    return anchors[..., None] + torch.arange(B, device=anchors.device)  # (b, N, B): offset i sits at a+i

def loss_weights(anchors, anchor_valid, loss_mask, B, gamma):
    """w[b, n, i] = exp(-(i-1)/gamma) * valid for i = 1..B-1, 0 at offset 0 (the anchor is given, not drafted);
    valid: a+i inside the sequence, loss_mask[a+i] = 1, and a real (not padding) anchor."""
    S = loss_mask.shape[1]
    pos = block_positions(anchors, B)
    in_mask = loss_mask.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos) > 0
    i = torch.arange(B, device=anchors.device, dtype=torch.float32)
    decay = torch.where(i > 0, torch.exp(-(i - 1) / gamma), 0.0)
    return decay * ((pos < S) & in_mask & anchor_valid[..., None])

def block_labels(labels_all, anchors, B):
    """labels_all (b, S) -> (b, N, B): the label of offset i is labels_all[a+i] (clamped past the end, weight 0)."""
    pos = block_positions(anchors, B).clamp(max=labels_all.shape[1] - 1)
    return labels_all.gather(1, pos.flatten(1)).view_as(pos)

def block_input_ids(input_ids, anchors, B, mask_token_id):
    """[tok[a], M, M, ..., M] for every anchor: (b, N, B)."""
    ids = torch.full((*anchors.shape, B), mask_token_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids

def add_context_noise(context, noise_std, num_context_layers, keys):
    """Gaussian noise relative to the RMS of each context feature vector h[t][j], on the concatenated context
    features only (a new tensor: f, the labels and the block embeddings are never touched). One generator per row."""
    if noise_std == 0:
        return context
    x = context.float().unflatten(-1, (num_context_layers, -1))                   # (b, S, m, D)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.stack([torch.randn(x.shape[1:], device=x.device, generator=torch.Generator(x.device).manual_seed(
        mix_seed(k, 7))) for k in keys])
    return (x + noise_std * rms * noise).flatten(-2).to(context.dtype)

class ChunkedLMHeadCE(torch.autograd.Function):
    """Per-token cross-entropy and argmax of lm_head(h) without [T, V] logits: rows are processed in chunks and the
    gradient w.r.t. h ((softmax - onehot) @ W; the lm_head is frozen) is formed in the same pass, so only (T, D) is
    kept for backward."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk):
        T = h.shape[0]
        ce = torch.empty(T, dtype=torch.float32, device=h.device)
        pred = torch.empty(T, dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for s in range(0, T, chunk):
            hs, ys = h[s:s + chunk].to(weight.dtype), labels[s:s + chunk]
            logits = F.linear(hs, weight, bias).float()                          # (chunk, V)
            lse = logits.logsumexp(-1)
            ce[s:s + chunk] = lse - logits.gather(1, ys[:, None]).squeeze(1)
            pred[s:s + chunk] = logits.argmax(-1)
            if grad is not None:
                p = logits.sub_(lse[:, None]).exp_()  # in place: one (chunk, V) buffer, not three
                p[torch.arange(len(ys), device=h.device), ys] -= 1.0
                grad[s:s + chunk] = (p.to(weight.dtype) @ weight).to(h.dtype)
                del p
            del logits  # free this chunk's (chunk, V) buffer before the next one is allocated
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_ce[:, None].to(grad.dtype), None, None, None, None

def weighted_ce(hidden, lm_head, labels, weights, chunk=None):
    """sum(w * CE) of the block tokens through the frozen lm_head, and the metrics of the same pass.
    hidden (b, N, B, D), labels/weights (b, N, B). stats holds sums to all-reduce: w, ce_w, correct[i] / count[i]
    per offset, accepted (sum of leading runs of correct drafts: what greedy verification accepts), blocks."""
    w = weights.flatten()
    sel = (w > 0).nonzero().squeeze(1)  # only the tokens that count, not padding anchors
    ce, pred = ChunkedLMHeadCE.apply(hidden.reshape(-1, hidden.shape[-1])[sel], lm_head.weight, lm_head.bias,
                                     labels.flatten()[sel].clamp(min=0), chunk or vocab_chunk(lm_head.weight.shape[0]))
    ce_w = (ce * w[sel]).sum()
    valid = weights > 0
    correct = torch.zeros(valid.numel(), dtype=torch.bool, device=hidden.device)
    correct[sel] = pred == labels.flatten()[sel]
    correct = correct.view_as(valid) & valid
    blocks = valid[..., 1]  # a block counts if its first draft position is valid
    accepted = torch.cumprod(correct[..., 1:].long(), dim=-1).sum(-1)
    return ce_w, {"w": weights.sum().detach(), "ce_w": ce_w.detach(), "correct": correct.sum((0, 1)).float(),
                  "count": valid.sum((0, 1)).float(), "accepted": (accepted * blocks).sum().float(),
                  "blocks": blocks.sum().float()}

def dflash_loss(drafter, target, batch, anchors, anchor_valid, gamma=4.0, noise_std=0.0, labels="target",
                weight_total=None, pad_to=None):
    """The corrected DFlash loss of one batch: target pass -> labels -> drafter over every block -> weighted CE.

    drafter: the DFlashDrafter, or its compiled / DDP wrapper. anchors, anchor_valid (b, N) from batch_anchors.
    labels: "target" (the target's greedy token at a+i: what verification accepts) or "data" (the data token, for
    data the target regenerated). noise_std: context-feature noise (0 in evaluation). Returns (loss, stats) with
    loss = sum(w * CE) / weight_total, weight_total defaulting to this batch's sum(w); training passes the sum over
    the whole global batch, so the split over ranks and micro-steps cannot dilute or reweight the loss. stats holds
    numerators and denominators to all-reduce (see summarize)."""
    raw = getattr(drafter, "module", drafter)           # DDP wrapper -> its module
    cfg = getattr(raw, "_orig_mod", raw).cfg            # torch.compile wrapper -> the drafter
    dev, B = target.lm_head.weight.device, cfg.block_size
    input_ids, loss_mask = batch["input_ids"].to(dev), batch["loss_mask"].to(dev)
    anchors, anchor_valid = anchors.to(dev), anchor_valid.to(dev)
    context, final = target_features(target, input_ids, cfg.target_layer_ids)  # (b, S, m*D), (b, S, D)
    y = block_labels(greedy_labels(final, target.lm_head) if labels == "target" else input_ids, anchors, B)
    w = loss_weights(anchors, anchor_valid, loss_mask, B, gamma)               # (b, N, B)
    with torch.no_grad():
        x = target.embed(block_input_ids(input_ids, anchors, B, cfg.mask_token_id))
    context = add_context_noise(context, noise_std, len(cfg.target_layer_ids), batch["keys"])  # never on f or y
    if pad_to and pad_to > context.shape[1]:  # fixed drafter shapes for compiled kernels (padding is never visible)
        context = F.pad(context, (0, 0, 0, pad_to - context.shape[1]))
    with torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext():
        hidden = drafter(context, x, anchors, anchor_valid)                    # (b, N, B, D)
    ce_w, stats = weighted_ce(hidden, target.lm_head, y, w)
    return ce_w / (w.sum() if weight_total is None else weight_total).clamp(min=1e-9), stats

STAT_KEYS = ("w", "ce_w", "correct", "count", "accepted", "blocks")  # what weighted_ce sums; see summarize


def summarize(stats):
    """Global metrics from summed numerators and denominators (exact, not a mean of means)."""
    acc = (stats["correct"] / stats["count"].clamp(min=1)).tolist()
    return {"loss": (stats["ce_w"] / stats["w"].clamp(min=1e-9)).item(),
            "tau": 1.0 + (stats["accepted"] / stats["blocks"].clamp(min=1)).item(), "acc": acc[1:]}


# -----------------------------------------------------------------------------
# Training

def lr_at(step, total_steps, lr, warmup_ratio):
    """Linear warmup over warmup_ratio of the run, then cosine decay to 0. A pure function of the step."""
    warmup = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

def new_drafter_config(target, num_draft_layers=5, block_size=16, mask_token_id=None, target_layer_ids=None,
                       sliding_window=2048, layer_types=None, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=None):
    """A new drafter shaped like z-lab's: hidden/intermediate/vocab/eps/rope_theta from the target, plain RoPE over
    the full head, n-1 causal sliding layers + 1 full bidirectional layer unless layer_types says otherwise."""
    tc = target.model.config.get_text_config()
    rope = getattr(tc, "rope_parameters", None)
    rope_theta = (rope or {}).get("rope_theta", getattr(tc, "rope_theta", 1e4)) if isinstance(rope, dict | None) \
        else 1e4
    n = num_draft_layers
    if mask_token_id is None:
        mask_token_id = getattr(target.tokenizer, "mask_token_id", None)
    if mask_token_id is None:
        raise DFlashError("no mask token: the target's tokenizer defines none; pass --mask_token_id "
                          "(248070 for Qwen3.5/3.6, 151669 for Qwen3)")
    if layer_types:
        layer_types = [LAYER_TYPES.get(t, t) for t in layer_types]  # sliding|full, or the config names
    else:
        layer_types = ["sliding_attention" if sliding_window and i < n - 1 else "full_attention" for i in range(n)]
    ids = target_layer_ids or default_target_layer_ids(target.num_layers, n)
    if not target_layer_ids and len(set(ids)) < len(ids):
        raise DFlashError(f"the default target_layer_ids {ids} for a {target.num_layers}-layer target and {n} drafter "
                          f"layers repeat a layer; pass --target_layer_ids explicitly")
    check_target_layer_ids(ids, target.num_layers)
    return DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
        num_hidden_layers=n, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
        vocab_size=target.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768), block_size=block_size,
        mask_token_id=mask_token_id, target_layer_ids=list(ids), num_target_layers=target.num_layers,
        layer_types=layer_types, sliding_window=sliding_window or None)

def train_step(model, target, cfg, micro_batches, num_anchors, world, **loss_kw):
    """Forward and backward over one optimizer step's micro-batches; returns the step's stats summed over ranks.
    The anchors (hence the loss weights) are drawn before any forward, so every micro-step's loss is normalised by
    the sum of weights over the whole global batch: sum(w * CE) / sum(w), whatever the split."""
    device = target.lm_head.weight.device
    anchors = [batch_anchors(mb, num_anchors) for mb in micro_batches]
    w_total = sum(loss_weights(a, v, mb["loss_mask"], cfg.block_size, loss_kw["gamma"]).sum()
                  for mb, (a, v) in zip(micro_batches, anchors)).to(device)
    w_total = all_reduce_sum({"w": w_total}, world)["w"] / world  # DDP averages gradients over ranks: undo it
    total = None
    for m, (mb, (a, v)) in enumerate(zip(micro_batches, anchors)):
        # no gradient all-reduce until the last micro-step, around forward *and* backward
        sync = model.no_sync() if world > 1 and m < len(micro_batches) - 1 else nullcontext()
        with sync:
            loss, stats = dflash_loss(model, target, mb, a, v, weight_total=w_total, **loss_kw)
            loss.backward()
        total = add_stats(total, {**stats, "tokens": torch.tensor(float(mb["tokens"]), device=device)})
    return all_reduce_sum(total, world)

@torch.no_grad()
def evaluate(drafter, target, samples, batch_size, num_anchors, pad_id, seed, rank, world, **loss_kw):
    """Held-out loss and tau estimate on every rank (its shard), combined by summing numerators/denominators.
    Anchors are keyed by the sample's index in the eval set: the same blocks whatever the number of ranks."""
    total, mine = None, list(range(rank, len(samples), world))
    for s in range(0, len(mine), batch_size):
        idx = mine[s:s + batch_size]
        fill = batch_size - len(idx)  # the last batch gets empty rows (no anchor is valid): one shape to compile
        batch = collate([samples[i] for i in idx] + [([pad_id], [0])] * fill, pad_id,
                        keys=[mix_seed(seed, i) for i in idx] + [0] * fill)
        anchors, valid = batch_anchors(batch, num_anchors, salt=12345)
        total = add_stats(total, dflash_loss(drafter, target, batch, anchors, valid, **{**loss_kw, "noise_std": 0})[1])
    if total is None:  # a rank without eval samples still joins the all-reduce, with zeros
        z, B = torch.zeros((), device=target.lm_head.weight.device), drafter.cfg.block_size
        total = {k: z.new_zeros(B if k in ("correct", "count") else ()) for k in STAT_KEYS}
    return summarize(all_reduce_sum(total, world))

def save_checkpoint(out, step, drafter, optimizer, save_dtype, state):
    """<out>/step_<n>/ = a drafter directory (z-lab layout) + train_state.pt, written atomically; then <out>/latest
    is switched to it (atomically too), so latest never names a partial checkpoint."""
    path = save_drafter(drafter, os.path.join(out, f"step_{step}"), save_dtype, extra_files={
        "train_state.pt": {"step": step, "optimizer": optimizer.state_dict(), **state}})
    write_latest(out, os.path.basename(path))
    return path

def read_train_state(resume_dir, cfg, global_batch):
    """The training state of a checkpoint to resume, checked against this run."""
    saved = read_drafter_config(resume_dir)
    for k, v in asdict(cfg).items():
        if getattr(saved, k) != v:
            raise DFlashError(f"cannot resume {resume_dir}: it was made for {k}={getattr(saved, k)}, this run has "
                              f"{getattr(cfg, k)}; use the original target and flags, or a new --out")
    state = read_train_state_file(resume_dir)
    if state["global_batch"] != global_batch:
        raise DFlashError(f"cannot resume {resume_dir}: global batch was {state['global_batch']}, now "
                          f"{global_batch}; keep batch_size x grad_accum x ranks the same")
    return state

@dataclass
class Run:
    """What the training loop works on, built by train() from the command line."""
    args: argparse.Namespace
    rank: int
    world: int
    device: torch.device
    target: Target
    drafter: DFlashDrafter      # the raw module: saved and evaluated
    model: nn.Module            # what the step runs: the drafter, compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    batches: Batches
    eval_samples: list
    total_steps: int
    loss_kw: dict               # gamma, noise_std, labels, pad_to: passed to dflash_loss
    step: int = 0
    bad_steps: int = 0          # consecutive non-finite steps
    walk: tuple | None = None   # this rank's walk prompts and their greedy continuations (held_out_walk)

    def print0(self, *a):
        if self.rank == 0:
            from tqdm import tqdm
            tqdm.write(" ".join(str(x) for x in a))

    def log(self, record):
        if self.rank == 0:
            with open(os.path.join(self.args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def evaluate(self, step):
        if not self.eval_samples:
            return
        a = self.args
        self.drafter.eval()
        m = evaluate(self.drafter, self.target, self.eval_samples, a.batch_size, a.num_anchors,
                     self.batches.pad_id, a.seed, self.rank, self.world, **self.loss_kw)
        wt = walk_tau(self.drafter, self.target, self.walk, self.world, target_features, padded_length)
        self.drafter.train()
        self.print0(f"step {step}: eval loss {m['loss']:.4f}  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}"
                    + (f"  walked tau {wt:.3f}" if wt is not None else ""))
        self.log({"step": step, "eval_loss": m["loss"], "eval_tau": m["tau"], "eval_acc": m["acc"],
                  "eval_walk_tau": wt})

    def save(self, step):
        rng = [torch.get_rng_state()]
        if self.world > 1:
            rng = [None] * self.world
            dist.all_gather_object(rng, torch.get_rng_state())
            getattr(self.optimizer, "consolidate_state_dict", lambda to: None)(to=0)  # --zero: the full state on rank 0
        if self.rank == 0:
            p = save_checkpoint(self.args.out, step, self.drafter, self.optimizer, SAVE_DTYPES[self.args.save_dtype],
                                {"args": vars(self.args), "rng": rng, "global_batch": self.batches.global_batch,
                                 "bad_steps": self.bad_steps, "epoch": step // self.batches.steps_per_epoch})
            self.print0(f"saved {p}")
        if self.world > 1:
            dist.barrier()

def optimizer_step(run, total, step):
    """Clip, then update unless the loss or the gradient is not finite (then skip; stop after too many)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(run.drafter.parameters(), run.args.grad_clip)
    loss = total["ce_w"] / total["w"].clamp(min=1e-9)
    if torch.isfinite(loss) and torch.isfinite(grad_norm):
        run.bad_steps = 0
        run.optimizer.step()
    else:  # grads are all-reduced and the loss summed, so every rank takes this branch together
        run.bad_steps += 1
        run.print0(f"step {step + 1}: non-finite loss {loss.item()} / grad norm {grad_norm.item()}, skipped the "
                   f"update ({run.bad_steps} in a row)")
        if run.bad_steps >= run.args.max_bad_steps:
            raise DFlashError(f"{run.bad_steps} consecutive non-finite steps (last at step {step + 1}); lower --lr or "
                              f"check the data; the last good checkpoint is in {run.args.out}")
    run.optimizer.zero_grad(set_to_none=True)
    return grad_norm.item()

def train_loop(run):
    """The loop: lr schedule, one step, logging, held-out evaluation, checkpoints, SIGTERM -> save and exit."""
    from tqdm import tqdm
    args, cfg = run.args, run.drafter.cfg
    stop = StopFlag()
    try:
        run.drafter.train()
        if run.step == 0:
            run.evaluate(0)
        start = run.step
        bar = tqdm(range(start, run.total_steps), initial=start, total=run.total_steps, desc="train",
                   disable=run.rank != 0, dynamic_ncols=True)
        t_last, tokens, first = time.time(), 0, True
        for step in bar:
            t0, lr = time.time(), lr_at(step, run.total_steps, args.lr, args.warmup_ratio)
            for g in run.optimizer.param_groups:
                g["lr"] = lr
            micro = [run.batches.get(step, m) for m in range(args.grad_accum)]
            total = train_step(run.model, run.target, cfg, micro, args.num_anchors, run.world, **run.loss_kw)
            tokens += total["tokens"].item()  # all ranks' tokens, exactly
            grad_norm = optimizer_step(run, total, step)
            if first:
                run.print0(f"first step took {time.time() - t0:.1f}s (includes compilation when --compile is on)")
                first = False
            done = run.step = step + 1
            if done % args.log_every == 0 or done == run.total_steps:
                m, tok_s, mem = summarize(total), tokens / max(time.time() - t_last, 1e-9), peak_memory_mb(run.device)
                run.print0(f"step {done}: loss {m['loss']:.4f}  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}  lr "
                           f"{lr:.2e}  grad {grad_norm:.2f}  {tok_s:,.0f} tok/s  peak {mem:,.0f} MB")
                run.log({"step": done, "loss": m["loss"], "tau": m["tau"], "acc": m["acc"], "lr": lr,
                         "grad_norm": grad_norm, "tokens_per_s": tok_s, "peak_mb": mem})
                bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}")
                t_last, tokens = time.time(), 0
            if args.eval_every and done % args.eval_every == 0 and done != run.total_steps:
                run.evaluate(done)
            flag = torch.tensor(float(stop.requested), device=run.device)
            if run.world > 1:  # all ranks agree to stop after the same step
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                run.save(done)
                run.print0(f"interrupted after step {done}; resume with the same command plus --resume")
                break
            if args.save_every and done % args.save_every == 0 and done != run.total_steps:
                run.save(done)
        else:
            if run.total_steps > start or not latest_checkpoint(args.out):
                run.evaluate(run.total_steps)
                run.save(run.total_steps)
        bar.close()
    finally:
        stop.restore()

def drafter_config(args, target):
    """--init_from's config.json, or a new config from the flags (DRAFTER_FLAGS); checked against the target."""
    cfg = read_drafter_config(args.init_from) if args.init_from else \
        new_drafter_config(target, **{k: getattr(args, k) for k in DRAFTER_FLAGS})
    check_compatible(cfg, target)
    return cfg

def train(args):
    """Set up the run from the command line (target, drafter, data, optimizer, resume), then train_loop()."""
    missing = [f"--{k}" for k in ("target",) + (() if args.plan else ("data",)) if not getattr(args, k)]
    if missing:
        raise DFlashError(f"{missing[0]} is required (or run `python dflash.py` with no arguments for the demo)")
    rank, world, device = setup_distributed(args.device)
    check_writable_dir(args.out, "--out")
    resume_dir = check_run_dir(args.out, args.resume)  # with --resume: <out>/latest, checked complete
    args.init_from = args.init_from and resolve_drafter(args.init_from, "--init_from")  # a directory or a hub id
    if args.plan or device.type == "cuda":  # the memory plan, from the configs alone, before any weights load
        meta = load_target(args.target, "meta", DTYPES[args.dtype], args.trust_remote_code)
        plan = drafter_config(args, meta)
        memory_plan(vars(args), asdict(plan), expected_shapes(plan), meta, world, device, DFlashError)  # --plan: exits
    target = load_target(args.target, device, DTYPES[args.dtype], args.trust_remote_code)
    print0, tok = print if rank == 0 else lambda *a: None, target.tokenizer
    data_kw = dict(log=print0, enable_thinking=args.enable_thinking, eos_ids=target.eos_ids(),
                   vocab_size=target.vocab_size)
    samples = load_samples(args.data, tok, args.max_len, **data_kw)
    if args.show_data:  # look at the loss masks before spending anything on training
        return show_data(samples, tok, args.show_data) if rank == 0 else None
    cfg = drafter_config(args, target)
    attention = args.attention if args.attention != "auto" else "flex" if device.type == "cuda" else "dense"
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")

    if args.eval_data:
        train_samples, eval_samples = samples, load_samples(args.eval_data, tok, args.max_len, **data_kw)
    else:
        train_samples, eval_samples = split_eval(samples, args.eval_fraction, args.seed)
    batches = Batches(train_samples, args.batch_size, args.grad_accum, rank, world, args.seed,
                      getattr(tok, "pad_token_id", None) or 0)
    total_steps = args.max_steps or args.epochs * batches.steps_per_epoch

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.init_from:
        drafter = load_drafter(args.init_from, device, attention=attention)
    else:
        drafter = DFlashDrafter(cfg, attention).to(device)
    drafter.grad_checkpoint = args.grad_checkpoint
    optimizer = make_optimizer(drafter.parameters(), args.zero and world > 1, lr=args.lr, betas=(0.9, 0.95),
                               weight_decay=args.weight_decay, fused=device.type == "cuda")
    state = read_train_state(resume_dir, cfg, batches.global_batch) if resume_dir else None
    if state:
        drafter.load_state_dict(load_drafter(resume_dir, device).state_dict())
        optimizer.load_state_dict(state["optimizer"])
        if rank < len(state["rng"]):
            torch.set_rng_state(state["rng"][rank])
        print0(f"resumed from {resume_dir} at step {state['step']}")
    torch.manual_seed(args.seed + rank)
    model = torch.compile(drafter) if compile_ else drafter
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    os.makedirs(args.out, exist_ok=True)
    print0(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, {cfg.num_hidden_layers} "
           f"layers, block {cfg.block_size}, target_layer_ids {cfg.target_layer_ids}, layer_types {cfg.layer_types}; "
           f"target {args.target} ({target.num_layers} layers); {len(train_samples)} train / {len(eval_samples)} eval "
           f"samples; {total_steps} steps of {batches.global_batch} samples; attention {attention}, compile "
           f"{compile_}, {world} rank(s) on {device.type}")
    pad_to = padded_length(args.max_len) if attention == "flex" or compile_ else None
    run = Run(args, rank, world, device, target, drafter, model, optimizer, batches, eval_samples, total_steps,
              dict(gamma=args.gamma, noise_std=args.noise_std, labels=args.labels, pad_to=pad_to),
              step=state["step"] if state else 0, bad_steps=state.get("bad_steps", 0) if state else 0,
              walk=held_out_walk(target, eval_samples, args.eval_walk_prompts, args.eval_walk_tokens, rank, world))
    train_loop(run)
    if world > 1:
        dist.destroy_process_group()
    return drafter, cfg, target


# -----------------------------------------------------------------------------
# Command line: every flag is checked once, here, where it enters (its valid range is in its --help)

SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DRAFTER_FLAGS = ("num_draft_layers", "block_size", "mask_token_id", "target_layer_ids", "sliding_window",
                 "layer_types", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")

def get_parser():
    p = ArgumentParser(description="Train a DFlash block-diffusion drafter against a frozen target LLM.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target", help="target model: a local directory or a hub id (loaded with AutoModelForCausalLM)")
    a("--data", help="training JSONL: messages | prompt+response | text | input_ids(+loss_mask) per line")
    a("--out", default="out", help="output directory for checkpoints and metrics.jsonl")
    a("--init_from", default=None, help="drafter directory (z-lab's or ours) or hub id (owner/name) to fine-tune from")
    a("--resume", action="store_true", help="continue from <out>/latest")
    a("--demo", action="store_true", help="the CPU demo (also what runs with no arguments)")
    g = p.add_argument_group("drafter geometry (new drafters; ignored with --init_from)")
    p.add(g, "--num_draft_layers", int, 5, "drafter decoder layers", lo=1, hi=256)
    p.add(g, "--block_size", int, 16, "B: one anchor token + B-1 drafted tokens", lo=2, hi=1024)
    g.add_argument("--target_layer_ids", type=int_list, default=None,
                   help="comma-separated target layers feeding the context (default: spread from 1 to L-3)")
    p.add(g, "--mask_token_id", int, None, "mask token id (default: the tokenizer's)", lo=0, hi=2**31 - 1)
    p.add(g, "--sliding_window", int, 2048, "window of the sliding layers (0: no sliding layers)", lo=0, hi=2**30)
    g.add_argument("--layer_types", type=layer_type_list, default=None,
                   help="comma-separated sliding|full per layer (default: all sliding but the last)")
    p.add(g, "--num_heads", int, 32, "attention heads", lo=1, hi=1024)
    p.add(g, "--num_kv_heads", int, 8, "key/value heads (GQA)", lo=1, hi=1024)
    p.add(g, "--head_dim", int, 128, "head dimension (even: RoPE rotates pairs)", lo=2, hi=1024)
    p.add(g, "--intermediate_size", int, None, "MLP width (default: the target's)", lo=1, hi=2**20)
    g = p.add_argument_group("data and loss")
    p.add(g, "--max_len", int, 3072, "truncate samples to this many tokens", lo=2, hi=2**20)
    g.add_argument("--enable_thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="passed to the chat template if it reads enable_thinking, as eval.py does (default: its own)")
    p.add(g, "--show_data", int, 0, "print the first N encoded samples with their loss spans in [[...]], then exit "
          "(0: train)", lo=0, hi=10**9)
    p.add(g, "--eval_fraction", float, 0.01, "held-out fraction of --data (0: no held-out evaluation)", lo=0, hi=0.5)
    a("--eval_data", default=None, help="held-out JSONL (instead of --eval_fraction)")
    p.add(g, "--num_anchors", int, 512, "anchors (blocks) per sequence", lo=1, hi=2**16)
    p.add(g, "--gamma", float, 4.0, "loss decay: weight exp(-(i-1)/gamma) at block offset i", lo=0, hi=10**6,
          open_lo=True)
    g.add_argument("--labels", choices=["target", "data"], default="target",
                   help="target: the target's greedy token (teacher-forced); data: the data token")
    p.add(g, "--noise_std", float, 0.02, "Gaussian noise on the context features, relative to their RMS (0: off)",
          lo=0, hi=10)
    g = p.add_argument_group("optimisation")
    p.add(g, "--batch_size", int, 1, "sequences per rank per micro-step", lo=1, hi=2**16)
    p.add(g, "--grad_accum", int, 4, "micro-steps per optimizer step", lo=1, hi=2**16)
    p.add(g, "--lr", float, 6e-4, "peak learning rate (AdamW)", lo=0, hi=1, open_lo=True)
    p.add(g, "--warmup_ratio", float, 0.04, "linear warmup fraction, then cosine to 0 (0: none)", lo=0, hi=1)
    p.add(g, "--epochs", int, 6, "epochs (unless --max_steps)", lo=1, hi=10**6)
    p.add(g, "--max_steps", int, 0, "optimizer steps (0: from --epochs)", lo=0, hi=10**9)
    p.add(g, "--grad_clip", float, 1.0, "gradient norm clip", lo=0, hi=10**9, open_lo=True)
    p.add(g, "--weight_decay", float, 0.0, "AdamW weight decay", lo=0, hi=1)
    p.add(g, "--max_bad_steps", int, 10, "stop after this many consecutive non-finite steps", lo=1, hi=10**6)
    g = p.add_argument_group("system")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the drafter (auto: on for CUDA, off on CPU)")
    g.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="attention path (auto: flex on CUDA, dense elsewhere)")
    g.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="target dtype (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--save_dtype", choices=list(SAVE_DTYPES), default="fp32",
                   help="checkpoint weights dtype (fp32 resumes exactly; bf16 halves the size)")
    g.add_argument("--device", default=None, help="device (default: cuda:LOCAL_RANK if available, else cpu)")
    g.add_argument("--trust_remote_code", action="store_true", help="allow the target's custom code")
    p.add(g, "--seed", int, 0, "random seed", lo=0, hi=2**62)
    p.add(g, "--log_every", int, 10, "log every N steps", lo=1, hi=10**9)
    p.add(g, "--eval_every", int, 500, "held-out evaluation every N steps (0: only at the start and the end)", lo=0,
          hi=10**9)
    p.add(g, "--eval_walk_prompts", int, 16, "held-out prompts for the exact walked tau at each eval (0: off)", lo=0,
          hi=10**6)
    p.add(g, "--eval_walk_tokens", int, 64, "greedy continuation length of each walked prompt", lo=1, hi=2**20)
    p.add(g, "--save_every", int, 1000, "checkpoint every N steps (0: only at the end)", lo=0, hi=10**9)
    g.add_argument("--debug", action="store_true", help="show tracebacks for input errors (or DFLASH_DEBUG=1)")
    add_plan_flags(p)  # --plan, --plan_world_size, --plan_gpu_gb, --zero, --grad_checkpoint
    return p

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)
    if args.demo or not argv:
        # The demo lives in dflash_tools/ and imports this file; running it as its own program (same process, same
        # environment, so torchrun's ranks carry over) keeps one instance of this module and no import cycle.
        demo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dflash_tools", "demo.py")
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, demo, *argv])
    return run_main(train, args)


if __name__ == "__main__":
    main()
