"""
DFlash: train a block-diffusion speculative-decoding drafter against a frozen target LLM (arXiv 2602.06036).

Quick start
    python dflash.py                      # CPU demo: tiny target, train a drafter, measure tau (< 10 min)
    python dflash.py --demo --attention plain   # the same through Part I's plain attention and loss, to step through
    python dflash.py --target Qwen/Qwen3-8B --data train.jsonl --out runs/q3-8b --mask_token_id 151669 \
        --sliding_window 0                # one GPU
    torchrun --nproc_per_node=8 dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl --out runs/q36 \
        --mask_token_id 248070 --num_heads 32 --num_kv_heads 8 --head_dim 128   # 8 GPUs, z-lab's 27B geometry
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 dflash.py ...
    torchrun --max_restarts=3 ... dflash.py ... [--resume]   # continue <out>/latest (a restarted worker does)
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000   # tau of a checkpoint

This file is DFlash, trained and resumed safely, and runs copied alone. Part I is the method in reading order (a
learner may stop after it), Part II the exact fast paths, Part III the operations a run needs.

The method in ten lines
    The target runs as usual. The drafter proposes the next B-1 tokens in ONE forward pass: its input is a block
    [tok[a], M, M, ..., M] (the anchor token a, then B-1 mask tokens) embedded with the target's embedding, and its
    output at block offset i goes through the target's lm_head to predict the token at position a+i. One target forward
    verifies a block: it accepts the longest prefix of drafts equal to its own greedy tokens, plus one token of its own.
    tau (the acceptance length) = tokens committed per target forward = accepted + 1, what the walk (tau_walk) measures.
    The drafter conditions on context features: the outputs h[t] of target layers t in target_layer_ids, concatenated
    and projected by fc+hidden_norm to one vector per position, which every drafter layer sees as extra keys/values.
    Visibility (pictured at make_mask_mod): a block token sees the context j < a (the target has no hidden state
    for the anchor yet) and its own block (offsets up to its own in a causal layer); sliding layers drop keys W or
    more positions away. Training runs the blocks of many anchors in one call; the loss is hard cross-entropy against
    the target's greedy tokens, weighted w = exp(-(i-1)/gamma) at offset i: loss = sum(w * CE) / sum(w), global batch.

Forkers: a variant, a loss or a training stage is one file, nothing here edited: Part III's "Plug-ins: the contract".
"""

import argparse
import difflib
import hashlib
import importlib
import json
import math
import os
import pathlib
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import namedtuple
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from dataclasses import asdict, dataclass, field, fields
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm


# =============================================================================
# PART I. THE METHOD
#
# Everything DFlash is, each idea before its first use; what it calls from Parts II and III is named for what it does.
# =============================================================================

# -----------------------------------------------------------------------------
# The drafter's config: mirrors z-lab's config.json (a Qwen3 config plus the DFlash fields)

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
    architecture: ClassVar[str] = "DFlashDraftModel"  # config.json's architectures; a variant names its own

    def __post_init__(self):
        """Every config passes here: all its problems at once; is_causal kept only where not causal iff sliding."""
        bad = self.problems()
        need(not bad, "\n".join(bad))
        if self.is_causal is not None and all((t == "sliding_attention") == self.is_causal for t in self.layer_types):
            self.is_causal = None

    def problems(self):  # a variant adds its own rules
        return config_problems(self)

    def dflash_config_keys(self):  # a variant's own keys of config.json's dflash_config
        return {}

    def layer_kind(self, i):
        """(causal, window) of layer i: what its attention mask depends on."""
        sliding = self.layer_types[i] == "sliding_attention"
        causal = bool(self.is_causal) if self.is_causal is not None else sliding
        return causal, self.sliding_window if sliding else None

# -----------------------------------------------------------------------------
# Attention visibility, written once as a flex_attention mask_mod; the dense path evaluates the same function. Keys:
# [S context positions ; N blocks of B]; query n*B + i is offset i of block n, at position a+i. S=8, B=4, anchors 2, 5:
#   x: visible      | bidirectional full layer    | causal sliding layer, W=3
#                   | context   block 0  block 1  | context   block 0  block 1
#   key position    | 01234567  2345     5678     | 01234567  2345     5678
#   block 0 i=0 @2  | xx......  xxxx     ....     | xx......  x...     ....
#           i=1 @3  | xx......  xxxx     ....     | .x......  xx..     ....
#           i=2 @4  | xx......  xxxx     ....     | ........  xxx.     ....
#           i=3 @5  | xx......  xxxx     ....     | ........  .xxx     ....
#   block 1 i=0 @5  | xxxxx...  ....     xxxx     | ...xx...  ....     x...
#           i=1 @6  | xxxxx...  ....     xxxx     | ....x...  ....     xx..
#           i=2 @7  | xxxxx...  ....     xxxx     | ........  ....     xxx.
#           i=3 @8  | xxxxx...  ....     xxxx     | ........  ....     .xxx

def block_positions(anchors, B):
    return anchors[..., None] + torch.arange(B, device=anchors.device)  # (b, N, B): offset i sits at a+i

def make_mask_mod(anchors, anchor_valid, S, B, causal, window):
    """anchors, anchor_valid (b, N) -> mask_mod, pictured above (python -m dflash_tools.plot --mask): query i of anchor
    a sees context j < a and its own block (offsets i' <= i when causal); a sliding window counts positions for every
    key, context and block alike, as vLLM and SGLang serve it: |q_pos - k_pos| < W. Padding anchors see nothing.
    Why a full layer sees its block both ways and a sliding layer causally: z-lab's released drafters are configured
    so (is_causal unset), vLLM and SGLang serve them so, and a drafter is trained as it is served."""
    def mask_mod(b, h, q_idx, kv_idx):
        n, i = q_idx // B, q_idx % B
        a, k_off = anchors[b, n], (kv_idx - S) % B     # a block key's offset i': its position is a + i'
        ctx_ok = (kv_idx < S) & (kv_idx < a)
        blk_ok = (kv_idx >= S) & ((kv_idx - S) // B == n)
        if causal:
            blk_ok = blk_ok & (k_off <= i)
        if window is not None:                         # for block keys |q_pos - k_pos| = |i - i'|
            ctx_ok = ctx_ok & (a + i - kv_idx < window)
            blk_ok = blk_ok & ((i - k_off).abs() < window)
        return anchor_valid[b, n] & (ctx_ok | blk_ok)

    return mask_mod

def build_masks(cfg, anchors, anchor_valid, S, attention):
    """One mask per (causal, window) layer kind: plain attention's whole table (b, N*B, S+N*B) of make_mask_mod,
    quadratic in anchors; flex and dense take their own form of the same rule (fast_mask, Part II)."""
    (b, N), B, masks = anchors.shape, cfg.block_size, {}
    ar = partial(torch.arange, device=anchors.device)
    for kind in {cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}:
        mod = make_mask_mod(anchors, anchor_valid, S, B, *kind)
        masks[kind] = mod(ar(b)[:, None, None], 0, ar(N * B)[:, None], ar(S + N * B)) if attention == "plain" else \
            fast_mask(mod, attention, anchors, S, B)
    return masks

# -----------------------------------------------------------------------------
# RoPE and the drafter: Qwen3 decoder layers whose keys/values also see the target's context features

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
    """RoPE over the full head_dim: inverse frequencies (head_dim/2,) and the cos/sin scale (yarn's, or 1)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not cfg.rope_scaling:
        return inv_freq, 1.0
    return yarn_inv_freq(cfg, inv_freq)

def rope_cos_sin(inv_freq, scale, positions, dtype):
    """positions (...,) -> cos, sin (..., head_dim)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

def apply_rope(x, cos, sin):
    """x (..., T, heads, hd); cos/sin (..., T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(-2) + torch.cat([-x2, x1], dim=-1) * sin.unsqueeze(-2)

def plain_attention(q, k, v, visible):
    """softmax(q k^T / sqrt(hd)) v over the visible keys, nanoGPT's way, as both fast paths compute it (tested).
    q (b, h, T, hd), k/v (b, hk, K, hd): query head j reads kv head j // (h/hk); visible (b, T, K)"""
    k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])                         # (b, h, T, K)
    att = att.masked_fill(~visible[:, None], float("-inf")).softmax(-1)
    return att.nan_to_num(0.0) @ v  # a padding anchor sees nothing: 0 (its NaNs, gradient too, are masked out)

def one_sequence(q, k_ctx, v_ctx, k_blk, v_blk):
    """All blocks as one query sequence against [context ; all blocks]: q (b, N, B, h, hd) -> (b, h, N*B, hd), the
    context's k/v (b, S, hk, hd) and the blocks' (b, N, B, hk, hd) -> (b, hk, S+N*B, hd)"""
    keys = lambda ctx, blk: torch.cat([ctx, blk.flatten(1, 2)], 1).transpose(1, 2)  # noqa: E731
    return q.flatten(1, 2).transpose(1, 2), keys(k_ctx, k_blk), keys(v_ctx, v_blk)

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
        """x (b, N, B, D) normed; k_ctx/v_ctx (b, S, hk, hd); mask: build_masks' table (or a fast path's form)"""
        b, N, B, _ = x.shape
        h, hd = self.h, self.hd
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (h, hd))), cos, sin)  # (b, N, B, h, hd)
        k_blk, v_blk = self.keys_values(x, cos, sin)                                  # (b, N, B, hk, hd)
        # the fp32 norm weights promote q and k under autocast while v stays bf16: one dtype for the kernel
        q, k_blk, k_ctx, v_ctx = (t.to(v_blk.dtype) for t in (q, k_blk, k_ctx, v_ctx))
        if not torch.is_tensor(mask):  # flex's BlockMask or dense's triple: the same numbers, fast (Part II)
            return self.o_proj(fast_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask))
        out = plain_attention(*one_sequence(q, k_ctx, v_ctx, k_blk, v_blk), mask)                 # (b, h, N*B, hd)
        return self.o_proj(out.transpose(1, 2).reshape(b, N, B, h * hd))

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class DecoderLayer(nn.Module):
    def __init__(self, cfg, index):  # index: layer 0..n-1 (a variant's Layer may mix layer kinds by it)
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask)
        return x + self.mlp(self.post_attention_layernorm(x))

class DFlashDrafter(nn.Module):
    """No embedding, no lm_head (the target's); attention flex (CUDA), dense or plain. Hooks: Part III, the contract"""
    Layer = DecoderLayer

    def __init__(self, cfg, attention="dense"):
        super().__init__()
        self.cfg, self.attention, self.grad_checkpoint = cfg, attention, False
        if attention == "flex":
            compile_flex()
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(self.Layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear) and not getattr(m, "identity_init", False):  # (a variant's may stay at 0)
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def context_kv(self, context_features, start=0):
        """(b, S, m*D) features h[t] -> ctx = hidden_norm(fc(.)) -> per-layer context keys/values at start.."""
        ctx = self.hidden_norm(self.fc(context_features))
        pos = torch.arange(start, start + ctx.shape[1], device=ctx.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, context_features, block_embeds, anchors, anchor_valid):
        """Training's call, all blocks at once (not a hook: the walk and eval.py call context_kv and blocks)."""
        kv = self.context_kv(context_features)
        return self.blocks(block_embeds, anchors, anchor_valid, kv, context_features.shape[1])

    def blocks(self, x, anchors, anchor_valid, kv, S):
        """The final hidden state (b, N, B, D): the layers over block embeddings x given the context's kv (S keys)"""
        pos = block_positions(anchors, self.cfg.block_size)                                # (b, N, B): a+i
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, x.dtype)
        masks = build_masks(self.cfg, anchors, anchor_valid, S, self.attention)
        for i, layer in enumerate(self.layers):  # --grad_checkpoint: keep each layer's inputs, recompute the rest
            a = (x, cos, sin, *kv[i], masks[self.cfg.layer_kind(i)])
            x = checkpoint(layer, *a, use_reentrant=False) if self.grad_checkpoint and self.training else layer(*a)
        return self.norm(x)

    def draft(self, logits, h, anchor_ids, truth=None, temperature=0.0):
        """The draft rule: logits (n, B-1, V) -> drafts (n, B-1), the argmax; a variant's {name: (n, B-1)} too"""
        return logits.argmax(-1), {}

    def block_loss(self, hidden, lm_head, labels, weights, block_ids, loss=None, progress=None, final=None):
        """sum(w * loss), its stats: plain_ce (below) under --attention plain, else weighted_ce (Part II, any --loss)"""
        if self.attention == "plain" and type(loss or CE()) is CE:
            return plain_ce(hidden, lm_head, labels, weights)
        return weighted_ce(hidden, lm_head, labels, weights, loss=loss, final=final)

    def logprobs(self, logits, h, prev, progress=None):
        """fp32 logits (T, V) of h (T, D), prev (T,) the token before each -> [(weight, log q, ids or None: all V)]"""
        return [(1.0, logits.log_softmax(-1), None)]

    def summary(self, stats):  # a variant's figures from the summed stats, beside loss, tau and acc
        return {}

DFlashConfig.Drafter = DFlashDrafter  # the model a config builds: cfg.Drafter(cfg); a variant's config names its own

# -----------------------------------------------------------------------------
# The target: frozen; forward hooks capture the context features h[t] and the final hidden state f, whose greedy
# tokens are the labels

@dataclass
class Target:
    model: nn.Module        # the full HF model (generation, eval)
    backbone: nn.Module     # the decoder stack without lm_head (what training runs)
    embed: nn.Module
    lm_head: nn.Module
    tokenizer: object
    name: str
    sharded: bool = False   # --shard_target: every forward is a collective, so every rank must run it alike

    def __post_init__(self):
        self.layers, self.norm = self.backbone.layers, getattr(self.backbone, "norm", None)
        self.num_layers, (self.vocab_size, self.hidden_size) = len(self.layers), self.lm_head.weight.shape

    def eos_ids(self):  # the generation_config's eos_token_id (an int or a list), as a set
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}

    def features(self, input_ids, layer_ids, labels=True, final=False):
        """What training reads of the target, one pass (target_features, greedy_labels below): the context features
        (b, S, m*D), the labels (b, S) if labels, f (b, S, D) if final. A capture (--features) reads them from disk."""
        context, f = target_features(self, input_ids, layer_ids)
        return context, greedy_labels(f, self.lm_head) if labels else None, f if final else None

@contextmanager
def capture_hidden(target, layer_ids):
    """Forward hooks on decoder layers `layer_ids` and the final norm: yields {t: h[t], "final": f}. Layer t means
    what vLLM serves: the residual stream after decoder layer t, before the final norm (also for t = L-1)."""
    store = {}

    def keep_output_as(key):  # a forward hook that stores the module's output (a decoder layer returns a tuple)
        def hook(module, inputs, output):
            store[key] = output[0] if isinstance(output, tuple) else output
        return hook
    handles = [target.layers[t].register_forward_hook(keep_output_as(t)) for t in layer_ids]
    handles.append(target.backbone.norm.register_forward_hook(keep_output_as("final")))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()

@torch.no_grad()
def target_features(target, input_ids, layer_ids):
    """One pass of the decoder stack -> context (b, S, m*D) = concat_t h[t], f (b, S, D) (right pads need no mask)."""
    with capture_hidden(target, layer_ids) as store:
        target.backbone(input_ids=input_ids, use_cache=False)
    return torch.cat([store[t] for t in layer_ids], dim=-1), store["final"]

@torch.no_grad()
def greedy_labels(final, lm_head, chunk=None):
    """y[j] = argmax lm_head(f[j-1]), what greedy verification accepts: final (b, S, D) -> (b, S), y[0] = -1."""
    b, S, D = final.shape
    f = final[:, :-1].reshape(-1, D)
    chunk = chunk or vocab_chunk(lm_head.weight.shape[0])
    out = torch.cat([lm_head(f[s:s + chunk]).argmax(-1) for s in range(0, f.shape[0], chunk)])
    return torch.cat([out.new_full((b, 1), -1), out.view(b, S - 1)], dim=1)

# -----------------------------------------------------------------------------
# Anchors, block inputs and labels, context noise

def anchor_candidates(loss_mask):
    """The usable anchors of a loss_mask (S,): a with loss_mask[a] = loss_mask[a+1] = 1 (used everywhere)."""
    m = torch.as_tensor(loss_mask) > 0
    return (m[:-1] & m[1:]).nonzero().squeeze(1)

def sample_anchors(loss_mask, num_anchors, generator):
    """loss_mask (S,) -> anchors, valid (num_anchors,): candidates drawn without replacement, padded."""
    cand = anchor_candidates(loss_mask)
    pick = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
    anchors, valid = torch.zeros(num_anchors, dtype=torch.long), torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:len(pick)], valid[:len(pick)] = pick, True
    return anchors, valid

def batch_anchors(batch, num_anchors, salt=0):
    """Anchors (b, N) and valid (b, N) for every row, each from a generator keyed by the sample (and a salt)."""
    rows = [sample_anchors(m, num_anchors, torch.Generator().manual_seed(mix_seed(k, salt)))
            for m, k in zip(batch["loss_mask"], batch["keys"])]
    return torch.stack([a for a, _ in rows]), torch.stack([v for _, v in rows])

def block_input_ids(input_ids, anchors, B, mask_token_id):
    """[tok[a], M, M, ..., M] for every anchor: (b, N, B)."""
    ids = torch.full((*anchors.shape, B), mask_token_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids

def embed_blocks(target, ids):
    """The raw embedding rows, as vLLM and SGLang feed the drafter (also where the module scales them, Gemma)."""
    return F.embedding(ids, target.embed.weight)

def block_labels(labels_all, anchors, B):
    """labels_all (b, S, ...) -> (b, N, B, ...): offset i's is labels_all[a+i] (clamped to the sequence, weight 0)."""
    pos = block_positions(anchors, B).clamp(0, labels_all.shape[1] - 1)
    return labels_all[torch.arange(len(pos), device=pos.device)[:, None, None], pos]

def add_context_noise(context, noise_std, num_context_layers, keys):
    """Gaussian noise relative to the RMS of each feature vector h[t][j], on the context features only (a new
    tensor: f, the labels and the block embeddings are never touched). One generator per row."""
    if noise_std == 0:
        return context
    x = context.float().unflatten(-1, (num_context_layers, -1))                   # (b, S, m, D)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.stack([torch.randn(x.shape[1:], device=x.device, generator=torch.Generator(x.device).manual_seed(
        mix_seed(k, 7))) for k in keys])
    return (x + noise_std * rms * noise).flatten(-2).to(context.dtype)

# -----------------------------------------------------------------------------
# The corrected loss: hard cross-entropy weighted by block offset, normalised over the whole global batch

def loss_weights(anchors, anchor_valid, loss_mask, B, gamma):
    """w[b, n, i] = exp(-(i-1)/gamma) * valid for i = 1..B-1, 0 at offset 0 (the anchor is given, not drafted);
    valid: a+i inside the sequence, loss_mask[a+i] = 1, and a real (not padding) anchor."""
    S = loss_mask.shape[1]
    pos = block_positions(anchors, B)
    in_mask = loss_mask.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos) > 0
    i = torch.arange(B, device=anchors.device, dtype=torch.float32)
    decay = torch.where(i > 0, torch.exp(-(i - 1) / gamma), 0.0)
    return decay * ((pos < S) & in_mask & anchor_valid[..., None])

def plain_ce(hidden, lm_head, labels, weights):
    """The loss in plain form, nanoGPT's way: full logits, F.cross_entropy at every block token, sum(w * CE) (the loss
    is that / sum(w)); weighted_ce (Part II) computes the same in vocabulary chunks, any --loss too (tested)."""
    weights = weights.to(hidden.device)
    logits = lm_head(hidden.to(lm_head.weight.dtype)).float()                       # (b, N, B, V): all at once
    y = labels.clamp(min=0)                                                         # (a label -1 has weight 0)
    ce = F.cross_entropy(logits.flatten(0, 2), y.flatten(), reduction="none").view_as(weights)
    ce_w, valid = (weights * ce).sum(), weights > 0
    return ce_w, {"w": weights.sum(), "ce_w": ce_w.detach(), **accuracy_stats((logits.argmax(-1) == y) & valid, valid)}

def accuracy_stats(correct, valid):
    """correct, valid (b, N, B) -> correct/count per offset, blocks, accepted. The "tau" training logs is an estimate,
    1 + accepted / blocks: at every sampled anchor the drafts equal to its labels before the first miss, every block
    alike. The walk (below) drafts only where its last step stopped, after a miss, where drafting is hardest, against
    the target's own continuation (the labels follow the data's tokens): the walked tau is lower."""
    blocks = valid[..., 1]
    accepted = torch.cumprod(correct[..., 1:].long(), dim=-1).sum(-1)
    return {"correct": correct.sum((0, 1)).float(), "count": valid.sum((0, 1)).float(),
            "accepted": (accepted * blocks).sum().float(), "blocks": blocks.sum().float()}

def dflash_loss(model, cfg, target, batch, anchors, anchor_valid, weights, weight_total=None, noise_std=0.0,
                labels="target", pad_to=None, raw_model=None, **loss_kw):
    """The corrected DFlash loss of one batch: target pass -> labels -> drafter over every block -> weighted CE.
    model: the drafter or its compiled/DDP wrapper (raw_model: the drafter); labels: "target" (its greedy token at a+i,
    what verification accepts) or "data". Returns sum(w * CE) / weight_total (the global batch's: undiluted), stats."""
    dev, B, w = target.lm_head.weight.device, cfg.block_size, weights  # (w stays where built: selected there)
    input_ids = batch["input_ids"].to(dev)
    anchors, anchor_valid = anchors.to(dev), anchor_valid.to(dev)
    want_f = getattr(loss_kw.get("loss"), "target_logits", False)  # a --loss on the target's distribution: f too
    context, y, final = target.features(input_ids, cfg.target_layer_ids, labels == "target", want_f)  # (b, S, m*D)
    y = block_labels(y if labels == "target" else input_ids, anchors, B)             # (b, N, B)
    f = block_labels(final, anchors - 1, B) if want_f else None
    ids = block_input_ids(input_ids, anchors, B, cfg.mask_token_id)                # (b, N, B)
    with torch.no_grad():
        x = embed_blocks(target, ids)
    context = add_context_noise(context, noise_std, len(cfg.target_layer_ids), batch["keys"])  # never on f or y
    if pad_to and pad_to > context.shape[1]:  # fixed drafter shapes for compiled kernels (padding is never visible)
        context = F.pad(context, (0, 0, 0, pad_to - context.shape[1]))
    with torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext():
        hidden = model(context, x, anchors, anchor_valid)                      # (b, N, B, D)
    ce_w, stats = (raw_model or model).block_loss(hidden, target.lm_head, y, w, ids, final=f, **loss_kw)
    return ce_w / (stats["w"] if weight_total is None else weight_total).clamp(min=1e-9), stats

# -----------------------------------------------------------------------------
# The exact tau walk (training's held-out walked tau, and eval.py's)
#
# Greedy speculative decoding is lossless: the accepted tokens are exactly the target's greedy continuation s. So tau
# needs no decode loop (nor rolling back a hybrid target's recurrent state): the target generates s once, one hooked
# pass over prompt + s gives every context feature, the drafter drafts the block at every anchor of s at once (each
# sees only the context before it), and tau_walk walks them along s. One step, B = 4, s = [the, cat, sat, on, ...]:
#   the block anchored at s[0] "the" drafts   cat  sat  in
#   the target's greedy tokens s[1:4] are     cat  sat  on    -> 2 drafts accepted ("in" != "on")
#   one target forward commits them plus its own "on": 3 tokens, the step's acceptance length (tau_walk's first 3);
#   the next block is anchored at s[3] "on"; tau is the mean length over all steps.

def accepted_prefix(drafts, truth):
    """Number of leading drafts equal to the truth (compared only where the truth exists)."""
    return next((n for n, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(len(drafts), len(truth)))

def tau_walk(continuation, drafts):
    """Acceptance lengths along continuation s (drafts[k] anchored at s[k]): longest equal prefix, then one token."""
    return walk_steps(continuation, lambda k, truth: accepted_prefix(drafts[k], truth))

def walk_steps(continuation, accept):
    """The walk: accept(k, truth) = accepted drafts of the block anchored at continuation[k] against the rest."""
    lengths, k = [], 0
    while k < len(continuation) - 1:
        lengths.append(accept(k, continuation[k + 1:]) + 1)  # the accepted drafts and the target's own token
        k += lengths[-1]
    return lengths

@torch.no_grad()
def draft_every_anchor(drafter, target, context_features, ids, first, budget=None, rule=None, temperature=0.0):
    """The training-mode forward at every anchor a = first..S-2 of ids (1, S), each seeing context < a (features (1,
    S, m*D)), through the draft rule (drafter.draft, or trees' top-K) given the true tokens (n, B): drafts (S-1-first,
    B-1), row k anchored at first+k, and the rule's tensors, rows alike."""
    cfg, rule, dtype, B = drafter.cfg, rule or drafter.draft, drafter.fc.weight.dtype, drafter.cfg.block_size
    context_features, ids, chunks = anchor_chunks(drafter, context_features, ids, first, budget)  # bounded memory
    S, kv, out = context_features.shape[1], drafter.context_kv(context_features.to(dtype)), []  # kv: (1, S, hk, hd)
    for a, valid, n in chunks:  # anchors a (N,) at a time, the first n real
        x = embed_blocks(target, block_input_ids(ids, a[None], B, cfg.mask_token_id)).to(dtype)  # [tok[a], M, ..., M]
        h = drafter.blocks(x, a[None], valid[None], kv, S)                                # (1, N, B, D)
        logits = target.lm_head(h[0, :n, 1:].to(target.lm_head.weight.dtype))             # (n, B-1, V)
        true = ids[0, block_positions(a[:n], B).clamp(max=ids.shape[1] - 1)]                 # (n, B)
        out.append(rule(logits, h[0, :n, 1:], ids[0, a[:n]], true, temperature))          # (n, B-1), {name: ...}
    return torch.cat([d for d, _ in out]), {k: torch.cat([m[k] for _, m in out]) for k in out[0][1]}

@torch.no_grad()
def walk_continuation(drafter, target, prompt, continuation, features=None, B=None, trees=(), temperature=0.0):
    """One drafting pass walked every way, acceptance lengths {"tau": the draft rule's chain, "tree": {N: N-node tree
    verification}, each WALKS name}; the drafts, the rule's tensors (offsets 1..B-1). features default: target pass."""
    ids = torch.tensor([prompt + continuation], device=target.lm_head.weight.device)
    features = target.features(ids, drafter.cfg.target_layer_ids, labels=False)[0] if features is None else features
    tree, keep = import_tool("tree", "tree verification") if trees else None, (B or drafter.cfg.block_size) - 1
    rule = tree.rule(trees, target.vocab_size) if tree else None  # dflash_tools/tree.py: the chain's and a top-K
    drafts, more = draft_every_anchor(drafter, target, features, ids, len(prompt), rule=rule, temperature=temperature)
    drafts, more = drafts[:, :keep].tolist(), {k: v[:, :keep] for k, v in more.items()}
    walks = {k: tau_walk(continuation, more[k].tolist()) for k in getattr(drafter, "WALKS", ()) if k in more}
    walks["tree"] = tree.walks(continuation, more, trees) if tree else {}
    return {"tau": tau_walk(continuation, drafts), **walks}, drafts, more

# -----------------------------------------------------------------------------
# Training: the step and the loop (the drafter's build, AdamW, DDP and compile: build_drafter in Part III)

def lr_at(step, total_steps, lr, warmup_ratio):
    """Linear warmup over warmup_ratio of the run, then cosine decay to 0."""
    warmup = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

class SFT:
    """The method's stage: each micro-batch's anchors, weights, CE. plan(inp, micro_batches) -> [(shares {name: part of
    a normaliser}, work)]; loss(inp, mb, work, totals) -> (loss / global totals, block_loss's stats); after(stats)"""
    def plan(self, inp, micro_batches):
        for mb in micro_batches:
            a, v = batch_anchors(mb, inp.num_anchors)
            w = loss_weights(a, v, mb["loss_mask"], inp.cfg.block_size, inp.gamma)
            yield {"w": (inp.loss_kw.get("loss") or CE()).normaliser(w)}, (a, v, w)

    def loss(self, inp, mb, work, totals):
        return dflash_loss(inp.model, inp.cfg, inp.target, mb, *work, weight_total=totals["w"], **inp.loss_kw)

def train_step(model, optimizer, target, cfg, micro, lr, num_anchors, grad_clip, world, gamma, stage=SFT(), **loss_kw):
    """One optimizer step over the micro-batches -> stats summed over ranks, grad norm, whether the update was taken (a
    non-finite one is skipped on every rank). The stage plans first: each micro-step divides by global normalisers."""
    device, inp = target.lm_head.weight.device, StepInputs(model, target, cfg, num_anchors, gamma, loss_kw)
    plans, total = list(stage.plan(inp, micro)), None
    totals = {k: sum(shares[k] for shares, _ in plans).to(device) for k in plans[0][0]}
    totals = {k: v / world for k, v in all_reduce_sum(totals, world).items()}  # DDP averages gradients: undo it
    for m, (mb, (_, work)) in enumerate(zip(micro, plans)):
        # no gradient all-reduce until the last micro-step, around forward *and* backward
        with model.no_sync() if world > 1 and m < len(micro) - 1 else nullcontext():
            out, stats = stage.loss(inp, mb, work, totals)
            out.backward()
        total = add_stats(total, {**stats, "tokens": torch.tensor(float(mb["tokens"]), device=device)})
    total = all_reduce_sum(total, world)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    ok = torch.isfinite(total["ce_w"]) & torch.isfinite(grad_norm)  # a tensor: no host sync (the loop reads it)
    optimizer_step(optimizer, lr, ok)
    getattr(stage, "after", lambda stats: None)(total)
    return total, grad_norm, ok

def train(args):
    """A run: set-up (inputs checked, then target, data, drafter, resume), the loop, the end -> drafter, cfg, target"""
    # --- set-up: everything that can be checked without loading weights is checked first
    rank, world, device = setup_distributed(args.device)
    master = rank == 0
    say = (lambda *a: tqdm.write(" ".join(map(str, a)))) if master else (lambda *a: None)
    run = check_run(args, world, device, master)  # the drafter config, where to resume from, the data's digest
    trackers = start_trackers(args, run, master)  # before any weights load: a W&B login problem is one line
    target, trained_for = load_run_target(args, run, world, device)  # trained_for: what each checkpoint records
    train_samples, eval_samples = read_data(args, target, say, run.cfg)
    batches = Batches(train_samples, args.batch_size, args.grad_accum, rank, world, args.seed,
                      getattr(target.tokenizer, "pad_token_id", None) or 0)
    total_steps = args.max_steps or args.epochs * batches.steps_per_epoch
    check_resume(args.out, run, batches.global_batch, master)
    drafter, model, optimizer, loss_kw = build_drafter(args, run, target, world, device, say)  # new or resumed
    walk = held_out_walk(target, eval_samples, args.eval_walk_prompts, args.eval_walk_tokens, rank, world, say)
    os.makedirs(args.out, exist_ok=True)
    say(run_summary(args, target, total_steps, batches.global_batch, world, device))

    out = RunOutputs(args, run, target, trained_for, drafter, optimizer, batches, eval_samples, walk, loss_kw,
                     trackers, rank, world, device, say)  # logs, metrics, held-out evaluations, checkpoints

    # --- the loop
    step = start = run.state["step"] if run.state else 0
    step_fn = partial(train_step, stage=run.stage.Stage(args, run.stage_state)) if run.stage else train_step
    if step == 0:
        out.held_out(0)  # the held-out loss, tau estimate (accuracy_stats) and walked tau of the untrained drafter
    stopped = False
    plugins = [run.variant, run.stage, args.loss != "ce" and loss_plugin(args.loss)[0]]  # an exception in one: a line
    with StopFlag(args.out, say, plugins) as stop, progress_bar(total_steps, step, master, args) as bar:
        while step < total_steps and not stopped:
            t0, lr, stop.step = time.time(), lr_at(step, total_steps, args.lr, args.warmup_ratio), step + 1
            micro = [batches.get(step, m) for m in range(args.grad_accum)]
            total, grad_norm, ok = step_fn(model, optimizer, target, run.cfg, micro, lr, num_anchors(args),
                                           args.grad_clip, world, progress=(step, total_steps), **loss_kw)
            step += 1
            bar.update(1)
            out.seen(ok, total, grad_norm)  # read at the next log line or save: no host sync each step
            if step == start + 1:
                say(f"first step took {time.time() - t0:.1f}s (includes compilation when --compile is on)")
            if step % args.log_every == 0 or step == total_steps:
                out.log(step, total, lr, grad_norm, bar)  # loss, the tau estimate (accuracy_stats), acc@1, lr, ...
            if args.eval_every and step % args.eval_every == 0 and step != total_steps:
                out.held_out(step)
            stopped = any_rank(stop.requested, world, device)  # all ranks stop after the same step
            if stopped or (args.save_every and step % args.save_every == 0 and step != total_steps):
                out.save(step)
        if not stopped and step > start:  # --- the end (none if resumed done), under StopFlag: a signal keeps its save
            out.held_out(step)
            out.save(step)
    trackers.close()
    if world > 1:
        dist.destroy_process_group()
    if stopped:  # not done: a scheduler must not read an interrupted run as finished (the checkpoint resumes it)
        say(f"interrupted after step {step}: saved {args.out}/step_{step}; resume with the same command plus --resume")
        raise SystemExit(128 + (stop.signum or signal.SIGTERM))
    return drafter, run.cfg, target


# =============================================================================
# PART II. EXACT FAST PATHS
#
# What makes the method fast or bounded in memory without changing a number, each tested equal to the plain
# computation: dense attention (its masks, two parts, context spans), flex's compilation and padding, the chunked CE,
# the walk's chunking, yarn RoPE. A reader may skip this part.
# =============================================================================

def dense_masks(mask_mod, b, N, S, B, device):
    """The rule where dense scores are: block queries x S context keys (b, N, B, S), x own B keys (b, N, B, B)."""
    q_idx = torch.arange(N * B, device=device).view(N, B, 1)  # query n*B + i
    ctx_idx = torch.arange(S, device=device)                    # context key j
    own_idx = S + q_idx.view(N, 1, B)                           # block n's own keys: S + n*B + i'
    bi = torch.arange(b, device=device).view(b, 1, 1, 1)
    return mask_mod(bi, 0, q_idx, ctx_idx), mask_mod(bi, 0, q_idx, own_idx)

def fast_mask(mask_mod, attention, anchors, S, B):
    """build_masks' rule for a fast path: flex's BlockMask, or dense's pair of masks and context_spans"""
    b, N = anchors.shape
    if attention == "flex":
        compile_flex()  # (a no-op once a flex drafter was built; here for one switched to flex later)
        make = compiled_create_block_mask if anchors.is_cuda else create_block_mask  # compiling on CPU: slow
        return make(mask_mod, b, None, N * B, S + N * B, device=anchors.device)
    ctx_visible, own_visible = dense_masks(mask_mod, b, N, S, B, anchors.device)
    return ctx_visible, own_visible, context_spans(ctx_visible)

def fast_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    """Attention.forward's fast paths, the plain attention's numbers: q (b, N, B, h, hd), k/v_ctx (b, S, hk, hd),
    k/v_blk (b, N, B, hk, hd), mask: fast_mask's -> (b, N, B, h*hd)"""
    b, N, B, h, hd = q.shape
    if isinstance(mask, BlockMask):  # flex on CUDA skips the tiles the BlockMask hides
        out = compiled_flex_attention(*one_sequence(q, k_ctx, v_ctx, k_blk, v_blk), block_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(b, N, B, h * hd)
    ctx_visible, own_visible, spans = mask  # dense: each group of blocks against its span of the context, its own keys
    return torch.cat([two_part_attention(q[:, n0:n1], k_ctx[:, lo:hi], v_ctx[:, lo:hi], k_blk[:, n0:n1],
                                         v_blk[:, n0:n1], ctx_visible[:, n0:n1, :, lo:hi], own_visible[:, n0:n1])
                      for n0, n1, lo, hi in spans], 1).reshape(b, N, B, h * hd)

def two_part_attention(q, k_ctx, v_ctx, k_blk, v_blk, ctx_visible, own_visible):
    """Each block's queries attend to [context ; own block]: one softmax, two parts sharing the row max, the context
    not copied per block. q (b, N, B, h, hd), k/v_ctx (b, S, hk, hd), k/v_blk (b, N, B, hk, hd); all-masked rows: 0"""
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

CONTEXT_TILE = 256  # context keys per group of blocks in the dense path (context_spans)

def context_spans(ctx_visible):
    """~S / CONTEXT_TILE groups of blocks (n0, n1) with the context span [lo, hi) they see; compiled: one."""
    b, N, B, S = ctx_visible.shape
    G = min(N, S // CONTEXT_TILE)
    if G <= 1 or torch.compiler.is_compiling():
        return [(0, N, 0, S)]
    ends = [N * g // G for g in range(G + 1)]
    seen = torch.stack([ctx_visible[:, n0:n1].any((0, 1, 2)) for n0, n1 in zip(ends, ends[1:])])  # (G, S)
    lo = torch.where(seen.any(1), seen.int().argmax(1), 0)                       # first key seen (0 if none)
    hi = torch.where(seen.any(1), S - seen.flip(1).int().argmax(1), 0)           # one past the last
    return [(n0, n1, l, h) for n0, n1, l, h in zip(ends, ends[1:], lo.tolist(), hi.tolist())]

# flex_attention runs fused only when compiled, one kernel per shape: compiled once, when a flex drafter is built
# (not at import, which would cost every start ~4 s), with every flex input padded to padded_length().
compiled_flex_attention = compiled_create_block_mask = None

def compile_flex():
    global compiled_flex_attention, compiled_create_block_mask
    if compiled_flex_attention is None:  # a compile per (padded length, layer kind): past dynamo's 8 flex ran unfused
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # 256-bit CPU vectors: torch 2.13's CPU inductor computes flex wrong with AVX-512's (CUDA ignores cpp.*)
        compiled_flex_attention = torch.compile(flex_attention, dynamic=False, options={"cpp.simdlen": 256})
    if compiled_create_block_mask is None:
        compiled_create_block_mask = torch.compile(create_block_mask)

def padded_length(S):
    """The one padding rule for flex shapes: the next power of two, at least 128 (flex's tile size)."""
    return max(128, 1 << (S - 1).bit_length())

MEMORY_BUDGET = 2**27  # elements of the largest intermediate: a chunk of logits, or of drafted blocks in the walk

def vocab_chunk(vocab_size, budget=MEMORY_BUDGET):
    """Rows per chunk so one chunk of logits holds about `budget` floats: [tokens, V] logits never exist at once."""
    return max(1, budget // vocab_size)

def weighted_ce(hidden, lm_head, labels, weights, chunk=None, loss=None, final=None):
    """sum(w * CE) of the block tokens through the frozen lm_head and its stats; [tokens, V] never exists at once.
    loss: a --loss (CE.reweigh); final (b, N, B, D): the target's state f[a+i-1], if the loss asks."""
    loss, sel = loss or CE(), (weights.flatten() > 0).nonzero().squeeze(1)  # on the CPU in training: no device sync
    sel, weights = sel.to(hidden.device), weights.to(hidden.device)
    y, f = labels.flatten()[sel].clamp(min=0), None if final is None else final.reshape(-1, final.shape[-1])[sel]
    tl, logq, pred = ChunkedLMHead.apply(hidden.reshape(-1, hidden.shape[-1])[sel], lm_head.weight, lm_head.bias, y,
                                         chunk or vocab_chunk(lm_head.weight.shape[0]), loss, f)
    w, norm = loss.reweigh(weights, logq, sel)
    ce_w = (tl * w.flatten()[sel]).sum()
    valid, correct = weights > 0, torch.zeros(weights.numel(), dtype=torch.bool, device=hidden.device)
    correct[sel] = pred == y
    return ce_w, {"w": norm.detach(), "ce_w": ce_w.detach(), **accuracy_stats(correct.view_as(valid) & valid, valid)}

def loss_rows(hs, weight, bias, ys, grad: bool, loss, fs=None):  # fs: the target's rows, for a loss that asks
    """One chunk: per-token loss, log q(y), argmax and d(loss)/dh; compiled on CUDA, CE never holds fp32 logits."""
    logits = F.linear(hs.to(weight.dtype), weight, bias).float()                 # (chunk, V)
    lse = logits.logsumexp(-1)
    logq, pred, p = logits.gather(1, ys[:, None]).squeeze(1) - lse, logits.argmax(-1), None
    if type(loss).token_loss is not CE.token_loss:  # another loss: its gradient by autograd
        with torch.enable_grad():
            tl = loss.token_loss(logits.requires_grad_(grad), ys, *([] if fs is None else [
                F.linear(fs.to(weight.dtype), weight, bias).float()]))
            p = torch.autograd.grad(tl.sum(), logits)[0] if grad else None
        return tl.detach(), logq, pred, None if p is None else p.to(weight.dtype) @ weight
    if grad:  # the method's CE, -log q: its gradient in place, one (chunk, V) buffer, not three
        p = logits.sub_(lse[:, None]).exp_()
        p[torch.arange(len(ys), device=hs.device), ys] -= 1.0
        p = p.to(weight.dtype) @ weight
    return -logq, logq, pred, p

class ChunkedLMHead(torch.autograd.Function):
    """Per-token loss, log q(label), argmax of lm_head(h) in row chunks, d/dh formed in the same pass."""
    rows = staticmethod(loss_rows)  # build_drafter's torch.compile(loss_rows) when the drafter is compiled on CUDA

    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk, loss, f=None):  # f: the target's rows, if the loss asks
        T, want = h.shape[0], ctx.needs_input_grad[0]
        out, logq, pred = (torch.empty(T, dtype=d, device=h.device) for d in (torch.float, torch.float, torch.long))
        grad = torch.empty_like(h) if want else None
        for s in range(0, T, chunk):  # a chunk's (chunk, V) buffers are freed before the next ones are allocated
            c = slice(s, s + chunk)
            out[c], logq[c], pred[c], g = ChunkedLMHead.rows(h[c], weight, bias, labels[c], want, loss,
                                                             None if f is None else f[c])
            if want:
                grad[c] = g.to(h.dtype)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(logq, pred)
        return out, logq, pred

    @staticmethod
    def backward(ctx, grad_out, grad_logq, grad_pred):
        (grad,) = ctx.saved_tensors
        return grad * grad_out[:, None].to(grad.dtype), None, None, None, None, None, None

def anchor_chunks(drafter, context_features, ids, first, budget=None):
    """draft_every_anchor's anchors a = first..S-2 in chunks of bounded memory -> the context and ids (padded for
    flex's few compiled shapes: padding is never visible, j >= S > a), [(anchors (N,), valid (N,), n real)]"""
    flex, S = drafter.attention == "flex", ids.shape[1]
    anchors = torch.arange(first, S - 1, device=ids.device)
    if flex:  # the context padded by the one rule, anchors padded to whole chunks of at most padded_length(anchors)
        pad = padded_length(S) - S
        context_features, ids = F.pad(context_features, (0, 0, 0, pad)), F.pad(ids, (0, pad))
    S_ctx, chunks = context_features.shape[1], []
    chunk = min(anchors_per_chunk(drafter.cfg, S_ctx, drafter.attention, budget), padded_length(len(anchors)) if flex
                else S)
    for c in range(0, max(len(anchors), 1), chunk):  # (no anchor: one empty chunk, for the rule's empty tensors)
        a, n = anchors[c:c + chunk], min(chunk, len(anchors) - c)
        valid = torch.arange(chunk if flex else n, device=ids.device) < n  # flex: whole chunks, padding anchors at 0
        chunks.append((F.pad(a, (0, len(valid) - n)), valid, n))
    return context_features, ids, chunks

def anchors_per_chunk(cfg, S, attention, budget=None):
    """Blocks drafted at once so the MLP, logits and (dense) scores stay near `budget` elements."""
    B = cfg.block_size
    per_anchor = 3 * B * cfg.intermediate_size + B * cfg.vocab_size
    if attention != "flex":  # (plain's table also grows with the chunk: plain is for reading)
        per_anchor += 2 * (cfg.num_attention_heads + 1) * B * (S + B)
    return max(1, (budget or MEMORY_BUDGET) // per_anchor)

def yarn_inv_freq(cfg, inv_freq):
    """yarn as Hugging Face computes it: low frequencies / factor, high kept, a ramp between; cos/sin scale."""
    dim, base = cfg.head_dim, cfg.rope_theta
    s, max_pos = cfg.rope_scaling, cfg.max_position_embeddings
    original_max = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / original_max
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = (mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
                            if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))
    fits = lambda rotations: dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))  # noqa
    low, high = fits(s.get("beta_fast") or 32), fits(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention_factor)


# =============================================================================
# PART III. OPERATIONS
#
# What makes a DFlash run safe, and nothing of the method: one-line errors, config.json, atomic checkpoints and
# resume, the target, JSONL data with exact chat loss masks, signals and distributed set-up, the run's checks,
# metrics, the command line. Every input is checked once, here, where it enters; the method above trusts it.
# =============================================================================

# -----------------------------------------------------------------------------
# Bad input is one `error:` line and exit code 2 (run_main), never a traceback, and never a corrupted checkpoint

class DFlashError(Exception):
    """Bad input or a bad checkpoint; its message holds one problem per line."""

class Unreadable(Exception):  # (no DFlashError: what catches those, "corrupt", lets it through)
    """A file there that cannot be read here (the OS refuses it, its plug-in is untrusted or gone): one line, exit 2."""

def need(ok, message, kind=DFlashError):
    if not ok:
        raise kind(message)

def first_line(e):  # what a library says went wrong, short enough for one error line
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]

def run_main(fn, args):  # fn(args) as a command (dflash.py, eval.py, tools): one `error:` line per problem, exit 2
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # stderr is for errors and our own progress
    try:
        return fn(args)
    except (DFlashError, Unreadable) as e:
        if getattr(args, "debug", False) or os.environ.get("DFLASH_DEBUG"):
            raise
        print("\n".join(f"error: {line}" for line in str(e).splitlines()), file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C where no StopFlag saves (a run's start-up, eval.py): one line, 128 + SIGINT
        print("interrupted (SIGINT)", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)

def import_tool(name, why):  # dflash_tools/<name>.py (it imports dflash), where a flag, config or file asks for it
    try:
        return importlib.import_module(f"dflash_tools.{name}")
    except ModuleNotFoundError as e:
        if e.name not in ("dflash_tools", f"dflash_tools.{name}"):
            raise
        raise Unreadable(f"{why} needs dflash_tools/{name}.py; copy dflash_tools/ beside {sys.argv[0]}") from None

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dflash_tools")
sys.modules.setdefault("dflash", sys.modules[__name__])  # run as a script this is __main__: plug-ins import this one
TRUSTED = set()  # plug-ins outside dflash_tools/ that may be imported (a module, a real .py path): flags', or "*"
NAMED = {}  # architecture -> the module this command's --variant names: it reads checkpoints of that architecture

def plugin(spec, why):
    """A plug-in: dflash_tools/<spec>.py, or when TRUSTED a module or .py path (dflash_tools/plugins.py imports it)."""
    if re.fullmatch(r"\w+", spec) and os.path.isfile(os.path.join(TOOLS, f"{spec}.py")):
        return import_tool(spec, why)
    return import_tool("plugins", why).outside(spec, why)


# -----------------------------------------------------------------------------
# Drafter configs: their rules, and config.json in z-lab's layout as vLLM and SGLang read it

def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)

def default_target_layer_ids(num_target_layers, num_draft_layers):
    """Spread evenly from layer 1 to L-3: L=64, n=5 -> [1, 16, 31, 46, 61] (SGLang's rule too)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        return [L // 2]
    return [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]

def valid_target_layer_ids(L, n):  # the default if valid, else <= n layers evenly over 1..L-2 (L=4, n=5: [1, 2])
    ids, layers = default_target_layer_ids(L, n), list(range(1, L - 1)) or [0]
    if ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < L - 1:
        return ids
    return layers if n >= len(layers) else sorted({layers[round(i * (len(layers) - 1) / max(n - 1, 1))]
                                                   for i in range(n)})

def config_problems(c):  # every problem at once, one line each
    bad = [f"{k} must be a positive integer, got {getattr(c, k)!r}" for k in ("hidden_size", "intermediate_size",
           "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "block_size",
           "num_target_layers", "max_position_embeddings") if not (is_int(getattr(c, k)) and getattr(c, k) > 0)]
    if bad:  # the rules below compute with these
        return bad
    ids, types, W, m, V = c.target_layer_ids, c.layer_types, c.sliding_window, c.mask_token_id, c.vocab_size
    n, L, H, KV = c.num_hidden_layers, c.num_target_layers, c.num_attention_heads, c.num_key_value_heads
    ints = isinstance(ids, list) and len(ids) > 0 and all(is_int(t) for t in ids)
    lists = isinstance(types, list)
    known = lists and all(t in LAYER_TYPES.values() for t in types)
    real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf  # noqa: E731
    drafter = c.Drafter  # training calls forward, the walk and eval.py its parts context_kv and blocks: not forward
    return [msg for ok, msg in [(drafter.forward is DFlashDrafter.forward, f"{drafter.__name__} overrides forward, "
                                 f"which the walk and eval.py never call; override blocks (the final hidden state)"),
        (c.head_dim % 2 == 0, f"head_dim must be even (RoPE rotates pairs), got {c.head_dim}"),
        (c.block_size >= 2, f"block_size must be >= 2 (an anchor plus drafts), got {c.block_size}"),
        (H % KV == 0, f"num_attention_heads {H} % num_key_value_heads {KV} != 0; fix --num_heads or --num_kv_heads"),
        (is_int(m) and 0 <= m < V, f"mask_token_id {m!r} is outside the vocabulary [0, {V}); give an id in it"),
        (ints, f"target_layer_ids must be a non-empty list of layer indices, got {ids!r}"),
        (not ints or ids == sorted(set(ids)), f"target_layer_ids {ids} must be strictly increasing without duplicates"),
        (not ints or all(0 <= t < L for t in ids), f"target_layer_ids {ids} out of range for {L} decoder layers"),
        (known, f"layer_types must list full_attention or sliding_attention per layer, got {types!r}"),
        (not lists or len(types) == n, f"layer_types has {len(types) if lists else 0} entries; give {n}, one each"),
        (W is None or (is_int(W) and W >= 0), f"sliding_window must be null or an integer >= 0, got {W!r}"),
        (not lists or "sliding_attention" not in types or W, "layer_types has sliding layers; set sliding_window"),
        (real(c.rms_norm_eps), f"rms_norm_eps must be a positive finite number, got {c.rms_norm_eps!r}"),
        (real(c.rope_theta), f"rope_theta must be a positive finite number, got {c.rope_theta!r}"),
        (isinstance(c.attention_bias, bool), f"attention_bias must be true or false, got {c.attention_bias!r}"),
        (c.is_causal in (None, True, False), f"is_causal must be null, true or false, got {c.is_causal!r}"),
        (c.rope_scaling is None or isinstance(c.rope_scaling, dict)
         and c.rope_scaling.get("rope_type", c.rope_scaling.get("type")) == "yarn",
         f"rope_scaling {c.rope_scaling!r} is not supported (plain RoPE or yarn)")] if not ok]

def engine_problems(cfg):  # legal drafters one engine would serve as another drafter, each with the flag fixing it
    B, W, L, ids = cfg.block_size, cfg.sliding_window, cfg.num_target_layers, cfg.target_layer_ids
    both = [i for i in range(cfg.num_hidden_layers) if W is not None and cfg.layer_kind(i) == (False, W)]
    return [msg for ok, msg in [
        (not (both and B > W), f"layers {both} slide on both sides (is_causal false) with block_size {B} > "
         f"sliding_window {W}: SGLang windows the left only; pass --block_size {W} or --sliding_window {B}"),
        (ids[-1] != L - 1, f"target_layer_ids {ids} name the target's last layer {L - 1}, which SGLang cannot "
         f"capture; pass --target_layer_ids {','.join(map(str, sorted({min(t, L - 2) for t in ids})))}")] if not ok]

def config_to_json(cfg):  # z-lab's config.json layout, each layer's attention stated in every key vLLM and SGLang read
    need(not (bad := engine_problems(cfg)), "\n".join(bad))
    d = {k: v for k, v in asdict(cfg).items() if k in {f.name for f in fields(DFlashConfig)} and k != "is_causal"}
    d["rope_parameters"] = {**(cfg.rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    if not cfg.rope_scaling:  # transformers-4 readers (z-lab's code) look for rope_scaling
        d.pop("rope_scaling")
    kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
    causal, sliding = {c for c, _ in kinds}, any(w is not None for _, w in kinds)
    keys = cfg.dflash_config_keys()  # a variant's own fields, each under its name (plugins.py checks)
    if type(cfg) is not DFlashConfig:
        import_tool("plugins", f"{type(cfg).__name__}.dflash_config_keys()").check_config_keys(cfg, keys)
    said = {"is_causal": causal.pop()} if len(causal) == 1 else {}  # mixed: causal iff sliding, both engines' rule
    dc = {"mask_token_id": d.pop("mask_token_id"), "target_layer_ids": d.pop("target_layer_ids"),
          "num_target_layers": cfg.num_target_layers, "block_size": cfg.block_size, "use_swa": False,
          "sample_from_anchor": False, **({"causal": said["is_causal"]} if said else {}),
          **({"swa_window_size": cfg.sliding_window} if sliding else {}), **keys}
    module = getattr(sys.modules.get(type(cfg).__module__), "DFLASH_MODULE", None)  # a variant outside dflash_tools/
    return {"architectures": [cfg.architecture], **({"dflash_module": module} if module else {}), "model_type": "qwen3",
            "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": sliding, "attention_dropout": 0.0,
            **d, **said, "eagle_aux_hidden_state_layer_ids": [t + 1 for t in cfg.target_layer_ids], "dflash_config": dc}

def config_class(d, where="config.json"):
    """DFlashConfig, or the variant's config.json names (plugins.py: --variant's, its dflash_module, else the tool's)"""
    d = d if isinstance(d, dict) else {}
    if not (NAMED or os.path.isdir(TOOLS) or isinstance(d.get("dflash_module"), str)):  # no variant could be its
        return DFlashConfig
    return import_tool("plugins", f"{where} ({(d.get('architectures') or ['?'])[0]})").config_class(d, where)

def config_from_json(d, where="config.json"):  # ours if it writes back the same JSON, else by dflash_tools/engines.py
    try:
        cls, dc, rope = config_class(d, where), d["dflash_config"], dict(d["rope_parameters"])
        top = {f.name for f in fields(DFlashConfig)} - {"mask_token_id", "target_layer_ids"}
        kw = {k: (d if k in top else dc)[k] for k in (f.name for f in fields(cls)) if k in (d if k in top else dc)}
        kw.update(rope_theta=rope.pop("rope_theta"), rope_scaling=None if rope == {"rope_type": "default"} else rope,
                  mask_token_id=dc["mask_token_id"], target_layer_ids=dc["target_layer_ids"],
                  is_causal=d.get("is_causal"))
        cfg = cls(**kw)
        aside = {"torch_dtype": 0, "dflash_module": 0}  # whatever dtype it was saved in, wherever its module lived
        if {**config_to_json(cfg), **aside} == {**d, **aside}:
            return cfg
    except (DFlashError, KeyError, TypeError, AttributeError):
        pass
    if isinstance(d, dict):  # torch_dtype says how the writer stored the weights; other trainers write "None", ...
        d = {k: v for k, v in d.items() if k not in ("torch_dtype", "dtype")}
    return import_tool("engines", f"{where} (not this trainer's own layout)").config_from_json(d, where)

# -----------------------------------------------------------------------------
# Checkpoints: a drafter directory in the z-lab layout (config.json + model.safetensors, no "model." prefix);
# a training checkpoint <out>/step_N adds train_state.pt, and <out>/latest names the newest complete one

def expected_shapes(cfg):  # built on the meta device: no memory, no init
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in cfg.Drafter(cfg).state_dict().items()}

def read_json(path, what, missing=None):  # missing: the error when path is not there (else "cannot read" it)
    try:
        return json.loads(pathlib.Path(path).read_bytes())
    except OSError as e:  # refused by the OS (a permission, a directory): Unreadable, never "missing"
        need(not (missing and isinstance(e, FileNotFoundError)), missing)
        raise Unreadable(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise DFlashError(f"{path}: not valid JSON ({first_line(e)[:100]}); the {what} is corrupt") from None

def read_drafter_config(path):
    need(os.path.isdir(path), f"drafter directory {path!r} does not exist; give one with config.json and weights")
    cfg_path = os.path.join(path, "config.json")
    d = read_json(cfg_path, "drafter config", f"{path!r} has no config.json; give a DFlash drafter directory")
    arch = next((a for a in d.get("architectures") or [] if isinstance(a, str) and a.endswith((
        "ForCausalLM", "ForConditionalGeneration"))), None) if isinstance(d, dict) else None
    need(arch is None or "dflash_config" in d, f"{path} is a target model ({arch}), not a drafter; use it as --target")
    mask = os.path.join(path, "mask_embedding.pt")
    need(not os.path.exists(mask), f"{mask}: vLLM would use it as the mask token's embedding, SGLang not; remove it")
    return config_from_json(d, where=cfg_path)

def read_safetensors(path, load=True):  # {name: tensor} of model.safetensors or its shards (load=False: opens, a check)
    from safetensors import safe_open
    files, index = [os.path.join(path, "model.safetensors")], os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(files[0]):
        need(os.path.isfile(index), f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
        files = import_tool("engines", f"{index} (sharded weights)").shard_files(path, index)  # (ours are never)
    tensors = {}
    for file in files:
        try:  # safe_open rejects a missing, truncated or garbage file (it checks the header against the size)
            with safe_open(file, "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()} if load else {})
        except Exception as e:  # safetensors raises its own (Rust) error types; an OSError but "missing": the OS's
            need(isinstance(e, OSError) == isinstance(e, FileNotFoundError), f"cannot read {file}: {e}", Unreadable)
            raise DFlashError(f"{file}: unreadable safetensors ({first_line(e)}); the checkpoint is corrupt") from None
    return tensors

def load_drafter(path, device="cpu", dtype=torch.float32, attention="dense"):
    """Load a z-lab or our drafter directory strictly: every tensor present with its exact shape, nothing else."""
    cfg = read_drafter_config(path)
    tensors, expected = read_safetensors(path), expected_shapes(cfg)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    need(not missing, f"{path}: missing tensor {missing and missing[0]} ({len(missing)} in all); it is incomplete")
    need(not extra, f"{path}: unexpected tensor {extra and extra[0]}; remove it (keys have no 'model.' prefix)")
    wrong = [f"tensor {k} has shape {tuple(tensors[k].shape)}, expected {s}" for k, s in expected.items()
             if tuple(tensors[k].shape) != s]
    need(not wrong, f"{path}: {wrong and wrong[0]}; the weights do not fit config.json's sizes and target_layer_ids")
    bad = next((k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()), None)
    need(bad is None, f"{path}: tensor {bad} holds NaN or inf (a diverged run?); use an earlier checkpoint")
    with torch.device("meta"):  # no random init of weights about to be overwritten (1.7B for Qwen3.6-27B)
        drafter = cfg.Drafter(cfg, attention)
    drafter.load_state_dict(tensors, strict=True, assign=True)
    drafter.inv_freq = rope_inv_freq(cfg)[0]  # the non-persistent RoPE buffer, rebuilt off the meta device
    return drafter.to(device=device, dtype=dtype)

def save_drafter(drafter, path, dtype=torch.bfloat16, extra_files=None):  # config.json, weights, extra_files: atomic
    from safetensors.torch import save_file
    final = path.rstrip("/")
    tmp, old = f"{final}.tmp{os.getpid()}", f"{final}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        config = {**config_to_json(drafter.cfg), "torch_dtype": str(dtype).removeprefix("torch.")}
        for name, obj in {"config.json": config, **(extra_files or {})}.items():
            if name.endswith(".json"):
                with open(os.path.join(tmp, name), "w") as f:
                    json.dump(obj, f, indent=2)
            else:
                torch.save(obj, os.path.join(tmp, name))
        os.umask(umask := os.umask(0o022))  # read it, then put it back: safetensors writes 0600, open() 0666 less umask
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):  # never a partial directory at path: between the renames the old one waits at `old`
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return path

TARGET_RECORD = "target.json"  # in our checkpoints: target_record(the target)

def target_record(target):  # name, fingerprint (a hash, as older records have it), probe (embeddings), a GGUF's sha256
    from safetensors.torch import save
    w, V, tc = target.embed.weight, target.vocab_size, target.model.config.get_text_config()
    h = hashlib.sha256(json.dumps([tc.model_type, V, target.hidden_size, target.num_layers]).encode())
    rows = w[torch.linspace(0, V - 1, min(256, V)).long().to(w.device)].detach().to("cpu", torch.bfloat16)
    h.update(save({"rows": rows.contiguous()}))
    rows, cols = (torch.linspace(0, k - 1, min(m, k)).long().to(w.device) for k, m in ((V, 64), (w.shape[1], 8)))
    probe = [round(float(x), 8) for x in w.detach()[rows][:, cols].float().flatten().tolist()]
    return {"target": target.name, "fingerprint": h.hexdigest()[:12], "probe": probe, **getattr(target, "source", {})}

def check_trained_against(path, record, what, allow=False):
    """Refuse (unless allow: then a note) a drafter whose TARGET_RECORD names another target; z-lab's have none."""
    f = os.path.join(path, TARGET_RECORD)
    saved = read_json(f, "target record") if os.path.isfile(f) else {}
    ok = isinstance(saved, dict) and isinstance(saved.get("fingerprint", ""), str)
    need(ok, f"{f} is not a target record (a JSON object with a string fingerprint); remove or restore it")
    a, b = saved.get("probe"), record["probe"]  # within bf16's rounding (2^-8 relative): the same target in any dtype
    near = isinstance(a, list) and len(a) == len(b) and all(
        isinstance(x, (int, float)) and abs(x - y) <= 2 ** -7 * max(abs(x), abs(y)) + 1e-6 for x, y in zip(a, b))
    old = not isinstance(a, list) and saved.get("fingerprint") == record["fingerprint"]  # records without a probe
    if saved.get("fingerprint") is None or near or old:
        return
    msg = f"{what} was trained against {saved.get('target')!r} ({saved['fingerprint']}), not {record['target']!r}"
    need(allow, f"{msg}; pass --allow_other_target to use it anyway")
    print(f"note: {msg} (--allow_other_target)", file=sys.stderr)

def resolve_drafter(path, flag="--drafter"):  # a drafter directory, or a hub id (owner/name) engines.py downloads once
    if os.path.exists(path):
        return path
    return import_tool("engines", f"{flag} {path!r} (no such directory: a hub id?)").download(path, flag)

def read_train_state(d):
    path = os.path.join(d, "train_state.pt")
    try:  # memory-mapped: cheap to read before anything else loads
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # missing, truncated zip, garbage pickle: corrupt; refused (the OS, unsafe): Unreadable
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))  # a type torch.load(weights_only) refuses
        why = f"it holds a {unsafe[1]}, which torch.load(weights_only) refuses" if unsafe else getattr(e, "strerror", 0)
        need(not why or isinstance(e, FileNotFoundError), f"cannot read {path}: {why}", Unreadable)  # (missing: bad)
        raise DFlashError(f"{path}: cannot read the training state ({first_line(e)}); the file is corrupt") from None
    s = state if isinstance(state, dict) else {}
    opt = s["optimizer"] if type(s.get("optimizer")) is dict else {}
    groups, count = opt.get("param_groups"), lambda k, least=0: is_int(s.get(k)) and s[k] >= least
    ok = {"step": count("step"), "global_batch": count("global_batch", 1), "bad_steps": count("bad_steps"),
          "args": type(s.get("args")) is dict, "optimizer": type(opt.get("state")) is dict and type(groups) is list
          and groups and all(type(g) is dict and type(g.get("params")) is list for g in groups)}
    bad = next((k for k, v in ok.items() if not v), None)
    need(not bad, f"{path}: not a training state (its {bad}: {str(s.get(bad, 'missing'))[:40]}); the file is corrupt")
    return state

def build_drafter(args, run, target, world, device, say=print):
    """The drafter (new, --init_from's or resumed), its AdamW, the model the loop calls, the loss's kwargs."""
    attention = args.attention if args.attention != "auto" else "flex" if device.type == "cuda" else "dense"
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    cfg, source = run.cfg, run.resume_dir or run.init_from
    drafter = load_drafter(source, device, attention=attention) if source else cfg.Drafter(cfg, attention).to(device)
    if run.variant:  # the variant's own set-up from its flags (plugins.py: else DFlash's weights carried over)
        drafter = import_tool("plugins", "--variant").prepare(run.variant, drafter, cfg, args)
    if not source and target.lm_head.weight is target.embed.weight:  # tied (Llama-3.2, Qwen3-0.6B..4B, Gemma3)
        start_off_mask(drafter, target)
        say("tied embeddings: the new drafter's final norm starts off the mask token's row (start_off_mask)")
    drafter.grad_checkpoint, optimizer = args.grad_checkpoint, make_optimizer(drafter, args, run, world, device, say)
    drafter.train()  # DDP is compiled with the drafter: the gradient all-reduce overlaps the backward (DDPOptimizer)
    model = drafter if world == 1 else torch.nn.parallel.DistributedDataParallel(  # (on its one device: no device_ids)
        drafter, gradient_as_bucket_view=True, broadcast_buffers=False)  # broadcast nothing: no buffer ever changes
    model = torch.compile(model) if compile_ else model
    if compile_ and device.type == "cuda":  # the chunked CE's pointwise work fused around its two matmuls
        ChunkedLMHead.rows = torch.compile(loss_rows, dynamic=True)
    say(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M params, {cfg.num_hidden_layers} layers, "
        f"block {cfg.block_size}, target_layer_ids {cfg.target_layer_ids}, layer_types {cfg.layer_types}; attention "
        f"{attention}, compile {compile_}")
    pad_to = padded_length(args.max_len) if attention == "flex" or compile_ else None
    loss_kw = dict(gamma=args.gamma, noise_std=args.noise_std, labels=args.labels, loss=loss_of(args), pad_to=pad_to,
                   raw_model=drafter)
    return drafter, model, optimizer, loss_kw

def make_optimizer(drafter, args, run, world, device, say):  # AdamW (--zero: split over the ranks), resumed
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=device.type == "cuda")
    if args.zero and world > 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(drafter.parameters(), optimizer_class=torch.optim.AdamW, **kw)
    else:
        optimizer = torch.optim.AdamW(drafter.parameters(), **kw)
    if run.state:
        try:  # the checkpoint's AdamW state, refused in one line unless it fits
            optimizer.load_state_dict(run.state["optimizer"])
            need(all(v.shape == p.shape for g in optimizer.param_groups for p in g["params"] for v in (
                optimizer.state.get(p) or {}).values() if torch.is_tensor(v) and v.dim()), "a moment of another shape")
        except (ValueError, KeyError, IndexError, TypeError, DFlashError) as e:
            raise DFlashError(f"cannot resume {run.resume_dir}: its optimizer state does not fit the drafter "
                              f"({first_line(e)}); the checkpoint is corrupt") from None
        say(f"resumed from {run.resume_dir} at step {run.state['step']}")
    return optimizer

def optimizer_step(optimizer, lr, ok):  # at lr, taken unless ok is false: a fused AdamW skips it with no host sync
    for g in optimizer.param_groups:
        g["lr"] = lr
    if fused := isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"]:
        optimizer.found_inf = (~ok).float()  # the fused kernel skips a non-finite step itself: no host sync
    if fused or ok:  # (else a host sync: --zero's or a CPU optimizer)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

def checkpoint_problem(d):  # None if d is a complete step_N checkpoint (each of its files opens), else what is wrong
    try:
        need(os.path.isdir(d), "it does not exist")
        read_drafter_config(d), read_train_state(d), read_safetensors(d, load=False)
    except DFlashError as e:  # (Unreadable is not corrupt: no resume passes over it)
        return str(e).splitlines()[0]

def step_of(name):
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(name)))
    return int(m[1]) if m else None

def complete_checkpoints(out):  # the complete step_N directories of out, the newest first
    steps = sorted({step_of(n) for n in (os.listdir(out) if os.path.isdir(out) else [])} - {None}, reverse=True)
    return [d for d in (os.path.join(out, f"step_{n}") for n in steps) if checkpoint_problem(d) is None]

def latest_checkpoint(out):  # the checkpoint <out>/latest names, checked a complete step_N of out; None: no latest
    latest, name = os.path.join(out, "latest"), ""
    if not os.path.isfile(latest):
        return None
    with suppress(OSError, UnicodeDecodeError), open(latest, "rb") as f:
        name = f.read(4096).decode().strip()
    need(re.fullmatch(r"step_\d+", name), f"{latest} is corrupt ({name[:60]!r} is no step_N directory of {out})")
    why = checkpoint_problem(os.path.join(out, name))
    need(why is None, f"{latest} names {os.path.join(out, name)}, which is incomplete or corrupt: {why}")
    return os.path.join(out, name)

def last_complete(out):  # what a run that stops now leaves behind: the checkpoint <out>/latest names (not checked)
    with suppress(OSError, UnicodeDecodeError), open(os.path.join(out, "latest")) as f:
        return f"the last complete checkpoint is {os.path.join(out, f.read(4096).strip())} (resume it with --resume)"
    return f"no complete checkpoint in {out} yet"

def remove_stale(d, names):  # killed writes' <name>.tmp<pid> (not beside .old<pid>), .old<pid> (<name> back), in d
    for m in [re.fullmatch(rf"({names})\.(tmp|old)(\d+)", n) for n in os.listdir(d) if os.path.isdir("/proc/self")]:
        p, other = m and os.path.join(d, m[0]), m and os.path.join(d, m[1] if m[2] == "old" else f"{m[1]}.old{m[3]}")
        if m and not os.path.exists(f"/proc/{m[3]}") and os.path.exists(other) == (m[2] == "old"):
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)

def write_atomic(path, text):  # written aside, synced, renamed: never a partial file (a failure leaves the old one)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        remove_stale(os.path.dirname(path) or ".", re.escape(os.path.basename(path)))
        with open(tmp, "w") as f:
            f.write(text), f.flush(), os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise

def keep_metrics(out, step):  # drop metrics.jsonl's records after step (-1: all) and lines a kill cut: logged anew
    if not os.path.isfile(path := os.path.join(out, "metrics.jsonl")):
        return
    lines, kept = [x for x in re.split(r"(?<=\n)", pathlib.Path(path).read_text()) if x.strip()], []  # as `for x in f`
    for line in lines:
        with suppress(ValueError, AttributeError, TypeError):  # not a record: dropped
            kept += [line] if json.loads(line).get("step", 0) <= step else []
    if len(kept) < len(lines):
        write_atomic(path, "".join(kept))

def save_checkpoint(out, step, drafter, optimizer, save_dtype, state, world=1, say=print, record=None):
    """On every rank: rank 0 writes <out>/step_<n>/ (drafter, train_state.pt, record), then switches <out>/latest."""
    from safetensors import SafetensorError
    if os.path.isdir(TOOLS):  # what torch.load(weights_only) refuses comes only from a plug-in's flag or state
        import_tool("plugins", "a plug-in's state").check_saveable(state, step)
    if world > 1:
        getattr(optimizer, "consolidate_state_dict", lambda to: None)(to=0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        d = os.path.join(out, f"step_{step}")
        try:
            save_drafter(drafter, d, save_dtype, extra_files={
                "train_state.pt": {"step": step, "optimizer": optimizer.state_dict(), **state},
                **({TARGET_RECORD: record} if record else {})})
            write_atomic(os.path.join(out, "latest"), os.path.basename(d) + "\n")
        except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, a quota: nothing partial, latest kept
            size = sum(t.numel() for t in drafter.state_dict().values()) * save_dtype.itemsize + sum(
                t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
            free, why = shutil.disk_usage(out).free, getattr(e, "strerror", None) or first_line(e)
            why = f"disk full: it needs about {size:,} bytes, {free:,} are free" if free < size else why  # (any writer)
            raise DFlashError(f"cannot write checkpoint {d} ({why}); {last_complete(out)}") from None
        say(f"saved {d}")
    if world > 1:
        dist.barrier()

# -----------------------------------------------------------------------------
# Loading the target (AutoModelForCausalLM)

def find_decoder(model):  # the text decoder: the module holding `layers` (a ModuleList), a `norm` and the embedding
    embed = model.get_input_embeddings()
    for _, m in model.named_modules():
        if (isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module)
                and any(c is embed for c in m.children())):
            return m
    family = model.config.model_type
    raise DFlashError(f"target family {family} is not supported; use one with a Llama-kind decoder (Qwen3, Mistral...)")

def load_tokenizer(name, trust_remote_code=False, **gguf):  # its tokenizer, or None (transformers 5 gives an empty one)
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **gguf)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if len(tokenizer) > max(1, len(tokenizer.all_special_ids)) else None

def no_kernel_advice(record):  # a logging filter: one function, so adding it again adds nothing
    return "falling back" not in record.getMessage()

def load_target(name, device="cpu", dtype=None, trust_remote_code=False, shard=False, tokenizer=None, **gguf):
    """A local path or hub id, frozen; bf16 on CUDA, else fp32, unless dtype says. device "meta": config.json alone.
    A local path without config.json is a GGUF (dflash_tools/gguf_target.py): back here with gguf_file and its
    tokenizer (converted once a process)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM, logging as hf_logging
    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    if torch.device(device).type != "cuda":  # transformers' advice to install causal_conv1d, fla: CUDA-only kernels
        hf_logging.get_logger("transformers.integrations.hub_kernels").addFilter(no_kernel_advice)  # (added once)
    if not (gguf or os.path.isfile(f"{name}/config.json")) and (os.path.exists(name) or name[:1] in "./~"):
        return import_tool("gguf_target", f"target {name!r} (a GGUF?)").load_target(name, device, dtype, shard)
    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **gguf)
        drafter = getattr(config, "dflash_config", None)
        need(not drafter, f"target {name!r} is a DFlash drafter; --target takes the model it drafts for")
        if str(device) == "meta":
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        else:
            model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype,
                                                         trust_remote_code=trust_remote_code, **gguf)
    except (OSError, ValueError, SafetensorError) as e:  # a missing, corrupt (truncated, garbage) or unknown target
        raise DFlashError(f"cannot load target {name!r}: {first_line(e)}") from None
    model.eval().requires_grad_(False)
    need(model.get_output_embeddings() is not None, f"target {name!r} has no lm_head; give a causal language model")
    target = Target(model, find_decoder(model), model.get_input_embeddings(), model.get_output_embeddings(),
                    tokenizer or load_tokenizer(name, trust_remote_code, **gguf), name)
    if shard:  # --shard_target: the decoder layers split over the ranks
        return import_tool("shard", "--shard_target").shard_target(target, device)
    model.to(device)
    return target

def check_compatible(cfg, target, where="drafter"):
    for what, ours, theirs in (("hidden size", cfg.hidden_size, target.hidden_size), ("vocab", cfg.vocab_size,
                               target.vocab_size), ("num_target_layers", cfg.num_target_layers, target.num_layers)):
        need(ours == theirs, f"{where} {what} {ours} != the target's {theirs}; it was made for another target")

@torch.no_grad()
def start_off_mask(drafter, target):
    """Under a tied lm_head a fresh drafter, whose output at a masked offset is mostly its input e_M, would draft
    the mask token everywhere (tau 1 for tens of steps). So its final norm's weight starts at g = 1 - (1.u/u.u) u,
    u = W_M * rmsnorm(e_M): the mask token's logit W_M . (g * rmsnorm(e_M)) is 0. Nothing else changes."""
    M = drafter.cfg.mask_token_id
    e = embed_blocks(target, torch.tensor([M], device=target.lm_head.weight.device))[0].float()  # (D,), as served
    u = (target.lm_head.weight[M].float() * e * torch.rsqrt(e.pow(2).mean() + drafter.cfg.rms_norm_eps)).cpu()
    if u @ u > 0:  # (a zero mask row gives a zero output: nothing to start off)
        g = torch.ones_like(u)
        drafter.norm.weight.copy_(g - (g @ u) / (u @ u) * u)

# -----------------------------------------------------------------------------
# Data: JSONL (other formats: dflash_tools/formats.py) -> (input_ids, loss_mask) per sample with exact chat loss
# masks; one sample per row (HF targets do not separate packed samples); the held-out split

def read_jsonl(path, what, hint="", opener=open):  # ("file:line", record) per non-blank line (gzip: formats.py's)
    need(os.path.isfile(path), f"{what} file {path!r} does not exist{hint}")
    try:
        with opener(path, "rb") as f:
            for n, line in enumerate(f, 1):
                try:
                    if line.strip():
                        yield f"{path}:{n}", json.loads(line.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise DFlashError(f"{path}:{n}: not UTF-8 text ({e.reason}); not a JSONL file?") from None
                except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser takes
                    raise DFlashError(f"{path}:{n}: not valid JSON ({first_line(e)})") from None
    except OSError as e:  # unreadable (a truncated or corrupt gzip stream: formats.py's)
        why = getattr(e, "strerror", None) or first_line(e)
        raise DFlashError(f"cannot read {what} file {path!r}: {why}") from None

def data_kind(path):  # what a data file that is not plain JSONL is, by its first bytes (None: JSONL)
    head = b""
    with suppress(OSError), open(path, "rb") as f:  # unreadable: None, and read_jsonl says so
        head = f.read(4096)
    return "Parquet" if head[:4] == b"PAR1" else "gzipped JSONL" if head[:2] == b"\x1f\x8b" else "a JSON array" if (
        head.lstrip()[:1] == b"[") else None

def read_records(path, what, hint=""):  # (where, record) each: JSONL here, else formats.py (JSON, Parquet, datasets)
    need(os.path.exists(path), f"{what} file {path!r} does not exist{hint}")
    need(os.path.isdir(path) or os.path.isfile(path), f"{what} file {path!r} is a device or a pipe, not a file{hint}")
    kind = "a directory" if os.path.isdir(path) else data_kind(path)  # None: JSONL
    formats = import_tool("formats", f"{what} {path!r} ({kind})") if kind else None
    yield from formats.read_records(path, what) if kind else read_jsonl(path, what, hint)

def check_ids(ids, vocab_size, where):
    need(isinstance(ids, list) and all(is_int(t) for t in ids), f"{where}: input_ids must be a list of integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None) if vocab_size else None
    need(bad is None, f"{where}: token id {bad} is outside the target's vocabulary [0, {vocab_size})")
    return ids

def template_kwargs(tokenizer, enable_thinking):  # enable_thinking when set and the chat template reads it
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"enable_thinking": enable_thinking} if enable_thinking is not None and "enable_thinking" in template else {}

def chat_sample(messages, tokenizer, kw, eos, where):
    """(ids, mask) as inference tokenizes it: each assistant turn after the text before it, mask 1 from its generation
    prompt's end through its eos; turns are found in the full rendering (Qwen3 drops earlier turns' think blocks)."""
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731

    def render(msgs, gen=False):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
        except Exception as e:  # the template's raise_exception, or a message it cannot render
            raise DFlashError(f"{where}: the chat template fails on messages[:{len(msgs)}]: {first_line(e)}") from None

    def ambiguous(k, why):  # the refusal of a turn whose mask cannot be read exactly
        return f"{where}: assistant turn {k}: {why}; ambiguous loss mask, make one sample per turn"

    def add(t, ones=0):  # tokens t, the first `ones` of them in the loss
        ids.extend(t)
        mask.extend([1] * ones + [0] * (len(t) - ones))
    full, turns = render(messages), [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    contexts = [render(messages[:k]) for k in turns] + [full]  # each must be a prefix of the full rendering
    ids, mask, pos = [], [], 0  # pos: where the text not yet tokenized starts
    for i, k in enumerate(turns):
        context, gen = contexts[i], render(messages[:k], gen=True)
        need(full.startswith(context), ambiguous(k, "the turns before it render differently in the whole conversation"))
        # the turn starts where the prompt and the full text differ (an earlier turn lacks the prompt's empty think
        # block), moved back to a token boundary of the prompt (an answer "<..." must not start inside "<think>")
        start = next((j for j, (a, b) in enumerate(zip(gen, full)) if a != b), min(len(gen), len(full)))
        gen_ids = encode(gen) if start < len(gen) else []
        while len(context) < start < len(gen) and (head := encode(gen[:start])) != gen_ids[:len(head)]:
            start -= 1
        need(start >= len(context), ambiguous(k, "the generation prompt rewrites the conversation before it"))
        add(encode(full[pos:start]))
        pos = len(contexts[i + 1])  # the turn ends at its first eos, searched up to the next turn's context
        turn = encode(full[start:pos])
        end = next((j + 1 for j, t in enumerate(turn) if t in eos), None)
        if end is None:  # no eos: the turn's own rendering ends it, if it is part of the whole
            own = render(messages[:k + 1])
            ok = full.startswith(own) and len(own) > start
            need(ok, ambiguous(k, f"no eos token {sorted(eos)} (the target's eos ids) ends it, nor its own rendering"))
            turn = encode(full[start:len(own)])
            add(turn, len(turn))
            turn, end = encode(full[len(own):pos]), 0
        add(turn, end)
    add(encode(full[pos:]))
    return ids, mask

def record_kind(record, where, tokenizer, kinds):  # the first of kinds whose fields the record sets, checked
    need(isinstance(record, dict), f"{where}: expected a JSON object, got {type(record).__name__}")
    kind = next((k for k in kinds if all(record.get(f) is not None for f in k.split("+"))), None)
    need(kind is not None, f"{where}: none of the known fields ({' | '.join(kinds)}); got keys {sorted(record)}")
    if kind == "input_ids":
        return kind
    need(tokenizer is not None, f"{where}: the target has no tokenizer; use pre-tokenized {{\"input_ids\": ...}} lines")
    if kind == "messages":
        messages = record["messages"]
        ok = isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)
        need(ok, f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
        need(tokenizer.chat_template, f"{where}: messages need a chat template, and the target's tokenizer has none")
    for f in () if kind == "messages" else kind.split("+"):
        need(isinstance(record[f], str), f"{where}: {f} must be a string")
        encodable(record[f], where, f)
    return kind

def encodable(text, where, what):  # text, refused if it holds a lone surrogate ("\ud800" is valid JSON, not UTF-8)
    bad = re.search("[\ud800-\udfff]+", text)
    need(not bad, f"{where}: {what} holds {bad and bad.group()!r}, a lone surrogate; fix or drop it")
    return text

def plain_messages(messages, where):  # contents as text: a string, null (a tool call's) or one OpenAI text part
    out = []
    for j, m in enumerate(messages):
        c = m.get("content")
        if isinstance(c, list):  # OpenAI's content parts: formats.py reads their one text part
            c = import_tool("formats", f"{where} (content parts)").text_part(c, f"{where}: messages[{j}].content")
        need(c is None or isinstance(c, str), f"{where}: messages[{j}].content is a {type(c).__name__}, not a string")
        out.append({**m, "content": c if c is None else encodable(c, where, f"messages[{j}].content")})
    return out

def chat_record(record, where):  # ShareGPT's {"conversations": [...]} as {"messages": [...]}; others as they are
    if isinstance(record, dict) and "conversations" in record and "messages" not in record:
        return import_tool("formats", f"{where} (ShareGPT conversations)").chat_record(record, where)
    return record

def encode_sample(record, tokenizer, enable_thinking=None, eos_ids=(), where="sample", vocab_size=None):
    """A record -> (input_ids, loss_mask), 1 on assistant turns (each to its eos), a response, a text, or as given."""
    record = chat_record(record, where)
    kind = record_kind(record, where, tokenizer, ("input_ids", "messages", "prompt+response", "text"))
    if kind == "input_ids":
        ids, mask = check_ids(record["input_ids"], vocab_size, where), record.get("loss_mask")
        mask = [1] * len(ids) if mask is None else mask
        need(isinstance(mask, list) and len(mask) == len(ids), f"{where}: loss_mask is not a list of {len(ids)} 0/1s")
        bad = next((m for m in mask if not (isinstance(m, (int, float)) and m in (0, 1))), 0)  # bools are ints
        need(bad == 0, f"{where}: loss_mask holds {bad!r}; it must hold 0 or 1 (numbers, not strings)")
        return ids, [int(m) for m in mask]
    if kind == "messages" or kind == "prompt+response" and tokenizer.chat_template:
        messages = record["messages"] if kind == "messages" else [{"role": "user", "content": record["prompt"]},
                                                                  {"role": "assistant", "content": record["response"]}]
        return chat_sample(plain_messages(messages, where), tokenizer, template_kwargs(tokenizer, enable_thinking),
                           {*eos_ids, tokenizer.eos_token_id} - {None}, where)
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    p, r = ([], encode(record["text"])) if kind == "text" else (encode(record["prompt"]), encode(record["response"]))
    return p + r, [0] * len(p) + [1] * len(r)

def load_samples(path, tokenizer, max_len, say=print, enable_thinking=None, eos_ids=(), vocab_size=None):
    """A data file's samples (encode_sample) cut to max_len; those with no usable anchor skipped and counted."""
    samples, lines, cut, hint = [], 0, [], "; pass --data with a JSONL or Parquet file or a save_to_disk directory"
    for lines, (where, rec) in enumerate(read_records(path, "data", hint), 1):
        ids, mask = encode_sample(rec, tokenizer, enable_thinking, eos_ids, where, vocab_size)  # checks input_ids
        if "input_ids" not in rec:  # a tokenizer may have more tokens than the target's embedding rows
            check_ids(ids, vocab_size, where)
        if len(anchor_candidates(mask[:max_len])):
            samples.append((ids[:max_len], mask[:max_len]))
        elif len(anchor_candidates(mask)):  # its response lies past max_len
            cut.append(len(ids) - max_len)
    need(lines, f"data file {path!r} is empty; it needs one JSON object per line (or per row)")
    why = ", ".join(f"{n} {what}" for n, what in ((len(cut), f"whose response --max_len {max_len} cut away (up to "
                    f"{max(cut or [0])} tokens over it; raise --max_len)"), (lines - len(samples) - len(cut), "with "
                    "fewer than 2 response tokens")) if n)
    need(samples, f"{path}: no usable samples ({lines} skipped: {why})")
    if lines > len(samples):
        say(f"{path}: skipped {lines - len(samples)} samples ({why}), kept {len(samples)}")
    return samples

EVAL_FLOOR = 16  # held-out samples at least, so a small data set still gets a meaningful held-out loss
EVAL_FRACTION = 0.01  # --eval_fraction's default

def eval_fraction(args):
    return EVAL_FRACTION if args.eval_fraction is None else args.eval_fraction

def held_out_count(n, eval_fraction):  # eval_fraction of n samples, at least EVAL_FLOOR, never more than half
    return min(max(int(n * eval_fraction), EVAL_FLOOR), n // 2) if eval_fraction > 0 else 0

def split_eval(samples, eval_fraction, seed):  # (train, eval): held_out_count samples held out, the same on every rank
    n_eval = held_out_count(len(samples), eval_fraction)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [samples[i] for i in order[n_eval:]], [samples[i] for i in order[:n_eval]]

# -----------------------------------------------------------------------------
# Signals, devices and distributed set-up

class StopFlag:  # `with StopFlag(out, say) as stop`: TERM/INT/HUP, Slurm's USR1, submitit's USR2 set stop.requested

    def __init__(self, out, say=print, plugins=()):  # plugins: modules whose exceptions end the run in one line
        self.out, self.say, self.requested, self.count, self.signum, self.step = out, say, False, 0, None, 0
        self.plugins = [m for m in plugins if m]

    def __enter__(self):
        sigs = {getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2") if hasattr(signal, n)}
        self.previous = {s: signal.signal(s, self._handler) for s in sigs if signal.getsignal(s) != signal.SIG_IGN}
        return self

    def __exit__(self, kind, e, tb):  # an exception in a plug-in's code: its traceback, then one line naming it
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if isinstance(e, Exception) and not isinstance(e, DFlashError) and self.plugins:
            import_tool("plugins", "a plug-in's error").blame(e, tb, self.plugins, self.step, self.out)

    def _handler(self, signum, frame):  # first: finish the step, save, exit; third: SystemExit 128+signal, latest kept
        self.count, self.requested, self.signum = self.count + 1, True, self.signum or signum
        name = signal.Signals(signum).name
        self.say(f"{name}: finishing this step, then saving a checkpoint" if self.count == 1 else
                 f"second signal ({name}): still saving after this step; a third abandons it" if self.count == 2 else
                 f"third signal ({name}): abandoning the checkpoint; {last_complete(self.out)}")
        if self.count > 2:
            raise SystemExit(128 + signum)

def pick_device(flag, local_rank=0):  # --device, or cuda:LOCAL_RANK when CUDA is there, else cpu
    try:
        device = torch.device(flag or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise DFlashError(f"--device {flag!r} is not a device name (cpu, cuda, cuda:N)") from None
    need(device.type in ("cpu", "cuda"), f"--device {flag!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need((device.index or 0) < n, f"--device {device} is not available here ({n} CUDA devices); pass another")
        torch.cuda.set_device(device)
    return device

def restart_count():  # how often torchrun --max_restarts has restarted this worker group (0: a first start)
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)

def setup_distributed(device_flag):  # (rank, world, device): one process, or DDP under torchrun (gloo or nccl)
    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        ok = env[k] is None or env[k].isdigit() and (k != "WORLD_SIZE" or int(env[k]) >= 1)
        need(ok, f"{k}={env[k]!r} is not a whole number{' >= 1' * (k == 'WORLD_SIZE')}; use torchrun, or unset it")
    rank, world, local = int(env["RANK"] or 0), int(env["WORLD_SIZE"] or 1), int(env["LOCAL_RANK"] or 0)
    if (rank, world, local) != (0, 1, 0):
        have, missing = [f"{k}={v}" for k, v in env.items() if v], [k for k, v in env.items() if v is None]
        need(not missing, f"{', '.join(missing)} unset beside {', '.join(have)}; use torchrun, or unset them all")
        need(rank < world, f"RANK {rank} is not below WORLD_SIZE {world}: no such rank; start with torchrun")
    device, get = pick_device(device_flag, local), os.environ.get
    if world == 1 or dist.is_initialized():  # the demo may have started it
        return rank, world, device
    if not get("TORCHELASTIC_RUN_ID") and rank == 0:
        print(f"rank 0: waiting for {world - 1} more ranks at {env['MASTER_ADDR']}:{env['MASTER_PORT']} (started "
              f"without torchrun; torch.distributed gives up after 30 min)", file=sys.stderr)
    # torchrun keeps one store across --max_restarts (unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with c10d): the dead
    # workers' keys in it make a restart's init fail or hang. On one node all workers share the restart count: new keys
    shared, nodes, kw = get("TORCHELASTIC_USE_AGENT_STORE") == "True", get("GROUP_WORLD_SIZE"), {}
    if shared and nodes == "1" and (restart := restart_count()):
        store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False)
        kw = dict(store=dist.PrefixStore(f"dflash_restart_{restart}", store), rank=rank, world_size=world)
    elif shared and nodes not in (None, "1") and rank == 0 and int(get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0:
        print("note: torchrun --max_restarts over several nodes: start it with --rdzv_backend=c10d and "
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a restart can hang in init_process_group", file=sys.stderr)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)
    return rank, world, device

def any_rank(flag, world, device):  # true on every rank when true on any (a stop signal may reach one rank only)
    t = torch.tensor(float(flag), device=device if world > 1 else "cpu")  # (one rank: no device round trip)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())

def broadcast(obj, world):  # rank 0's object on every rank (e.g. the data's digest: one rank reads the file)
    box = [obj]
    if world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]

# -----------------------------------------------------------------------------
# The run's checks and set-up: outputs, resume, the drafter config, data, the trackers

def check_writable_dir(d, what, subdirs=False, fix="give a writable path"):  # made; a file (subdirs: a dir) made in it
    try:
        os.makedirs(d, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=d)
        os.close(fd), os.remove(probe)
        if subdirs:
            os.rmdir(tempfile.mkdtemp(prefix=".probe", dir=d))
    except OSError as e:
        raise DFlashError(f"{what} cannot be written ({e.strerror}: {e.filename or d}); {fix}") from None

def check_out_dir(out):  # --out: a writable directory, with nothing but files where latest and metrics.jsonl go
    need(out, "--out is empty; give a directory")
    need(not os.path.exists(out) or os.path.isdir(out), f"--out {out!r} is a file, not a directory; give a directory")
    for p in (os.path.join(out, "latest"), metrics := os.path.join(out, "metrics.jsonl")):
        need(not os.path.exists(p) or os.path.isfile(p), f"{p} is in the way; remove it or give another --out")
    check_writable_dir(out, f"--out {out!r}", subdirs=True)
    try:  # metrics.jsonl is appended to: opened as the log will open it
        if os.path.exists(metrics):
            open(metrics, "a").close()
    except OSError as e:
        raise DFlashError(f"--out {out!r}: {metrics} cannot be appended to ({e.strerror})") from None

OUT_LOCKS = {}  # --out (real path) -> the open directory this process holds a lock on

def lock_out(out):  # one writer per --out from its first check: made, flocked till the process ends; remove_stale
    try:
        import fcntl
        os.makedirs(key := os.path.realpath(out), exist_ok=True)
        if key not in OUT_LOCKS:
            OUT_LOCKS[key] = os.open(key, os.O_RDONLY)
            fcntl.flock(OUT_LOCKS[key], fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove_stale(out, r"step_\d+")
    except BlockingIOError:
        os.close(OUT_LOCKS.pop(key))
        raise DFlashError(f"--out {out!r} is locked by another run; wait for it or give another --out") from None
    except (ImportError, OSError):
        pass

def earlier_run(out):  # what out holds of an earlier run: None (nothing), or a phrase naming its latest step
    names = os.listdir(out) if os.path.isdir(out) else []
    steps = [step_of(n) for n in names if step_of(n) is not None and os.path.isdir(os.path.join(out, n))]
    if steps or "latest" in names or os.path.isfile(m := os.path.join(out, "metrics.jsonl")) and os.path.getsize(m):
        return f"checkpoints up to step {max(steps)}" if steps else "a run without a complete checkpoint"

def path_digest(path):  # {size, sha256} of a data file (a save_to_disk dir: formats.py): a resume sees a change
    if os.path.isdir(path):
        return import_tool("formats", f"--data {path!r}").dir_digest(path)
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}

def resume_point(args, data_digest, master=True):  # (checkpoint, its train state) to continue, or (None, None): a start
    mode, out, why = args.resume or ("auto" if restart_count() > 0 else None), args.out, None
    try:
        d = latest_checkpoint(out) if mode else None
    except DFlashError as e:
        d, why = None, str(e)
    left = complete_checkpoints(out) if d is None and (mode or earlier_run(out)) else []  # every step_N's files opened
    fix = (f"{left[0]} is complete: write {os.path.basename(left[0])} into latest or pass --resume auto" if left else
           "no complete checkpoint is left: --resume auto starts anew, or give a new --out")
    need(not why or mode == "auto", f"--resume: {why}; {fix}")  # auto: the newest complete step_N, or a start
    d = left[0] if mode and left else d  # latest lost (a crash between a checkpoint and latest, a hand), or bad
    if master and mode and (why or left):
        how = f"continuing {d}, the newest complete one" if d else "it holds no complete checkpoint: starting anew"
        print(f"--resume: {why or f'{out} has no latest'}; {how}")
    if d is None:
        earlier = earlier_run(out)
        fix = "--resume auto starts anew in it, or give a new --out" if earlier else "drop --resume to start"
        need(mode != "must", f"--resume: no checkpoint in {out!r} (no {os.path.join(out, 'latest')}); {fix}")
        fix = "pass --resume to continue it" if left else "no complete checkpoint: pass --resume auto to start anew"
        need(mode or not earlier, f"--out {out!r} already holds a run ({earlier}); {fix}, or give a new --out")
        return None, None
    state = read_train_state(d)
    own = import_tool("plugins", "--loss/--stage").plugin_args(args) if args.loss != "ce" or args.stage else {}
    old = dict(state["args"]) if isinstance(state["args"], dict) else {}
    if old.get("eval_fraction", 0) is None:  # None: the default, as this run counts it
        old["eval_fraction"] = EVAL_FRACTION
    old.update(loss=state.get("loss", "ce"), stage=old.get("stage"), **{k: old.get(k) for k in own})
    now = {**vars(args), "eval_fraction": eval_fraction(args)}
    for k in ("seed", "max_len", "eval_fraction", "loss", "stage", *own):  # data order, split, objective
        was = old.get(k, now[k])
        need(was == now[k], f"cannot resume {d}: it was made with --{k} {was}, this run has --{k} {now[k]}; use {was}")
    same = not state.get("data") or not data_digest or state["data"] == data_digest
    need(same or args.allow_data_change, f"cannot resume {d}: --data {args.data} changed; pass --allow_data_change")
    return d, state

def target_rope(tc):  # (rope_theta, note) of the target's full-attention layers (Gemma3: sliding 1e4, full 1e6)
    rope = getattr(tc, "rope_parameters", None)
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        kind = "full_attention" if "full_attention" in rope else next(iter(rope))
        theta = float(rope[kind].get("rope_theta", 1e4))
        others = ", ".join(f"{k} {float(v.get('rope_theta', 1e4)):.0f}" for k, v in rope.items() if k != kind)
        return theta, f"drafter RoPE: rope_theta {theta:.0f}, the target's {kind} layers' (the others: {others})"
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    return float(theta if theta is not None else getattr(tc, "rope_theta", None) or 1e4), None

YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate")  # what yarn reads (never partial_rotary_factor, mrope_*)

def target_window(tc):  # (positions the target takes, its yarn or None): max_position_embeddings or a larger yarn reach
    native = getattr(tc, "max_position_embeddings", None) or 32768
    rope = getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma3)
        rope = rope.get("full_attention") or next(iter(rope.values()))
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return native, None
    yarn = {k: v for k, v in rope.items() if k in YARN_KEYS}
    reach = int(int(yarn.get("original_max_position_embeddings") or native) * float(yarn.get("factor") or 1))
    return max(native, reach), yarn if yarn.get("rope_type") == "yarn" else None

def check_lengths(samples, tc, where):  # every sample within target_window, else one line naming the longest
    (reach, yarn), longest = target_window(tc), max((len(ids) for ids, _ in samples), default=0)
    what, factor = ("yarn reach" if yarn else "max_position_embeddings"), math.ceil(longest / reach)
    fix = f"use --max_len {reach}" + ("" if yarn else f" or a yarn rope_parameters (factor {factor})")
    need(longest <= reach, f"{where}: a {longest}-token sample is past the target's {reach} positions ({what}); {fix}")

def new_drafter_config(target, num_draft_layers=5, block_size=16, mask_token_id=None, target_layer_ids=None,
                       sliding_window=2048, layer_types=None, num_heads=None, num_kv_heads=None, head_dim=None,
                       intermediate_size=None, say=print, max_len=None):
    """The target's geometry unless given (yarn past its window), n-1 sliding + 1 full, as z-lab's; problems at once."""
    tc = target.model.config.get_text_config()
    (rope_theta, rope_note), (reach, yarn) = target_rope(tc), target_window(tc)
    native = getattr(tc, "max_position_embeddings", None) or 32768
    if not (max_len and max_len > native and yarn):  # within the window: plain RoPE, the target's window
        reach, yarn = native, None
    n, L, problems = num_draft_layers or 5, target.num_layers, []  # None: the flag's default (said in --help)
    sliding_window, heads = 2048 if sliding_window is None else sliding_window, num_heads or tc.num_attention_heads
    mask_token_id = getattr(target.tokenizer, "mask_token_id", None) if mask_token_id is None else mask_token_id
    if mask_token_id is None:
        problems.append("no mask token (the tokenizer defines none); pass --mask_token_id, an id the data never uses")
    ids = target_layer_ids or default_target_layer_ids(L, n)
    if not target_layer_ids and len(set(ids)) < len(ids):
        good = ",".join(map(str, valid_target_layer_ids(L, n)))
        problems.append(f"the default target_layer_ids {ids} repeat a layer; pass --target_layer_ids {good}")
        ids = valid_target_layer_ids(L, n)
    layer_types = layer_types or ["sliding_attention" if sliding_window and i < n - 1 else "full_attention"
                                  for i in range(n)]
    try:
        cfg = DFlashConfig(
            hidden_size=target.hidden_size, intermediate_size=intermediate_size or tc.intermediate_size,
            num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=num_kv_heads or getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=head_dim or getattr(tc, "head_dim", None) or target.hidden_size // heads,
            vocab_size=target.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
            rope_scaling=yarn, max_position_embeddings=reach, block_size=block_size or 16,
            mask_token_id=0 if mask_token_id is None else mask_token_id, target_layer_ids=list(ids),
            num_target_layers=L, layer_types=layer_types, sliding_window=sliding_window or None)
        problems += engine_problems(cfg)  # before any weights load: check_run calls this on the meta target
    except DFlashError as e:
        problems += str(e).splitlines()
    need(not problems, "\n".join(problems))
    if rope_note:
        say(rope_note)
    return cfg

StepInputs = namedtuple("StepInputs", "model target cfg num_anchors gamma loss_kw")  # what a stage sees of a step
# what check_run found; stage_state: what a --stage keeps between steps, saved and resumed
RunSetup = namedtuple("RunSetup", "cfg resume_dir state data_digest init_from variant stage stage_state",
                      defaults=[None] * 8)  # variant, stage: their modules, or None

def check_run(args, world, device, master):
    """Set-up before any weights load: data, --out, resume point, drafter config (meta target; all problems at once)."""
    need(args.target, "--target is required (or run `python dflash.py` with no arguments for the demo)")
    need(args.data or args.plan, "--data is required (or run `python dflash.py` with no arguments for the demo)")
    data = [(p, flag) for p, flag in ((args.data, "--data"), (args.eval_data, "--eval_data")) if p and not args.plan]
    problems = []
    for p, flag in data:  # not JSONL: its package and kind, before any weights load (a pipe is never opened)
        if not (os.path.isfile(p) or os.path.isdir(p)):
            what = "is not a regular file (a pipe?)" if os.path.exists(p) else "does not exist"
            problems.append(f"data file {p!r} {what}; pass {flag} with a JSONL or Parquet file or a save_to_disk dir")
        elif os.path.isdir(p) or data_kind(p):
            import_tool("formats", f"{flag} {p!r}").check_readable(p, flag, args.out)
    if len(data) == 2 and not problems and os.path.samefile(args.data, args.eval_data):
        problems.append(f"--eval_data {args.eval_data} is --data itself; give other data, or drop --eval_data")
    if args.eval_data and args.eval_fraction:
        problems.append(f"--eval_fraction {args.eval_fraction} splits --data, --eval_data replaces it; drop one")
    if device.type == "cpu" and not args.plan and args.dtype not in ("auto", "fp32"):
        problems.append(f"--dtype {args.dtype}: on the CPU the drafter trains in fp32; drop --dtype or pass fp32")
    if device.type == "cpu" and not args.plan and args.attention == "flex":
        problems.append("--attention flex: FlexAttention has no backward pass on the CPU; drop --attention")
    if not args.plan:  # rank 0 is --out's one writer from the first check that writes, before it (--plan writes none)
        lock_out(args.out) if master else None
        check_out_dir(args.out)
        if report_to(args):
            import_tool("trackers", "--report_to").check_trackers(report_to(args), args.out)
    readable = not args.plan and not problems and (os.path.isfile(args.data) or os.path.isdir(args.data))  # no pipe
    data_digest = broadcast(path_digest(args.data) if master and readable else None, world)
    resume_dir, state = resume_point(args, data_digest, master) if not args.plan else (None, None)
    init_from = resolve_drafter(args.init_from, "--init_from") if args.init_from else None
    plan = import_tool("plan", "--plan") if args.plan else None  # a missing extra first: these flags need one
    stage = plugin(args.stage, f"--stage {args.stage}") if args.stage else None
    getattr(stage, "check", lambda a: None)(args)
    if args.eval_walk_tree_budget:  # its own checks
        problems += import_tool("tree", "--eval_walk_tree_budget").problems(args)
    meta = load_target(args.target, "meta", DTYPES[args.dtype], args.trust_remote_code)
    cfg = variant = None
    given = {k: getattr(args, k) for k in DRAFTER_FLAGS if getattr(args, k) is not None}
    try:
        cfg = read_drafter_config(init_from) if init_from else new_drafter_config(
            meta, **given, say=print if master else lambda *a: None, max_len=args.max_len)
        for k, v in given.items():  # --init_from's drafter keeps its own geometry
            same = not init_from or v == (getattr(cfg, DRAFTER_FLAGS[k]) or (0 if k == "sliding_window" else None))
            need(same, f"--{k} {v}: --init_from {args.init_from} has its own; drop --{k} or --init_from")
        spec = "dflash2" if args.dflash2 else args.variant  # else --init_from's own variant, if any
        if spec or type(cfg) is not DFlashConfig:  # the variant's module, its flags' defaults, its Config
            variant, cfg = import_tool("plugins", f"--variant {spec}").configure(spec, cfg, args)
        check_compatible(cfg, meta), config_to_json(cfg)  # config.json holds every field (dflash_config_keys)
    except (DFlashError, Unreadable) as e:
        problems += str(e).splitlines()
    need(not problems, "\n".join(problems))
    if plan or (device.type == "cuda" and os.path.isdir(TOOLS)):
        import_tool("plan", "--plan").memory_plan(vars(args), asdict(cfg), expected_shapes(cfg), meta, world, device)
    if args.shard_target and world == 1 and master:
        print("--shard_target: one process, nothing to shard over; the target stays whole (it needs torchrun)")
    state_of_stage = (state or {}).get("stage_state", {})
    return RunSetup(cfg, resume_dir, state, data_digest, init_from, variant, stage, state_of_stage)

def check_resume(out, run, global_batch, master):  # this run's drafter and global batch; metrics cut back to its step
    d, state = run.resume_dir, run.state
    if state:
        saved = read_drafter_config(d)
        if saved.architecture != run.cfg.architecture:  # a variant's checkpoint, or a variant's run (plugins.py)
            import_tool("plugins", f"--resume {d}").other_architecture(d, saved, run.cfg)
        for k, v in asdict(run.cfg).items():
            was = getattr(saved, k)
            need(was == v, f"cannot resume {d}: it has {k}={was}, this run {v}; use its flags or a new --out")
        b, n = state["global_batch"], global_batch
        need(b == n, f"cannot resume {d}: global batch was {b}, now {n}; keep batch_size x grad_accum x ranks the same")
    if master:
        keep_metrics(out, state["step"] if state else -1)

def read_data(args, target, say, cfg):  # (train, held-out samples), checked (mask token, lengths)
    kw = dict(say=say, enable_thinking=args.enable_thinking, eos_ids=target.eos_ids(), vocab_size=target.vocab_size)
    samples = load_samples(args.data, target.tokenizer, args.max_len, **kw)
    held = load_samples(args.eval_data, target.tokenizer, args.max_len, **kw) if args.eval_data else None
    train_samples, eval_samples = (samples, held) if held else split_eval(samples, eval_fraction(args), args.seed)
    where, n = "--data" + " and --eval_data" * bool(args.eval_data), cfg.mask_token_id
    used = sum(ids.count(n) for ids, _ in train_samples + eval_samples)
    need(not used, f"--mask_token_id {n} occurs {used} times in {where}; pass an id the data never uses")
    check_lengths(train_samples + eval_samples, target.model.config.get_text_config(), where)
    split = "" if args.eval_data else f" (--eval_fraction {eval_fraction(args)}: at least {EVAL_FLOOR}, at most half)"
    say(f"data: {len(train_samples)} train / {len(eval_samples)} held-out samples{split}")
    return train_samples, eval_samples

class NoTrackers:  # what the loop logs to without --report_to (dflash_tools/trackers.py has the real ones)
    wandb_id = None
    log = close = staticmethod(lambda *a: None)

def report_to(args):  # the trackers asked for, in order, each once (--report_to may repeat; none is none)
    return list(dict.fromkeys(n for names in args.report_to or [] for n in names))

def start_trackers(args, run, master):  # rank 0's --report_to trackers, going on a resumed run's
    if not (master and report_to(args)):
        return NoTrackers()
    return import_tool("trackers", "--report_to").Trackers(report_to(args), args, run)

def progress_bar(total_steps, step, master, args):  # rank 0's tqdm bar, on a terminal only (or --no_progress)
    off = not master or args.no_progress or not sys.stderr.isatty()
    return tqdm(total=total_steps, initial=step, desc="train", disable=off, dynamic_ncols=True)

def load_run_target(args, run, world, device):  # (target, its record): a drafter to go on must be trained on it
    shard = args.shard_target and world > 1
    target = import_tool("features", "--features").load_target(args, run, world, device) if args.features else \
        load_target(args.target, device, DTYPES[args.dtype], args.trust_remote_code, shard=shard)
    record = target_record(target)
    for d, what in ((run.init_from, f"--init_from {args.init_from}"), (run.resume_dir, f"checkpoint {run.resume_dir}")):
        if d:
            check_trained_against(d, record, what, args.allow_other_target)
    return target, record

def run_summary(args, target, total_steps, global_batch, world, device):
    """The line that opens training: the target, the steps, the ranks, and the loss with its parameter."""
    flags = flag_dests(loss_plugin(args.loss)[0]) if args.loss != "ce" else ["gamma"]
    param = ", ".join(f"{k} {getattr(args, k)}" for k in flags)
    return (f"training: target {args.target} ({target.num_layers} layers), {total_steps} steps of {global_batch} "
            f"samples, {world} rank(s) on {device.type}; loss {args.loss} ({param})")

class RunOutputs:
    """What train() writes at a step: the log line and metrics (rank 0: metrics.jsonl, --report_to's trackers),
    held-out evaluations, checkpoints; the steps not yet read are settled (non-finite ones counted) before each."""
    def __init__(self, args, run, target, trained_for, drafter, optimizer, batches, eval_samples, walk, loss_kw,
                 trackers, rank, world, device, say):
        vars(self).update({k: v for k, v in locals().items() if k != "self"})  # what train() set up, by its names
        self.bad_steps = run.state["bad_steps"] if run.state else 0  # consecutive non-finite steps
        self.unread, self.tokens, self.t_last = [], 0, time.time()  # unread: (ok, loss, grad, tokens) of steps

    def seen(self, ok, total, grad_norm):
        loss = total["ce_w"] / total["w"].clamp(1e-9)
        self.unread.append(torch.stack([ok, loss, grad_norm, total["tokens"]]).float())

    def settle(self, step):  # one host sync reads the unread steps: a non-finite one said, counted; tokens added
        for k, (ok, loss, grad, n) in enumerate(torch.stack(self.unread).tolist() if self.unread else [],
                                                step - len(self.unread) + 1):
            self.bad_steps, self.tokens = 0 if ok else self.bad_steps + 1, self.tokens + n
            if not ok:
                self.say(f"step {k}: non-finite loss {loss} / grad {grad}; skipped ({self.bad_steps})")
            need(self.bad_steps < self.args.max_bad_steps, f"{self.bad_steps} consecutive non-finite steps; lower "
                 f"--lr or check the data")
        self.unread.clear()

    def metrics(self, record):  # rank 0: metrics.jsonl, and the same record to each --report_to tracker
        if self.rank:
            return
        try:
            with open(os.path.join(self.args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise DFlashError(f"cannot append to {self.args.out}/metrics.jsonl ({e.strerror}); "
                              f"{last_complete(self.args.out)}") from None
        self.trackers.log(record)

    def log(self, step, total, lr, grad_norm, bar):  # the console line and its metrics record
        self.settle(step)
        m, tokens_per_s = summarize(total, self.drafter), self.tokens / max(time.time() - self.t_last, 1e-9)
        if self.device.type == "cuda":
            mem = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:  # the process's peak resident memory (resource: POSIX only, imported where it is read)
            import resource
            mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.say(f"step {step}: loss {m['loss']:.4f}  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}  lr {lr:.2e}  "
                 f"grad {grad_norm.item():.2f}  {tokens_per_s:,.0f} tok/s  peak {mem:,.0f} MB" + said(figures(m)))
        self.metrics({"step": step, "loss": m["loss"], "loss_type": self.args.loss, "tau": m["tau"], "acc": m["acc"],
                      "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_s": tokens_per_s, "peak_mb": mem,
                      **figures(m)})
        bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}")
        self.t_last, self.tokens = time.time(), 0

    def held_out(self, step):  # the held-out loss and tau estimate (evaluate), the walked tau (walk_tau)
        args, drafter, target, samples = self.args, self.drafter, self.target, self.eval_samples
        if not samples:
            return
        drafter.eval()
        m = evaluate(drafter, target, samples, args.batch_size, num_anchors(args), self.batches.pad_id, args.seed,
                     self.rank, self.world, **self.loss_kw)
        walked, acceptance, others = walk_tau(drafter, target, self.walk, self.world, args.eval_walk_tree_budget)
        drafter.train()
        others = {f"eval_walk_{k}_tau": v for k, v in others.items()}
        self.say(f"step {step}: eval loss {m['loss']:.4f} ({args.loss})  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}"
                 + (f"  walked tau {walked:.3f}" if walked is not None else "") + said({**figures(m), **others}))
        walk = {"eval_walk_acceptance": acceptance, "measured": measurement(target.tokenizer, args.enable_thinking,
                args.eval_walk_tokens, walk_prompts(samples, args.eval_walk_prompts))} if walked is not None else {}
        self.metrics({"step": step, "eval_loss": m["loss"], "loss_type": args.loss, "eval_tau": m["tau"],
                      "eval_acc": m["acc"], "eval_walk_tau": walked, **others, **walk, **figures(m, "eval_")})
        self.t_last = time.time() if step == 0 else self.t_last  # tokens/s: training's, from after the first eval

    def save(self, step):
        self.settle(step)
        args, run = self.args, self.run
        save_checkpoint(args.out, step, self.drafter, self.optimizer, DTYPES[args.save_dtype], {
            "args": vars(args), "global_batch": self.batches.global_batch, "bad_steps": self.bad_steps,
            "data": run.data_digest, "loss": args.loss, "stage_state": run.stage_state,
            "wandb_id": self.trackers.wandb_id}, self.world, self.say, self.trained_for)

def summarize(stats, drafter=None):
    """Global metrics from summed numerators and denominators (exact, not a mean of means)."""
    acc = (stats["correct"] / stats["count"].clamp(min=1)).tolist()
    return {"loss": (stats["ce_w"] / stats["w"].clamp(min=1e-9)).item(),
            "tau": 1.0 + (stats["accepted"] / stats["blocks"].clamp(min=1)).item(), "acc": acc[1:],
            **(drafter.summary(stats) if drafter is not None else {})}

def figures(m, prefix=""):  # a variant's own figures of summarize's m (beyond loss, tau, acc), as logged
    return {prefix + k: v for k, v in m.items() if k not in ("loss", "tau", "acc")}

def said(extra):  # a variant's figures on the console: (name value, ...), numbers only
    shown = [f"{k} {v:.4f}" for k, v in extra.items() if isinstance(v, float)]
    return f"  ({', '.join(shown)})" if shown else ""

# -----------------------------------------------------------------------------
# Batches: the same global batch for a step whatever the ranks; stats summed over them

def mix_seed(*keys):
    """A 63-bit seed from ints: randomness keyed by (seed, epoch, sample), the same on any split over ranks."""
    h = 1469598103934665603
    for k in keys:
        h = ((h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h

def num_anchors(args):  # a sample of max_len tokens has at most max_len - 1 anchors: more would only be padding
    return min(args.num_anchors, args.max_len - 1)

def collate(samples, pad_id, keys=None):  # right-padded (real positions kept); keys: a seed per sample (anchors, noise)
    ids, masks = zip(*samples)
    pad = lambda rows, v: nn.utils.rnn.pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], True, v)
    return {"input_ids": pad(ids, pad_id), "loss_mask": pad(masks, 0), "tokens": sum(map(len, ids)),
            "keys": list(range(len(samples))) if keys is None else keys}

class Batches:  # epoch-shuffled global batches; micro-step m of rank r its slice; the data position is the step

    def __init__(self, samples, batch_size, grad_accum, rank, world, seed, pad_id):
        self.samples, self.bs, self.rank, self.world = samples, batch_size, rank, world
        self.seed, self.pad_id, self.global_batch = seed, pad_id, batch_size * grad_accum * world
        self.steps_per_epoch = len(samples) // self.global_batch
        need(self.steps_per_epoch, f"{len(samples)} samples < one global batch; lower --batch_size or --grad_accum")
        self._order = (None, None)

    def get(self, step, micro):
        epoch, k = divmod(step, self.steps_per_epoch)
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.samples), generator=g).tolist())
        start = k * self.global_batch + (micro * self.world + self.rank) * self.bs
        idx = self._order[1][start:start + self.bs]
        return collate([self.samples[i] for i in idx], self.pad_id, [mix_seed(self.seed, epoch, i) for i in idx])

def add_stats(total, stats):
    return {k: total[k] + v for k, v in stats.items()} if total else dict(stats)

def all_reduce_sum(stats, world):
    for v in stats.values() if world > 1 else []:
        dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return stats

# Held-out evaluation at a step: the loss and tau estimate (evaluate), the walked tau (walk_tau), said and logged

def rank_share(items, rank, world):  # rank r's items (r, r+world, ...) and ceil(len/world), which a short rank pads to
    return items[rank::world], -(-len(items) // world)

def walk_prompts(samples, num_prompts):
    """The prompts (the tokens before the first loss token) of the first num_prompts samples that have one."""
    return [ids[:mask.index(1)] for ids, mask in samples if 1 in mask and mask.index(1) > 0][:num_prompts]

@torch.no_grad()
def greedy_continuation(target, prompt, max_new_tokens, eos):
    """The target's cached greedy generation to an eos (sharded: till all ranks end), no argmax-moving processor"""
    ids, eos = torch.tensor([prompt], device=target.lm_head.weight.device), sorted(eos)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=eos or None,
                                max_new_tokens=max_new_tokens, pad_token_id=eos[0] if eos else 0, min_new_tokens=0,
                                repetition_penalty=1.0, no_repeat_ngram_size=0, synced_gpus=target.sharded)
    return out[0, len(prompt):].tolist()

def held_out_walk(target, samples, num_prompts, num_tokens, rank=0, world=1, say=lambda *a: None):
    """This rank's share of the walk set (None when off): held-out prompts and the target's greedy continuations."""
    if not num_prompts:
        return None
    prompts = walk_prompts(samples, num_prompts)
    mine, per_rank = rank_share(prompts, rank, world)
    # sharded, a short rank generates an extra prompt too, then walks it as a one-token continuation (no step)
    extra = prompts[:per_rank - len(mine)] if target.sharded else []
    todo, walked, t0, read = mine + extra, [], time.time(), getattr(target, "walk_source", None)  # --features: read
    say(f"held-out walk: {read or 'generating the'} greedy continuations of {len(todo)} held-out prompts (<= "
        f"{num_tokens} tokens)")
    for p in todo:
        walked.append(greedy_continuation(target, p, num_tokens, target.eos_ids()))
        if len(walked) == 1 < len(todo) and not read:  # (a capture's are read, not generated: no estimate)
            say(f"held-out walk: the first took {time.time() - t0:.1f}s; ~{(time.time() - t0) * (len(todo) - 1):.0f}s "
                f"for the other {len(todo) - 1}")
    return mine + [p[:-1] for p in extra], walked[:len(mine)] + [p[-1:] for p in extra]

def acceptance_counts(lengths, B):  # steps per acceptance length L = 1..B; steps accepting >= k drafts, k = 1..B-1
    return [lengths.count(L) for L in range(1, B + 1)], [sum(n > k for n in lengths) for k in range(1, B)]

@torch.no_grad()
def walk_tau(drafter, target, walk, world, tree=0):
    """Pooled tau of every rank's walk, P(draft k accepted) for k = 1..B-1, {name: tau} of trees/WALKS; None: no walk"""
    if walk is None:
        return None, None, {}
    B, names = drafter.cfg.block_size, ["tree"] if tree else list(getattr(drafter, "WALKS", ()))
    total = torch.zeros(2 + 2 * len(names) + B - 1, device=target.lm_head.weight.device)  # (sum, steps) per walk; >= k
    for prompt, continuation in zip(*walk):
        w = walk_continuation(drafter, target, prompt, continuation, trees=(tree,) if tree else ())[0]
        runs = [w["tau"], *([w["tree"][tree]] if tree else [w[k] for k in names])]
        total += torch.tensor([x for r in runs for x in (sum(r), len(r))] + acceptance_counts(w["tau"], B)[1],
                              device=total.device)
    if world > 1:
        dist.all_reduce(total)
    tau = lambda i: (total[i] / total[i + 1]).item() if total[i + 1] > 0 else None  # noqa: E731
    acceptance = (total[2 + 2 * len(names):] / total[1]).tolist() if total[1] > 0 else None
    return tau(0), acceptance, {name: tau(2 * j) for j, name in enumerate(names, 1)}

@torch.no_grad()
def evaluate(drafter, target, samples, batch_size, num_anchors, pad_id, seed, rank, world, gamma, **loss_kw):
    """Held-out loss and tau estimate, summed over ranks; anchors keyed by the sample's index in the eval set."""
    cfg, total = drafter.cfg, None
    mine, per_rank = rank_share(list(range(len(samples))), rank, world)
    for s in range(0, per_rank, batch_size):
        idx = mine[s:s + batch_size]
        fill = batch_size - len(idx)  # empty rows (no valid anchor): one shape to compile, and a short rank's batches
        batch = collate([samples[i] for i in idx] + [([pad_id] * 2, [0] * 2)] * fill, pad_id,
                        keys=[mix_seed(seed, i) for i in idx] + [0] * fill)
        anchors, valid = batch_anchors(batch, num_anchors, salt=12345)
        w = loss_weights(anchors, valid, batch["loss_mask"], cfg.block_size, gamma)
        total = add_stats(total, dflash_loss(drafter, cfg, target, batch, anchors, valid, w,
                                             **{**loss_kw, "noise_std": 0, "progress": None})[1])
    return summarize(all_reduce_sum(total, world), drafter)

# How a walked tau was measured (all it depends on beyond the drafter), in records and reports: none compared blindly
def generation_prompt(tokenizer, kw):  # what the template adds to a user turn to start the assistant's (None: fails)
    try:
        base, full = (tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=g, **kw) for g in (False, True))
    except Exception:  # a template that refuses the probe turn: its text alone is hashed
        return None
    return full[len(base):] if full.startswith(base) else full

def measurement(tokenizer, enable_thinking, max_new_tokens, prompts=None):  # greedy (eval.py's measured: T > 0 too)
    template, thinking = getattr(tokenizer, "chat_template", None) or "", "n/a"
    if "enable_thinking" in template:  # unset: the template's default, found by the generation prompt it renders
        on = enable_thinking if enable_thinking is not None else next((v for v in (True, False) if generation_prompt(
            tokenizer, {}) == generation_prompt(tokenizer, {"enable_thinking": v})), None)
        thinking = {True: "on", False: "off", None: "template default"}[on]
    if template:
        prompt = generation_prompt(tokenizer, template_kwargs(tokenizer, enable_thinking))
        template = hashlib.sha256(f"{template}\n--- generation prompt ---\n{prompt}".encode()).hexdigest()[:12]
    m = {"thinking": thinking, "max_new_tokens": max_new_tokens, "serving": "greedy", "template": template or "none"}
    if prompts is not None:
        m["prompts"] = hashlib.sha256(json.dumps([[int(t) for t in p] for p in prompts]).encode()).hexdigest()[:12]
    return m

# -----------------------------------------------------------------------------
# Command line: every flag is checked once, here, where it enters

def number(kind, lo, open_lo=False, hi=None):
    """An argparse type: a finite int or float >= lo (> lo when open_lo; <= hi when given); `.text` says the rule."""
    name = "an integer" if kind is int else "a number"

    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {name}") from None
        if not (math.isfinite(v) and (v > lo if open_lo else v >= lo) and (hi is None or v <= hi)):
            raise argparse.ArgumentTypeError(f"{s} is outside its valid range: {parse.text}")
        return v
    parse.text = f"{name} {'>' if open_lo else '>='} {lo}" + f" and <= {hi}" * (hi is not None)
    return parse

def int_list(s):
    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None

LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention"}  # --layer_types names -> config names

def layer_type_list(s):  # --layer_types: comma-separated sliding|full (or their config names) -> the config names
    types = [LAYER_TYPES.get(t.strip(), t.strip()) for t in s.split(",")]
    if not set(types) <= set(LAYER_TYPES.values()):
        raise argparse.ArgumentTypeError(f"{s!r}: give a comma-separated list of sliding|full, one per drafter layer")
    return types

def tracker_list(s):  # --report_to: a comma list of none | tensorboard | wandb
    names = [n.strip() for n in s.split(",") if n.strip()]
    if not names or any(n not in ("none", "tensorboard", "wandb") for n in names):
        raise argparse.ArgumentTypeError(f"{s!r}: expected none, tensorboard or wandb (a comma list)")
    return [n for n in names if n != "none"]

class HelpFormatter(argparse.HelpFormatter):
    def _get_help_string(self, action):  # each default once: not where the help says it already ("auto: ...")
        h, v = action.help or "", None if action.default == argparse.SUPPRESS else action.default  # -h's: none
        hidden = v is None or v is False or v == [] or v == () or "default" in h or isinstance(v, str) and f"{v}:" in h
        return h if hidden or not action.option_strings else f"{h} (default: {v})"

class ArgumentParser(argparse.ArgumentParser):
    """argparse with defaults in --help, exact flags (not --max_step for --max_steps), errors one line, exit 2."""

    def __init__(self, **kw):
        super().__init__(formatter_class=HelpFormatter, allow_abbrev=False, **kw)

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        argv = sys.argv[1:] if args is None else list(args)
        if getattr(self, "plugins", False):  # dflash.py's: a fresh parser with the flags of the plug-ins argv names
            fresh = get_parser(plugins=False)
            try:
                for title, module in chosen_plugins(argv, every="-h" in argv or "--help" in argv):
                    module.add_flags(fresh.add_argument_group(title))
            except (DFlashError, Unreadable) as e:
                self.error(first_line(e))
            return fresh.parse_args(argv, namespace)
        args, extra = self.parse_known_args(argv, namespace)
        if extra:  # an unknown flag names the plug-in that has it, or the closest one
            bad = next((a.split("=")[0] for a in extra if a.startswith("--")), extra[0])
            if owner := next((title for title, m in chosen_plugins([], every=True) if bad[2:] in flag_dests(m)), 0):
                self.error(f"{bad} is a flag of {owner}; add {owner.split(' (')[0]} (or drop {bad})")
            close = difflib.get_close_matches(bad, [o for o in self._option_string_actions if o.startswith("--")], 1)
            fix = "--help lists the flags" + hasattr(self, "plugins") * (
                " (plug-in flags need their --variant/--loss/--stage/--features)")
            self.error(f"unknown flag {bad}; " + (f"did you mean {close[0]}?" if close else fix)
                       if bad.startswith("-") else f"unexpected argument {bad!r} (flags start with --)")
        return args

# Plug-ins: the contract. Each is one module. Its flag names it as a dflash_tools/ name, an importable module or a .py
# path; its optional add_flags(g) declares its flags with flag(g, ...), accepted only beside that flag. Bad input in one
# is `need(ok, "problem; fix")`: one error line (an exception in its code: a traceback, `error: plug-in M raised E`).
# What each kind supplies, hook by hook (a variant, a loss, a training stage, an on-policy divergence): the docstring
# of dflash_tools/plugins.py, through which every plug-in is found and imported.
def chosen_plugins(argv, every=False):
    """[(title, module)] of the plug-ins argv names (every: all dflash_tools/'), setting TRUSTED and NAMED to those."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--variant", "--loss", "--stage", "--features", "--dflash2", "--trust_variant_code"):
        p.add_argument(name, action="store_true" if name in ("--dflash2", "--trust_variant_code") else "store")
    a = p.parse_known_args(argv)[0]
    need(not (a.dflash2 and a.variant not in (None, "dflash2")), f"--dflash2 is --variant dflash2, not {a.variant}")
    loss = a.loss if a.loss and a.loss != "ce" else None
    given = {"--variant": "dflash2" if a.dflash2 else a.variant, "--stage": a.stage, "--features": a.features and
             "features", "--loss": (loss.rpartition(":")[0] or "losses") if loss else None}
    TRUSTED.clear(), NAMED.clear()
    TRUSTED.update({os.path.realpath(v) if v.endswith(".py") else v for v in given.values() if v} | (
        {"*"} if a.trust_variant_code else set()))
    named = sorted((f, m) for f, m in given.items() if m)
    if not (named or every and os.path.isdir(TOOLS)):
        return []
    why = f"--loss {loss}" if loss else " ".join(named[0]) if named else "--help"  # (no dflash_tools/: its error line)
    return import_tool("plugins", why).chosen(given, loss, every)

def loss_plugin(spec):  # (module, name) of --loss spec: a name in dflash_tools/losses.py, or MODULE_OR_PATH:name
    module, _, name = spec.rpartition(":")
    return plugin(module or "losses", f"--loss {spec}"), name

def loss_of(args):  # --loss's object: the method's CE, or a plug-in's LOSSES[name](args)
    module, name = loss_plugin(args.loss) if args.loss != "ce" else (None, None)
    return module.LOSSES[name](args) if module else CE()

class CE:
    """The method's loss as a --loss states it: per token of fp32 logits (T, V); weights; the global denominator."""
    def token_loss(self, logits, labels):
        return logits.logsumexp(-1) - logits.gather(1, labels[:, None]).squeeze(1)

    def weights(self, w, logq, valid):
        return w

    def normaliser(self, w):
        return w.sum()

    def reweigh(self, w, logq, sel):  # (weights, normaliser) of block weights w, from log q(label) at the tokens sel
        logq = torch.zeros_like(w).flatten().index_put((sel,), logq.to(w.dtype)).view_as(w)
        return self.weights(w, logq, w > 0), self.normaliser(w)

def flag_dests(module):  # the flags a plug-in's add_flags declares: {dest: default}
    p = argparse.ArgumentParser(add_help=False)
    getattr(module, "add_flags", lambda g: None)(p)
    return {a.dest: a.default for a in p._actions}

def flag(group, name, default=None, help="", kind=None, lo=0, open_lo=False, hi=None, **kw):
    """A flag, one line each: kind int or float gets number()'s range-checked type; the rest goes to add_argument."""
    if kind is not None:
        kw["type"] = number(kind, lo, open_lo, hi)
    group.add_argument(name, default=default, help=help, **kw)

TREE_BUDGET_MAX = 1024  # draft nodes a tree verification step sends the target: far above DDTree's
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
DRAFTER_FLAGS = {"num_draft_layers": "num_hidden_layers", **{k: k for k in ("block_size", "mask_token_id",
                 "target_layer_ids", "sliding_window", "layer_types")}, "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads", **{k: k for k in ("head_dim", "intermediate_size")}}  # -> field

def get_parser(plugins=True):  # plugins: parse_args adds the flags of the plug-ins argv names
    p = ArgumentParser(description="Train a DFlash block-diffusion drafter against a frozen target LLM.")
    p.plugins = plugins
    g = p.add_argument_group("run")
    flag(g, "--target", help="target model: a local directory or a hub id (loaded with AutoModelForCausalLM)")
    flag(g, "--data", help="JSONL/JSON/Parquet/save_to_disk of messages|conversations|prompt+response|text|input_ids")
    flag(g, "--out", "out", "output directory for checkpoints and metrics.jsonl")
    flag(g, "--init_from", help="drafter directory (z-lab's or ours) or hub id (owner/name) to fine-tune from")
    flag(g, "--resume", nargs="?", const="must", choices=["must", "auto"], help="resume <out>/latest (auto: or start)")
    flag(g, "--allow_data_change", False, "with --resume: continue although --data changed", action="store_true")
    flag(g, "--allow_other_target", False, "use a drafter trained against another target", action="store_true")
    flag(g, "--demo", False, "the CPU demo (what runs with no arguments; needs dflash_tools/)", action="store_true")
    flag(g, "--variant", help="a drafter variant: a dflash_tools/ module (dflash2), a module or a .py path")
    flag(g, "--dflash2", False, "--variant dflash2 (--init_from DFlash: plus DFlash2's pieces)", action="store_true")
    flag(g, "--stage", help="a training stage (default: SFT): a dflash_tools/ module, a module or a .py path")
    flag(g, "--features", help="train from the target's features on disk (dflash_tools/features.py), no target layers")
    flag(g, "--trust_variant_code", False, "import the variant code a drafter's config.json names", action="store_true")
    g = p.add_argument_group("drafter geometry (new drafters; with --init_from only its own values)")
    flag(g, "--num_draft_layers", None, "drafter decoder layers (default: 5)", int, lo=1, hi=32)
    flag(g, "--block_size", None, "B: one anchor token + B-1 drafted tokens (default: 16)", int, lo=2, hi=256)
    flag(g, "--target_layer_ids", None, "comma list of target layers to read (default: from 1 to L-3)", type=int_list)
    flag(g, "--mask_token_id", None, "mask token id (default: the tokenizer's)", int)
    flag(g, "--sliding_window", None, "window of the sliding layers (0: no sliding layers; default: 2048)", int)
    flag(g, "--layer_types", None, "comma list of sliding|full (default: sliding but the last)", type=layer_type_list)
    flag(g, "--num_heads", None, "attention heads (default: the target's)", int, lo=1, hi=256)
    flag(g, "--num_kv_heads", None, "key/value heads (GQA; default: the target's)", int, lo=1, hi=256)
    flag(g, "--head_dim", None, "head dimension (even; default: the target's)", int, lo=2, hi=1024)
    flag(g, "--intermediate_size", None, "MLP width (default: the target's)", int, lo=1, hi=65536)
    g = p.add_argument_group("data and loss")
    flag(g, "--max_len", 3072, "truncate samples to this many tokens", int, lo=2)
    flag(g, "--enable_thinking", None, "passed to a chat template that reads it", action=argparse.BooleanOptionalAction)
    flag(g, "--show_data", 0, "print the first N encoded samples, loss spans in [[...]], then exit (0: train)", int)
    flag(g, "--eval_fraction", None, f"held-out part of --data, >= 16 rows (default: {EVAL_FRACTION})", float, hi=.5)
    flag(g, "--eval_data", help="held-out data, in any --data format (instead of --eval_fraction)")
    flag(g, "--num_anchors", 512, "anchors (blocks) per sequence", int, lo=1)
    flag(g, "--loss", "ce", "ce, a name in dflash_tools/losses.py (dpace*: D-PACE) or MODULE_OR_PATH.py:NAME")
    flag(g, "--gamma", 4.0, "--loss ce's decay: weight exp(-(i-1)/gamma) at block offset i", float, open_lo=True)
    flag(g, "--labels", "target", "target: the target's greedy token; data: the data token", choices=["target", "data"])
    flag(g, "--noise_std", 0.02, "Gaussian noise on the context features, relative to their RMS (0: off)", float)
    g = p.add_argument_group("optimisation")
    flag(g, "--batch_size", 1, "sequences per rank per micro-step", int, lo=1)
    flag(g, "--grad_accum", 4, "micro-steps per optimizer step", int, lo=1)
    flag(g, "--lr", 6e-4, "peak learning rate (AdamW)", float, open_lo=True)
    flag(g, "--warmup_ratio", 0.04, "linear warmup fraction, then cosine to 0", float, hi=1)
    flag(g, "--epochs", 6, "epochs (unless --max_steps)", int, lo=1)
    flag(g, "--max_steps", 0, "optimizer steps (0: from --epochs)", int)
    flag(g, "--grad_clip", 1.0, "gradient norm clip", float, open_lo=True)
    flag(g, "--weight_decay", 0.0, "AdamW weight decay", float)
    flag(g, "--max_bad_steps", 10, "stop after this many consecutive non-finite steps (seen when logging)", int, lo=1)
    g = p.add_argument_group("system")
    flag(g, "--compile", "auto", "torch.compile the drafter (auto: on for CUDA)", choices=["auto", "on", "off"])
    flag(g, "--attention", "auto", "attention path (auto: flex on CUDA, else dense; plain: Part I's plain attention "
         "and loss, to step through; memory quadratic in anchors)", choices=["auto", "flex", "dense", "plain"])
    flag(g, "--dtype", "auto", "target dtype (auto: bf16 on CUDA, fp32 on CPU)", choices=list(DTYPES))
    flag(g, "--save_dtype", "fp32", "checkpoint weights dtype (fp32 resumes exactly)", choices=["fp32", "bf16"])
    flag(g, "--device", None, "device (default: cuda:LOCAL_RANK if available, else cpu)")
    flag(g, "--trust_remote_code", False, "allow the target's custom code", action="store_true")
    flag(g, "--seed", 0, "random seed", int, hi=2 ** 32 - 1)
    flag(g, "--log_every", 10, "log every N steps", int, lo=1)
    flag(g, "--report_to", None, "also log to tensorboard|wandb|none (comma list)", action="append", type=tracker_list)
    flag(g, "--no_progress", False, "no progress bar (there is none unless stderr is a terminal)", action="store_true")
    flag(g, "--eval_every", 500, "held-out evaluation every N steps (0: only at the start and the end)", int)
    flag(g, "--eval_walk_prompts", 16, "held-out prompts for the exact walked tau at each eval (0: off)", int)
    flag(g, "--eval_walk_tokens", 64, "greedy continuation length of each walked prompt", int, lo=1)
    flag(g, "--eval_walk_tree_budget", 0, "also walk trees of this many nodes (0: off)", int, hi=TREE_BUDGET_MAX)
    flag(g, "--save_every", 1000, "checkpoint every N steps (0: only at the end)", int)
    flag(g, "--debug", False, "show tracebacks for input errors (or DFLASH_DEBUG=1)", action="store_true")
    g = p.add_argument_group("memory")
    flag(g, "--zero", False, "shard AdamW's state over the ranks (ZeroRedundancyOptimizer)", action="store_true")
    flag(g, "--shard_target", False, "split the target's layers over the ranks (FSDP2, torchrun)", action="store_true")
    flag(g, "--grad_checkpoint", False, "recompute each drafter layer in backward", action="store_true")
    flag(g, "--plan", False, "print the per-GPU memory plan, then exit (needs dflash_tools/)", action="store_true")
    flag(g, "--plan_world_size", None, "ranks to plan for (default: this run's)", int, lo=1)
    flag(g, "--plan_gpu_gb", None, "memory per GPU in GB to plan for (default: this machine's)", float, open_lo=True)
    return p

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)
    try:
        if args.demo or not argv:
            return run_main(lambda _: import_tool("demo", "the demo (dflash.py without arguments)").main(argv), args)
        if args.show_data:  # the loss masks of --data, before anything is spent on training
            return run_main(lambda a: import_tool("show_data", "--show_data").main(a), args)
        return run_main(train, args)
    finally:  # the --out lock ends with the run, also in a process that goes on (a notebook, the tests)
        while OUT_LOCKS:
            os.close(OUT_LOCKS.popitem()[1])


if __name__ == "__main__":
    main()
