"""
DFlash: train a block-diffusion speculative-decoding drafter against a frozen target LLM.

One file, top to bottom: drafter config -> drafter model -> attention visibility (the mask
rule) -> checkpoints in the z-lab layout -> target hooks -> data -> anchors, labels, noise,
the corrected loss -> training loop. The specification is DESIGN.md; the paper is
arXiv 2602.06036.

Quick start
    # CPU demo (no GPU, no hub): builds a tiny Qwen3.5-hybrid target on the Python stdlib,
    # trains a drafter with this very loop, measures tau with eval.py (< 10 min on 2 cores)
    python dflash.py

    # one GPU
    python dflash.py --target Qwen/Qwen3-8B --data train.jsonl --out runs/q3-8b --mask_token_id 151669 --sliding_window 0

    # 8 GPUs, one node (reproduces the z-lab Qwen3.6-27B-DFlash geometry by default)
    torchrun --nproc_per_node=8 dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl \
        --out runs/q36-27b --mask_token_id 248070

    # several nodes: the standard torchrun flags, nothing else
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD:29500 \
        dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl --out runs/q36-27b --mask_token_id 248070

    # continue from a checkpoint after an interruption
    torchrun --nproc_per_node=8 dflash.py ... --out runs/q36-27b --resume
"""

import argparse
import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


class DFlashError(Exception):
    """Bad input or a bad checkpoint: printed as one line (no traceback) by main()."""


# -----------------------------------------------------------------------------
# Drafter config: mirrors the z-lab config.json (a Qwen3 config plus the DFlash fields)

SUPPORTED_ROPE_TYPES = ("default", "yarn")


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
    rope_scaling: dict | None = None     # None (plain RoPE) or {"rope_type": "yarn", ...}
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    block_size: int = 16                 # B
    mask_token_id: int = 248070          # M
    target_layer_ids: list = field(default_factory=lambda: [1, 16, 31, 46, 61])  # T
    num_target_layers: int = 64          # L
    layer_types: list = field(default_factory=lambda: ["sliding_attention"] * 4 + ["full_attention"])
    sliding_window: int | None = 2048    # W
    is_causal: bool | None = None        # None: a layer is causal iff it is a sliding layer

    def __post_init__(self):
        if self.block_size < 2:
            raise DFlashError(f"block_size must be >= 2 (one anchor token plus drafts), got {self.block_size}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise DFlashError(f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                              f"{self.num_hidden_layers}; give one entry per drafter layer")
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise DFlashError(f"unknown layer type {t!r}; use full_attention or sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise DFlashError("layer_types has sliding_attention layers but sliding_window is not set")
        if self.num_attention_heads % self.num_key_value_heads:
            raise DFlashError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_key_value_heads}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise DFlashError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                              f"pass --mask_token_id with an id the target's embedding has")
        check_target_layer_ids(self.target_layer_ids, self.num_target_layers)
        rope_type = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise DFlashError(f"rope type {rope_type!r} is not supported (only {', '.join(SUPPORTED_ROPE_TYPES)}); "
                              f"refusing to fall back silently to plain RoPE")

    def layer_is_causal(self, i):
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i):
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

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
        """Read a z-lab or our config.json: dflash_config first, then the top level."""
        dc = d.get("dflash_config") or {}
        get = lambda k, default=None: dc[k] if k in dc else d.get(k, default)  # noqa: E731
        rope = d.get("rope_parameters") or {}
        if isinstance(rope, dict) and "rope_theta" not in rope and rope and all(isinstance(v, dict) for v in rope.values()):
            raise DFlashError(f"{where}: per-layer-type rope_parameters are not supported")
        scaling = d.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"} or None
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            if scaling.get("partial_rotary_factor", 1.0) != 1.0:
                raise DFlashError(f"{where}: partial_rotary_factor != 1 is not supported by the drafter (plain RoPE "
                                  f"over the full head_dim)")
            scaling = None
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        num_layers = d["num_hidden_layers"]
        num_target = get("num_target_layers")
        ids = get("target_layer_ids")
        if ids is None:
            if num_target is None:
                raise DFlashError(f"{where}: target_layer_ids is missing and cannot be derived (no num_target_layers)")
            ids = default_target_layer_ids(num_target, num_layers)
        if num_target is None:
            raise DFlashError(f"{where}: num_target_layers is missing; set it to the target's number of decoder layers")
        if get("mask_token_id") is None:
            raise DFlashError(f"{where}: mask_token_id is missing (expected in dflash_config)")
        layer_types = d.get("layer_types") or ["full_attention"] * num_layers
        try:
            return cls(
                hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_hidden_layers=num_layers,
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads", d["num_attention_heads"]),
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                vocab_size=d["vocab_size"], rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
                rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 32768),
                attention_bias=d.get("attention_bias", False), block_size=get("block_size", 16),
                mask_token_id=get("mask_token_id"), target_layer_ids=list(ids), num_target_layers=num_target,
                layer_types=list(layer_types), sliding_window=d.get("sliding_window"), is_causal=d.get("is_causal"))
        except KeyError as e:
            raise DFlashError(f"{where}: required field {e.args[0]!r} is missing") from None


def default_target_layer_ids(num_target_layers, num_draft_layers):
    """DESIGN 2: spread the context layers from layer 1 to layer L-3. L=64, n=5 -> [1, 16, 31, 46, 61]."""
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


# -----------------------------------------------------------------------------
# Attention visibility: DESIGN 3, written once as a flex_attention mask_mod


def make_mask_mod(anchors, anchor_valid, S, B, causal, window):
    """Visibility for queries laid out as N blocks of B tokens and keys as [S context ; N blocks of B].

    Query q_idx is offset i = q_idx % B of block n = q_idx // B (anchor a, position a+i).
    - context key j < S: visible iff j < a, and in a sliding layer (a+i) - j < window;
    - block key: visible iff same block and (not causal or i' <= i); a non-causal sliding layer also
      needs k_pos - q_pos < window;
    - padding anchors (anchor_valid False) see nothing."""

    def mask_mod(b, h, q_idx, kv_idx):
        n, i = q_idx // B, q_idx % B
        a = anchors[b, n]
        is_ctx = kv_idx < S
        ctx_ok = is_ctx & (kv_idx < a)
        k_rel = kv_idx - S
        blk_ok = ~is_ctx & (k_rel // B == n)
        k_off = k_rel % B
        if causal:
            blk_ok = blk_ok & (k_off <= i)
        if window is not None:
            ctx_ok = ctx_ok & (a + i - kv_idx < window)
            if not causal:
                blk_ok = blk_ok & (k_off - i < window)
        return anchor_valid[b, n] & (ctx_ok | blk_ok)

    return mask_mod


def dense_mask(mask_mod, b, N, S, B, device):
    """Evaluate mask_mod where the dense path needs it: each block's queries against [context ; own block]."""
    n = torch.arange(N, device=device)
    q_idx = (n[:, None] * B + torch.arange(B, device=device))[:, :, None]              # (N, B, 1)
    own = S + n[:, None] * B + torch.arange(B, device=device)                           # (N, B)
    kv_idx = torch.cat([torch.arange(S, device=device).expand(N, S), own], 1)[:, None]  # (N, 1, S+B)
    bi = torch.arange(b, device=device)[:, None, None, None]
    return mask_mod(bi, 0, q_idx[None], kv_idx[None])                                   # (b, N, B, S+B)


def flex_block_mask(mask_mod, b, N, S, B, device):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(mask_mod, b, None, N * B, S + N * B, device=device, _compile=device.type == "cuda")


def build_masks(cfg, anchors, anchor_valid, S, path):
    b, N = anchors.shape
    masks = {}
    for i in range(cfg.num_hidden_layers):
        key = (cfg.layer_is_causal(i), cfg.layer_window(i))
        if key not in masks:
            mod = make_mask_mod(anchors, anchor_valid, S, cfg.block_size, *key)
            build = flex_block_mask if path == "flex" else dense_mask
            masks[key] = build(mod, b, N, S, cfg.block_size, anchors.device)
    return masks


_flex_compiled = None
FLEX_PAD = 128  # pad sequence lengths to multiples of this on the flex path: compiled flex sees few shapes


def flex_attention_fn(*args, **kwargs):
    """flex_attention, compiled once (uncompiled flex materialises the full score matrix)."""
    global _flex_compiled
    from torch.nn.attention.flex_attention import flex_attention
    if _flex_compiled is None:
        _flex_compiled = torch.compile(flex_attention, dynamic=False)
    return _flex_compiled(*args, **kwargs)


def default_attention_path(device):
    """flex on CUDA (block-sparse, compiled); dense SDPA elsewhere (flex has no backward on CPU)."""
    return "flex" if torch.device(device).type == "cuda" else "dense"


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
    """Inverse frequencies and cos/sin scale of RoPE over the full head_dim (HF's default and yarn rules)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not cfg.rope_scaling:
        return 1.0 / pos_freqs, 1.0
    s = cfg.rope_scaling  # yarn (the only other type __post_init__ lets through)
    original_max = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = s.get("factor") or cfg.max_position_embeddings / original_max

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in original_max
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rope_cos_sin(inv_freq, scale, positions, dtype):
    """positions (...,) -> cos, sin (..., head_dim)."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x, cos, sin):
    """x (..., T, heads, hd); cos/sin (..., T, hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.hk, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        D, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(D, self.h * self.hd, bias=bias)
        self.k_proj = nn.Linear(D, self.hk * self.hd, bias=bias)
        self.v_proj = nn.Linear(D, self.hk * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.h * self.hd, D, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """x (..., T, D) -> k, v (..., T, hk, hd); k_norm then RoPE."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.hk, self.hd)))
        return apply_rope(k, cos, sin), self.v_proj(x).unflatten(-1, (self.hk, self.hd))

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask, path):
        """x (b, N, B, D) normed block hidden states; k_ctx/v_ctx (b, S, hk, hd) context keys/values;
        mask: a BlockMask (path "flex") or a bool (b, N, B, S+B) visibility (path "dense")."""
        b, N, B, _ = x.shape
        S = k_ctx.shape[1]
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.h, self.hd))), cos, sin)  # (b, N, B, h, hd)
        k_blk, v_blk = self.keys_values(x, cos, sin)                                           # (b, N, B, hk, hd)
        if path == "flex":
            # all blocks as one query sequence against [context ; all blocks]; the BlockMask skips the rest
            q = q.reshape(b, N * B, self.h, self.hd).transpose(1, 2)
            k = torch.cat([k_ctx, k_blk.reshape(b, N * B, self.hk, self.hd)], 1).transpose(1, 2)
            v = torch.cat([v_ctx, v_blk.reshape(b, N * B, self.hk, self.hd)], 1).transpose(1, 2)
            out = flex_attention_fn(q, k, v, block_mask=mask, enable_gqa=True)  # (b, h, N*B, hd)
            out = out.transpose(1, 2).reshape(b, N, B, self.h * self.hd)
        else:
            # each block attends to [context ; its own block] only: scores (b*N, h, B, S+B), linear in N
            q = q.transpose(2, 3).reshape(b * N, self.h, B, self.hd)
            k = torch.cat([k_ctx[:, None].expand(b, N, S, self.hk, self.hd), k_blk], 2)
            v = torch.cat([v_ctx[:, None].expand(b, N, S, self.hk, self.hd), v_blk], 2)
            k = k.transpose(2, 3).reshape(b * N, self.hk, S + B, self.hd)
            v = v.transpose(2, 3).reshape(b * N, self.hk, S + B, self.hd)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.reshape(b * N, 1, B, S + B), enable_gqa=True)
            out = out.reshape(b, N, self.h, B, self.hd).transpose(2, 3).reshape(b, N, B, self.h * self.hd)
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

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask, path):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_ctx, v_ctx, mask, path)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Holds no embedding and no lm_head: both are the target's (frozen, passed in by the caller)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        m = len(cfg.target_layer_ids)
        self.fc = nn.Linear(m * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def context(self, context_features):
        """(b, S, m*D) concatenated target features h[t] -> ctx (b, S, D), shared by every layer."""
        return self.hidden_norm(self.fc(context_features))

    def context_kv(self, ctx, start=0):
        """Per-layer context keys/values (k_norm + RoPE at positions start..start+S-1)."""
        pos = torch.arange(start, start + ctx.shape[1], device=ctx.device)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(self, context_features, block_embeds, anchors, anchor_valid, path="dense"):
        """Training-mode forward: every block of every sequence in one call.

        context_features (b, S, m*D); block_embeds (b, N, B, D) = embed([tok[a], M, ..., M]);
        anchors (b, N) long; anchor_valid (b, N) bool (padding anchors see nothing).
        Returns the final-normed hidden states (b, N, B, D); offset i predicts the token at a+i."""
        S = context_features.shape[1]
        kv = self.context_kv(self.context(context_features))
        return self.blocks(block_embeds, anchors, anchor_valid, kv, S, path)

    def blocks(self, x, anchors, anchor_valid, kv, S, path):
        B = self.cfg.block_size
        pos = anchors[..., None] + torch.arange(B, device=anchors.device)  # (b, N, B): block token i -> a+i
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, pos, x.dtype)
        masks = build_masks(self.cfg, anchors, anchor_valid, S, path)  # one per distinct (causal, window)
        for i, layer in enumerate(self.layers):
            key = (self.cfg.layer_is_causal(i), self.cfg.layer_window(i))
            x = layer(x, cos, sin, kv[i][0], kv[i][1], masks[key], path)
        return self.norm(x)


# -----------------------------------------------------------------------------
# Inference-mode forward: one block at a time with an incremental context cache


class DraftCache:
    """Per-layer context keys/values for one sequence, extended as the target produces hidden states, so
    drafting along a long generation computes fc/k_proj/v_proj of each position once."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.kv = None   # list over layers of (k, v), each (1, length, hk, hd)
        self.length = 0

    @torch.no_grad()
    def extend(self, context_features):
        """context_features (1, T, m*D) for positions length..length+T-1."""
        if context_features.shape[1] == 0:
            return
        new = self.drafter.context_kv(self.drafter.context(context_features), start=self.length)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += context_features.shape[1]

    def crop(self, length):
        """Forget positions >= length (features of rejected draft tokens)."""
        if self.kv is None:
            return
        self.kv = [(k[:, :length], v[:, :length]) for k, v in self.kv]
        self.length = min(self.length, length)


@torch.no_grad()
def draft_block(drafter, cache, anchor_token, embed, lm_head):
    """Draft the B-1 tokens after anchor_token, which sits at position cache.length (context is < anchor).
    Returns (B-1,) token ids."""
    cfg = drafter.cfg
    a = cache.length
    ids = torch.full((1, 1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=drafter.fc.weight.device)
    ids[0, 0, 0] = anchor_token
    anchors = torch.full((1, 1), a, dtype=torch.long, device=ids.device)
    valid = torch.ones(1, 1, dtype=torch.bool, device=ids.device)
    x = embed(ids).to(drafter.fc.weight.dtype)
    if cache.kv is None:  # no context yet (anchor at position 0): empty keys
        z = x.new_zeros(1, 0, cfg.num_key_value_heads, cfg.head_dim)
        kv = [(z, z)] * cfg.num_hidden_layers
    else:
        kv = cache.kv
    h = drafter.blocks(x, anchors, valid, kv, a, "dense")
    return lm_head(h[0, 0, 1:].to(lm_head.weight.dtype)).argmax(-1)


# -----------------------------------------------------------------------------
# Checkpoints: a drafter directory in the z-lab layout (config.json + model.safetensors)


def expected_shapes(cfg):
    D, m, hd = cfg.hidden_size, len(cfg.target_layer_ids), cfg.head_dim
    shapes = {"fc.weight": (D, m * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (cfg.num_attention_heads * hd, D),
            p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, D),
            p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, D),
            p + "self_attn.o_proj.weight": (D, cfg.num_attention_heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, D), p + "mlp.up_proj.weight": (cfg.intermediate_size, D),
            p + "mlp.down_proj.weight": (D, cfg.intermediate_size)})
        if cfg.attention_bias:
            for name, rows in (("q", cfg.num_attention_heads), ("k", cfg.num_key_value_heads),
                               ("v", cfg.num_key_value_heads)):
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows * hd,)
            shapes[p + "self_attn.o_proj.bias"] = (D,)
    return shapes


def read_drafter_config(path):
    if not os.path.isdir(path):
        raise DFlashError(f"drafter directory {path!r} does not exist (expected config.json + model.safetensors)")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise DFlashError(f"{path!r} has no config.json; is it a DFlash drafter directory?")
    try:
        with open(cfg_path) as f:
            return DFlashConfig.from_json(json.load(f), where=cfg_path)
    except json.JSONDecodeError as e:
        raise DFlashError(f"{cfg_path}: not valid JSON ({e})") from None


def read_drafter_tensors(path):
    from safetensors.torch import load_file
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(load_file(os.path.join(path, shard)))
        return tensors
    raise DFlashError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")


def load_drafter(path, device="cpu", dtype=torch.float32):
    """Load a z-lab or our drafter directory strictly: every tensor present with its exact shape."""
    cfg = read_drafter_config(path)
    tensors = read_drafter_tensors(path)
    expected = expected_shapes(cfg)
    fc = tensors.get("fc.weight")
    if fc is not None and tuple(fc.shape) != expected["fc.weight"]:
        raise DFlashError(f"{path}: tensor fc.weight has shape {tuple(fc.shape)} but len(target_layer_ids) * "
                          f"hidden_size = {len(cfg.target_layer_ids)} * {cfg.hidden_size} needs {expected['fc.weight']}")
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise DFlashError(f"{path}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unexpected:
        raise DFlashError(f"{path}: unexpected tensor {unexpected[0]} (embedding and lm_head belong to the target; "
                          f"keys carry no 'model.' prefix)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DFlashError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    with torch.device("meta"):  # no random init of weights about to be overwritten (1.7B for Qwen3.6-27B)
        drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True, assign=True)
    drafter.inv_freq = rope_inv_freq(cfg)[0]  # the non-persistent RoPE buffer, rebuilt off the meta device
    return drafter.to(device=device, dtype=dtype)


@contextmanager
def atomic_dir(path):
    """Yield a temporary directory that replaces `path` only once everything in it is written: a crash never
    leaves a partial directory at `path` (between the two renames the old copy waits at <path>.old<pid>)."""
    path = path.rstrip("/")
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_drafter_files(drafter, directory, dtype):
    from safetensors.torch import save_file
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    cfg = drafter.cfg.to_json()
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def save_drafter(drafter, path, dtype=torch.bfloat16):
    """Write config.json + model.safetensors (bf16 or fp32) into path, atomically."""
    with atomic_dir(path) as tmp:
        write_drafter_files(drafter, tmp, dtype)
    return path


# -----------------------------------------------------------------------------
# The target: frozen, loaded through AutoModelForCausalLM; hooks capture h[t] and f


@dataclass
class Target:
    model: nn.Module        # the full HF model (generation, eval)
    backbone: nn.Module     # the decoder stack without lm_head (what training runs)
    layers: nn.ModuleList   # its decoder layers
    norm: nn.Module         # its final norm: its output f feeds lm_head
    embed: nn.Module
    lm_head: nn.Module
    tokenizer: object
    name: str

    @property
    def num_layers(self):
        return len(self.layers)

    @property
    def hidden_size(self):
        return self.lm_head.weight.shape[1]

    @property
    def vocab_size(self):
        return self.lm_head.weight.shape[0]


def find_decoder(model):
    """The text decoder stack, found by inspection rather than by model name: the module holding
    `layers` (a ModuleList), a final `norm` and the input embedding. Qwen3/Llama/Qwen3.5 text: model.model;
    the Qwen3.5/3.6 multimodal class: model.model.language_model."""
    embed = model.get_input_embeddings()
    candidates = [m for _, m in model.named_modules()
                  if isinstance(getattr(m, "layers", None), nn.ModuleList) and isinstance(getattr(m, "norm", None), nn.Module)
                  and any(c is embed for c in m.children())]
    if not candidates:
        raise DFlashError(f"cannot find the decoder layers of {type(model).__name__}: no submodule holds `layers`, "
                          f"`norm` and the input embedding")
    return candidates[0]


def load_target(name, device="cpu", dtype=None, trust_remote_code=False):
    """A local path or hub id; frozen, in eval mode; bf16 on CUDA and fp32 on CPU unless dtype says otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    looks_local = name.startswith((".", "/", "~")) or os.path.exists(name)
    if looks_local and not os.path.isfile(os.path.join(name, "config.json")):
        raise DFlashError(f"target {name!r} is not a model directory (no config.json); give a local path or a hub id")
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot load target {name!r}: {str(e).splitlines()[0]}") from None
    model.to(device).eval().requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # a target without a tokenizer still works with pre-tokenized data
    if tokenizer is not None and len(tokenizer) <= max(1, len(tokenizer.all_special_ids)):
        tokenizer = None  # transformers 5 returns an empty stand-in when the directory has no tokenizer files
    backbone = find_decoder(model)
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise DFlashError(f"target {name!r} has no lm_head (get_output_embeddings() is None)")
    return Target(model, backbone, backbone.layers, backbone.norm, model.get_input_embeddings(), lm_head, tokenizer, name)


def check_compatible(cfg, target, where="drafter"):
    """A drafter made for another target must fail loudly, not draft garbage."""
    if cfg.hidden_size != target.hidden_size:
        raise DFlashError(f"{where} hidden size {cfg.hidden_size} != target hidden size {target.hidden_size}; "
                          f"the drafter was made for another target")
    if cfg.vocab_size != target.vocab_size:
        raise DFlashError(f"{where} vocab {cfg.vocab_size} != target vocab {target.vocab_size}; "
                          f"the drafter was made for another target")
    if cfg.num_target_layers != target.num_layers:
        raise DFlashError(f"{where} num_target_layers {cfg.num_target_layers} != the target's {target.num_layers} "
                          f"decoder layers; the drafter was made for another target")
    check_target_layer_ids(cfg.target_layer_ids, target.num_layers)


@contextmanager
def capture_hidden(target, layer_ids):
    """Forward hooks on decoder layers `layer_ids` (their outputs h[t]) and on the final norm (its output f).
    Yields a dict {t: h[t], "final": f}; the hooks are removed on exit so the target can generate as usual."""
    store = {}

    def hook(key):
        def fn(module, inputs, output):
            store[key] = output[0] if isinstance(output, tuple) else output
        return fn

    handles = [target.layers[t].register_forward_hook(hook(t)) for t in layer_ids]
    handles.append(target.norm.register_forward_hook(hook("final")))
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def target_features(target, input_ids, layer_ids):
    """One pass of the target's decoder stack (no lm_head, no all-hidden-states) ->
    context (b, S, m*D) = concat_t h[t], and f (b, S, D). Right padding needs no attention mask."""
    with capture_hidden(target, layer_ids) as store:
        target.backbone(input_ids=input_ids, use_cache=False)
    return torch.cat([store[t] for t in layer_ids], dim=-1), store["final"]


def vocab_chunk(vocab_size, budget=2**27):
    """Rows per chunk so one chunk of logits holds about `budget` floats (0.5 GB in fp32)."""
    return max(1, budget // vocab_size)


@torch.no_grad()
def greedy_labels(final, lm_head, chunk=None):
    """y[j] = argmax lm_head(f[j-1]): what greedy verification accepts at position j. y[0] = -1 (never a label).
    final (b, S, D) -> (b, S) long, computed in row chunks so [S, V] logits never exist at once."""
    b, S, D = final.shape
    f = final[:, :-1].reshape(-1, D)
    chunk = chunk or vocab_chunk(lm_head.weight.shape[0])
    out = torch.cat([lm_head(f[s:s + chunk]).argmax(-1) for s in range(0, f.shape[0], chunk)])
    return torch.cat([out.new_full((b, 1), -1), out.view(b, S - 1)], dim=1)


# -----------------------------------------------------------------------------
# Data: JSONL -> (input_ids, loss_mask) per sample, one sample per row, right-padded


def chat_ids(tokenizer, messages, add_generation_prompt=False, **template_kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_record(rec, tokenizer, where):
    """One JSONL record -> (input_ids, loss_mask). loss_mask is 1 on the tokens the drafter learns to predict."""
    if not isinstance(rec, dict):
        raise DFlashError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "input_ids" in rec:
        ids = rec["input_ids"]
        mask = rec.get("loss_mask", [1] * len(ids))
        if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
            raise DFlashError(f"{where}: input_ids must be a list of integers")
        if not isinstance(mask, list) or len(mask) != len(ids):
            raise DFlashError(f"{where}: loss_mask must be a list as long as input_ids ({len(ids)})")
        return ids, [int(bool(m)) for m in mask]
    if tokenizer is None and any(k in rec for k in ("messages", "prompt", "text")):
        raise DFlashError(f"{where}: the target has no tokenizer; use pre-tokenized {{\"input_ids\": [...]}} lines")
    encode = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    if "messages" in rec:
        messages = rec["messages"]
        if not tokenizer.chat_template:
            raise DFlashError(f"{where}: messages need a chat template, and the target's tokenizer has none")
        ids = chat_ids(tokenizer, messages)
        mask = [0] * len(ids)
        for k, msg in enumerate(messages):
            if msg.get("role") == "assistant":  # the assistant turn spans [prefix + generation prompt, prefix + turn)
                prefix = chat_ids(tokenizer, messages[:k], add_generation_prompt=True)
                end = len(chat_ids(tokenizer, messages[:k + 1]))
                if ids[:len(prefix)] != prefix:  # e.g. a template that rewrites earlier turns (strips <think>)
                    raise DFlashError(f"{where}: the chat template renders the conversation before assistant turn {k} "
                                      f"differently inside the full conversation, so its loss mask is ambiguous; "
                                      f"split the conversation into one sample per assistant turn")
                mask[len(prefix):end] = [1] * (min(end, len(ids)) - len(prefix))
        return ids, mask
    if "prompt" in rec and "response" in rec:
        if tokenizer.chat_template:
            return encode_record({"messages": [{"role": "user", "content": rec["prompt"]},
                                               {"role": "assistant", "content": rec["response"]}]}, tokenizer, where)
        p, r = encode(rec["prompt"]), encode(rec["response"])
        return p + r, [0] * len(p) + [1] * len(r)
    if "text" in rec:
        ids = encode(rec["text"])
        return ids, [1] * len(ids)
    raise DFlashError(f"{where}: none of the known fields (messages | prompt+response | text | input_ids); "
                      f"got keys {sorted(rec)}")


def read_jsonl(path, what, hint=""):
    """Yield ("file:line", record) for each non-blank line; every problem is a one-line error naming file and line."""
    if not os.path.isfile(path):
        raise DFlashError(f"{what} file {path!r} does not exist{hint}")
    try:
        f = open(path)
    except OSError as e:
        raise DFlashError(f"cannot read {what} file {path!r}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DFlashError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            yield f"{path}:{lineno}", rec


def load_samples(path, tokenizer, max_len, log=print):
    """Read a JSONL file; truncate to max_len; skip (and count) samples with nothing to learn."""
    samples, skipped, lines = [], 0, 0
    for where, rec in read_jsonl(path, "data", "; pass --data with a JSONL file"):
        lines += 1
        ids, mask = encode_record(rec, tokenizer, where)
        ids, mask = ids[:max_len], mask[:max_len]
        # usable iff some anchor a has loss_mask[a] = loss_mask[a+1] = 1 (needs >= 2 tokens)
        if len(ids) < 2 or not any(mask[j] and mask[j + 1] for j in range(len(ids) - 1)):
            skipped += 1
            continue
        samples.append((ids, mask))
    if not lines:
        raise DFlashError(f"data file {path!r} is empty; it needs one JSON object per line")
    if not samples:
        raise DFlashError(f"{path}: no usable samples ({skipped} skipped: fewer than 2 tokens or no two consecutive "
                          f"response tokens); check the file and the loss_mask")
    if skipped:
        log(f"{path}: skipped {skipped} samples with fewer than 2 response tokens, kept {len(samples)}")
    return samples


def split_eval(samples, eval_fraction, seed):
    """A deterministic held-out split (the same on every rank)."""
    n_eval = int(len(samples) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(samples) > 1:
        n_eval = 1
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [samples[i] for i in order[n_eval:]], [samples[i] for i in order[:n_eval]]


def mix_seed(*keys):
    """A 63-bit seed from a tuple of ints: randomness keyed by (seed, epoch, sample) rather than by rank, so any
    split of the global batch over ranks and micro-steps draws the same anchors and noise."""
    h = 1469598103934665603
    for k in keys:
        h = ((h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


class Batches:
    """Epoch-shuffled global batches of batch_size * grad_accum * world samples; micro-step m of rank r takes its
    own slice. Deterministic for a given seed and epoch; the position is just the step number."""

    def __init__(self, samples, batch_size, grad_accum, rank, world, seed, pad_id, pad_to=None, multiple=1):
        self.samples, self.bs, self.accum, self.rank, self.world = samples, batch_size, grad_accum, rank, world
        self.seed, self.pad_id, self.pad_to, self.multiple = seed, pad_id, pad_to, multiple
        self.global_batch = batch_size * grad_accum * world
        self.steps_per_epoch = len(samples) // self.global_batch
        if self.steps_per_epoch == 0:
            raise DFlashError(f"{len(samples)} training samples are fewer than one global batch "
                              f"({batch_size} x grad_accum {grad_accum} x {world} ranks); lower --batch_size")
        self._order = (None, None)

    def order(self, epoch):
        if self._order[0] != epoch:
            g = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(len(self.samples), generator=g).tolist())
        return self._order[1]

    def get(self, step, micro):
        epoch, k = divmod(step, self.steps_per_epoch)
        start = k * self.global_batch + (micro * self.world + self.rank) * self.bs
        idx = self.order(epoch)[start:start + self.bs]
        return collate([self.samples[i] for i in idx], self.pad_id, self.pad_to,
                       [mix_seed(self.seed, epoch, i) for i in idx], self.multiple)


def collate(samples, pad_id, pad_to=None, keys=None, multiple=1):
    """Right-pad to the longest sample rounded up to `multiple` (few distinct shapes for compiled flex), or to
    pad_to (one fixed shape for torch.compile). Right padding never changes a causal target's real positions."""
    S = pad_to or -(-max(len(ids) for ids, _ in samples) // multiple) * multiple
    input_ids = torch.full((len(samples), S), pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), S, dtype=torch.long)
    for r, (ids, mask) in enumerate(samples):
        input_ids[r, :len(ids)] = torch.tensor(ids)
        loss_mask[r, :len(mask)] = torch.tensor(mask)
    keys = keys if keys is not None else list(range(len(samples)))
    return {"input_ids": input_ids, "loss_mask": loss_mask, "keys": keys, "tokens": sum(len(ids) for ids, _ in samples)}


# -----------------------------------------------------------------------------
# Anchors, labels, context noise, and the corrected loss (DESIGN 4)


def sample_anchors(loss_mask, num_anchors, generator):
    """loss_mask (S,) -> anchors (num_anchors,) long and valid (num_anchors,) bool. Candidates are positions with
    loss_mask[a] = loss_mask[a+1] = 1, drawn uniformly without replacement; padded to a fixed count."""
    cand = ((loss_mask[:-1] > 0) & (loss_mask[1:] > 0)).nonzero().squeeze(1)
    pick = cand[torch.randperm(len(cand), generator=generator)[:num_anchors]].sort().values
    anchors = torch.zeros(num_anchors, dtype=torch.long)
    valid = torch.zeros(num_anchors, dtype=torch.bool)
    anchors[:len(pick)], valid[:len(pick)] = pick, True
    return anchors, valid


def batch_anchors(batch, num_anchors, step_salt=0):
    """Anchors for every row, each drawn from a generator keyed by the sample (and a salt for eval passes)."""
    rows = [sample_anchors(m, num_anchors, torch.Generator().manual_seed(mix_seed(k, step_salt)))
            for m, k in zip(batch["loss_mask"], batch["keys"])]
    return torch.stack([a for a, _ in rows]), torch.stack([v for _, v in rows])


def block_positions(anchors, B):
    return anchors[..., None] + torch.arange(B, device=anchors.device)  # (b, N, B): offset i sits at a+i


def loss_weights(anchors, anchor_valid, loss_mask, B, gamma):
    """w[b, n, i] = exp(-(i-1)/gamma) * valid(a+i) for i = 1..B-1 and 0 at offset 0, where valid means inside
    the sequence, loss_mask[a+i] = 1 and a real (not padding) anchor."""
    S = loss_mask.shape[1]
    pos = block_positions(anchors, B)
    inside = pos < S
    in_mask = loss_mask.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos) > 0
    i = torch.arange(B, device=anchors.device, dtype=torch.float32)
    decay = torch.exp(-(i - 1) / gamma)
    decay[0] = 0.0
    return decay * (inside & in_mask & anchor_valid[..., None])


def block_labels(labels_all, anchors, B):
    """labels_all (b, S) -> labels (b, N, B): the label of offset i is labels_all[a+i] (clamped past the end,
    where the weight is 0)."""
    S = labels_all.shape[1]
    pos = block_positions(anchors, B).clamp(max=S - 1)
    return labels_all.gather(1, pos.flatten(1)).view_as(pos)


def block_input_ids(input_ids, anchors, B, mask_token_id):
    """[tok[a], M, M, ..., M] for every anchor: (b, N, B)."""
    ids = torch.full((*anchors.shape, B), mask_token_id, dtype=torch.long, device=anchors.device)
    ids[..., 0] = input_ids.gather(1, anchors)
    return ids


def add_context_noise(context, noise_std, num_context_layers, keys):
    """Gaussian noise relative to the RMS of each context feature vector h[t][j], on the concatenated context
    features only (a new tensor: f, labels and block embeddings are never touched). One generator per row."""
    if noise_std == 0:
        return context
    x = context.float().unflatten(-1, (num_context_layers, -1))                   # (b, S, m, D)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator(device=x.device).manual_seed(mix_seed(k, 7)),
                                     device=x.device) for k in keys])
    return (x + noise_std * rms * noise).flatten(-2).to(context.dtype)


class ChunkedLMHeadCE(torch.autograd.Function):
    """Per-token cross-entropy and argmax of lm_head(h) without [T, V] logits: rows are processed in chunks and
    the gradient w.r.t. h ((softmax - onehot) @ W, the lm_head being frozen) is formed in the same pass, so
    only (T, D) is kept for backward."""

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


def block_loss(hidden, lm_head, labels, weights, chunk=None):
    """Pure hard cross-entropy on the weighted block tokens, plus the metrics of the same pass.

    hidden (b, N, B, D), labels/weights (b, N, B). Returns (sum w*CE, stats) where stats holds sums to all-reduce:
    w (sum of weights), correct[i] / count[i] per offset, accepted (sum of accepted-prefix lengths), blocks."""
    b, N, B, D = hidden.shape
    w = weights.flatten()
    sel = (w > 0).nonzero().squeeze(1)                      # only the tokens that count, not padding anchors
    ce, pred = ChunkedLMHeadCE.apply(hidden.reshape(-1, D)[sel], lm_head.weight, lm_head.bias,
                                     labels.flatten()[sel].clamp(min=0), chunk or vocab_chunk(lm_head.weight.shape[0]))
    loss_sum = (ce * w[sel]).sum()
    valid = weights > 0
    correct = torch.zeros(b * N * B, dtype=torch.bool, device=hidden.device)
    correct[sel] = pred == labels.flatten()[sel]
    correct = correct.view(b, N, B) & valid
    blocks = valid[..., 1]  # a block counts if its first draft position is valid
    accepted = torch.cumprod(correct[..., 1:].long(), dim=-1).sum(-1)    # leading run of correct drafts
    stats = {"w": weights.sum().detach(), "ce_w": loss_sum.detach(), "correct": correct.sum((0, 1)).float(),
             "count": valid.sum((0, 1)).float(), "accepted": (accepted * blocks).sum().float(),
             "blocks": blocks.sum().float()}
    return loss_sum, stats


def summarize(stats):
    """Global metrics from summed numerators and denominators."""
    acc = (stats["correct"] / stats["count"].clamp(min=1)).tolist()
    return {"loss": (stats["ce_w"] / stats["w"].clamp(min=1e-9)).item(),
            "tau": 1.0 + (stats["accepted"] / stats["blocks"].clamp(min=1)).item(),
            "acc": acc[1:]}


# -----------------------------------------------------------------------------
# Training


def lr_at(step, total_steps, lr, warmup_ratio):
    """Linear warmup over warmup_ratio of the run, then cosine decay to 0. A pure function of the step."""
    warmup = max(1, round(warmup_ratio * total_steps)) if warmup_ratio > 0 else 0
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def derive_config(target, args):
    """A new drafter shaped like z-lab's: hidden/intermediate/vocab/eps/rope_theta from the target, plain RoPE over
    the full head, 32 heads, 8 KV heads, head_dim 128, n-1 causal sliding layers + 1 full layer."""
    tc = target.model.config.get_text_config()
    rope = getattr(tc, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    n = args.num_draft_layers
    mask_token_id = args.mask_token_id
    if mask_token_id is None:
        mask_token_id = getattr(target.tokenizer, "mask_token_id", None)
    if mask_token_id is None:
        raise DFlashError("no mask token: the target's tokenizer defines none; pass --mask_token_id "
                          "(248070 for Qwen3.5/3.6, 151669 for Qwen3)")
    if args.layer_types:
        layer_types = [{"sliding": "sliding_attention", "full": "full_attention"}.get(t, t)
                       for t in args.layer_types.split(",")]
    else:
        layer_types = ["sliding_attention" if args.sliding_window and i < n - 1 else "full_attention" for i in range(n)]
    ids = args.target_layer_ids or default_target_layer_ids(target.num_layers, n)
    if not args.target_layer_ids and len(set(ids)) < len(ids):
        raise DFlashError(f"the default target_layer_ids {ids} for a {target.num_layers}-layer target and {n} drafter "
                          f"layers repeat a layer; pass --target_layer_ids explicitly")
    check_target_layer_ids(ids, target.num_layers)
    return DFlashConfig(
        hidden_size=target.hidden_size, intermediate_size=args.intermediate_size or tc.intermediate_size,
        num_hidden_layers=n, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        head_dim=args.head_dim, vocab_size=target.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=float(rope_theta),
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768), block_size=args.block_size,
        mask_token_id=mask_token_id, target_layer_ids=list(ids), num_target_layers=target.num_layers,
        layer_types=layer_types, sliding_window=args.sliding_window or None)


def forward_batch(model, target, cfg, batch, args, anchors, valid, path, train):
    """Target pass (frozen) -> labels -> drafter over every block -> (sum w*CE, stats)."""
    dev = target.lm_head.weight.device
    input_ids, loss_mask = batch["input_ids"].to(dev), batch["loss_mask"].to(dev)
    anchors, valid = anchors.to(dev), valid.to(dev)
    B = cfg.block_size
    context, final = target_features(target, input_ids, cfg.target_layer_ids)
    labels_all = greedy_labels(final, target.lm_head) if args.labels == "target" else input_ids
    labels = block_labels(labels_all, anchors, B)
    weights = loss_weights(anchors, valid, loss_mask, B, args.gamma)
    with torch.no_grad():
        x = target.embed(block_input_ids(input_ids, anchors, B, cfg.mask_token_id))
    if train:  # context features only; f (labels) and the block embeddings stay clean
        context = add_context_noise(context, args.noise_std, len(cfg.target_layer_ids), batch["keys"])
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    with autocast:
        hidden = model(context, x, anchors, valid, path)
    return block_loss(hidden, target.lm_head, labels, weights)


def all_reduce_stats(stats, ddp):
    if ddp:
        import torch.distributed as dist
        for v in stats.values():
            dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return stats


def add_stats(total, stats):
    return {k: total[k] + v for k, v in stats.items()} if total else dict(stats)


def accumulate_gradients(model, target, cfg, micro_batches, args, path, world):
    """Forward and backward over one optimizer step's micro-batches; returns the step's stats summed over ranks.

    Anchors (hence the loss weights) are known before any forward, so the loss is normalised by the global sum of
    weights: sum(w * CE) / sum(w) over the whole global batch, whatever its split over ranks and micro-steps."""
    ddp = world > 1
    device = target.lm_head.weight.device
    anchors = [batch_anchors(mb, args.num_anchors) for mb in micro_batches]
    w_total = sum(loss_weights(a, v, mb["loss_mask"], cfg.block_size, args.gamma).sum()
                  for mb, (a, v) in zip(micro_batches, anchors)).to(device)
    if ddp:
        import torch.distributed as dist
        dist.all_reduce(w_total)
    total = None
    for m, (mb, (a, v)) in enumerate(zip(micro_batches, anchors)):
        # no gradient all-reduce until the last micro-step (around forward *and* backward)
        sync = model.no_sync() if ddp and m < len(micro_batches) - 1 else nullcontext()
        with sync:
            loss_sum, stats = forward_batch(model, target, cfg, mb, args, a, v, path, train=True)
            (loss_sum * world / w_total.clamp(min=1e-9)).backward()  # DDP averages over ranks: undo it
        total = add_stats(total, {**stats, "tokens": torch.tensor(float(mb["tokens"]), device=device)})
    return all_reduce_stats(total, ddp)


@torch.no_grad()
def evaluate(drafter, target, cfg, samples, args, rank, world, path):
    """Held-out loss and tau estimate on every rank (its shard), combined by summing numerators/denominators."""
    total = None
    mine = samples[rank::world]
    pad_id = getattr(target.tokenizer, "pad_token_id", None) or 0
    for s in range(0, max(len(mine), 1), args.batch_size):
        part = mine[s:s + args.batch_size]
        if not part:  # a rank without eval samples still joins the all-reduce with zeros
            break
        # anchors keyed by the sample's index in the eval set: the same blocks whatever the number of ranks
        batch = collate(part, pad_id, keys=[mix_seed(args.seed, rank + world * (s + r)) for r in range(len(part))],
                        multiple=FLEX_PAD if path == "flex" else 1)
        anchors, valid = batch_anchors(batch, args.num_anchors, step_salt=12345)
        _, stats = forward_batch(drafter, target, cfg, batch, args, anchors, valid, path, train=False)
        total = add_stats(total, stats)
    if total is None:
        z = torch.zeros((), device=target.lm_head.weight.device)
        B = cfg.block_size
        total = {"w": z.clone(), "ce_w": z.clone(), "correct": z.new_zeros(B), "count": z.new_zeros(B),
                 "accepted": z.clone(), "blocks": z.clone()}
    return summarize(all_reduce_stats(total, world > 1))


def checkpoint_dir(out, step):
    return os.path.join(out, f"step_{step}")


def latest_checkpoint(out):
    p = os.path.join(out, "latest")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    d = os.path.join(out, name)
    return d if os.path.isfile(os.path.join(d, "train_state.pt")) else None


def save_checkpoint(out, step, drafter, optimizer, args, rng, save_dtype, extra):
    """<out>/step_<n>/ = drafter directory (z-lab layout) + train_state.pt, written atomically; then <out>/latest
    is switched to it (also atomically), so latest never names a partial checkpoint."""
    path = checkpoint_dir(out, step)
    with atomic_dir(path) as tmp:
        write_drafter_files(drafter, tmp, save_dtype)
        torch.save({"step": step, "optimizer": optimizer.state_dict(), "args": vars(args), "rng": rng, **extra},
                   os.path.join(tmp, "train_state.pt"))
    with open(os.path.join(out, "latest.tmp"), "w") as f:
        f.write(os.path.basename(path) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(out, "latest.tmp"), os.path.join(out, "latest"))
    return path


GEOMETRY = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "block_size", "target_layer_ids", "num_target_layers", "layer_types",
            "sliding_window", "mask_token_id")


def check_resume_geometry(saved, cfg, where):
    for k in GEOMETRY:
        if getattr(saved, k) != getattr(cfg, k):
            raise DFlashError(f"cannot resume {where}: it was made for {k}={getattr(saved, k)}, this run has "
                              f"{getattr(cfg, k)}; use the original target and flags, or a new --out")


class StopFlag:
    """SIGTERM/SIGINT ask the loop to finish the current step, save and exit; a second signal kills."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(args):
    """The training loop; the same code under `python` (one process) and `torchrun` (DDP)."""
    import torch.distributed as dist
    from tqdm import tqdm

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    ddp = world > 1
    master = rank == 0
    if args.device:
        device = torch.device(args.device)
    else:
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")

    def print0(*a):
        if master:
            tqdm.write(" ".join(str(x) for x in a))

    if args.block_size < 2:
        raise DFlashError(f"--block_size must be >= 2, got {args.block_size}")
    if args.num_anchors < 1:
        raise DFlashError(f"--num_anchors must be >= 1, got {args.num_anchors}")
    resume_dir = None
    if args.resume:
        resume_dir = latest_checkpoint(args.out)
        if resume_dir is None:
            raise DFlashError(f"--resume: no checkpoint in {args.out!r} (no {args.out}/latest); drop --resume to start")
    if args.init_from and not os.path.isdir(args.init_from):
        raise DFlashError(f"--init_from {args.init_from!r} does not exist; give a drafter directory")

    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    target = load_target(args.target, device, dtype, args.trust_remote_code)
    if args.init_from:
        cfg = read_drafter_config(args.init_from)
    else:
        cfg = derive_config(target, args)
    check_compatible(cfg, target)
    path = args.attention if args.attention != "auto" else default_attention_path(device)
    compile_ = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")

    tokenizer = target.tokenizer
    samples = load_samples(args.data, tokenizer, args.max_len, log=print0)
    if args.eval_data:
        train_samples, eval_samples = samples, load_samples(args.eval_data, tokenizer, args.max_len, log=print0)
    else:
        train_samples, eval_samples = split_eval(samples, args.eval_fraction, args.seed)
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    batches = Batches(train_samples, args.batch_size, args.grad_accum, rank, world, args.seed, pad_id,
                      pad_to=args.max_len if compile_ else None, multiple=FLEX_PAD if path == "flex" else 1)
    total_steps = args.max_steps or args.epochs * batches.steps_per_epoch

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    drafter = (load_drafter(args.init_from, device) if args.init_from else DFlashDrafter(cfg)).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay, fused=device.type == "cuda")
    start_step, bad_steps = 0, 0
    if resume_dir:
        saved = read_drafter_config(resume_dir)
        check_resume_geometry(saved, cfg, resume_dir)
        state = torch.load(os.path.join(resume_dir, "train_state.pt"), map_location="cpu", weights_only=True)
        if state["global_batch"] != batches.global_batch:
            raise DFlashError(f"cannot resume {resume_dir}: global batch was {state['global_batch']}, now "
                              f"{batches.global_batch}; keep batch_size x grad_accum x ranks the same")
        drafter.load_state_dict(load_drafter(resume_dir, device).state_dict())
        optimizer.load_state_dict(state["optimizer"])
        start_step, bad_steps = state["step"], state.get("bad_steps", 0)
        rng = state["rng"]
        if rank < len(rng):
            torch.set_rng_state(rng[rank])
        print0(f"resumed from {resume_dir} at step {start_step}")
    torch.manual_seed(args.seed + rank)

    model = drafter
    if compile_:
        model = torch.compile(model)
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if master:
        os.makedirs(args.out, exist_ok=True)
        n_params = sum(p.numel() for p in drafter.parameters())
        print0(f"drafter: {n_params / 1e6:.2f}M params, {cfg.num_hidden_layers} layers, block {cfg.block_size}, "
               f"target_layer_ids {cfg.target_layer_ids}, layer_types {cfg.layer_types}; target {args.target} "
               f"({target.num_layers} layers); {len(train_samples)} train / {len(eval_samples)} eval samples; "
               f"{total_steps} steps of {batches.global_batch} samples; attention {path}, compile {compile_}, "
               f"{world} rank(s) on {device.type}")

    def log_metrics(record):
        if master:
            with open(os.path.join(args.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")

    def do_eval(step):
        if not eval_samples:
            return None
        drafter.eval()
        m = evaluate(drafter, target, cfg, eval_samples, args, rank, world, path)
        drafter.train()
        print0(f"step {step}: eval loss {m['loss']:.4f}  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}")
        log_metrics({"step": step, "eval_loss": m["loss"], "eval_tau": m["tau"], "eval_acc": m["acc"]})
        return m

    def save(step):
        rng = [torch.get_rng_state()]
        if ddp:
            rng = [None] * world
            dist.all_gather_object(rng, torch.get_rng_state())
        if master:
            p = save_checkpoint(args.out, step, drafter, optimizer, args, rng, SAVE_DTYPES[args.save_dtype],
                                {"global_batch": batches.global_batch, "bad_steps": bad_steps,
                                 "epoch": step // batches.steps_per_epoch,
                                 "step_in_epoch": step % batches.steps_per_epoch})
            print0(f"saved {p}")
        if ddp:
            dist.barrier()

    stop = StopFlag()
    try:
        drafter.train()
        if start_step == 0:
            do_eval(0)
        bar = tqdm(range(start_step, total_steps), initial=start_step, total=total_steps, disable=not master,
                   dynamic_ncols=True, desc="train")
        t_last, tokens_since, first_step_time = time.time(), 0, None
        for step in bar:
            t0 = time.time()
            lr = lr_at(step, total_steps, args.lr, args.warmup_ratio)
            for g in optimizer.param_groups:
                g["lr"] = lr
            total = accumulate_gradients(model, target, cfg, [batches.get(step, m) for m in range(args.grad_accum)],
                                         args, path, world)
            tokens_since += total["tokens"].item()  # all ranks' tokens, exactly
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip)
            loss = (total["ce_w"] / total["w"].clamp(min=1e-9))
            if not (torch.isfinite(loss) and torch.isfinite(grad_norm)):
                # grads are all-reduced and the loss summed, so every rank takes this branch together
                optimizer.zero_grad(set_to_none=True)
                bad_steps += 1
                print0(f"step {step + 1}: non-finite loss {loss.item()} / grad norm {grad_norm.item()}, skipped the "
                       f"update ({bad_steps} in a row)")
                if bad_steps >= args.max_bad_steps:
                    raise DFlashError(f"{bad_steps} consecutive non-finite steps (last at step {step + 1}); lower --lr or "
                                      f"check the data; the last good checkpoint is in {args.out}")
            else:
                bad_steps = 0
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if first_step_time is None:
                first_step_time = time.time() - t0
                print0(f"first step took {first_step_time:.1f}s (includes compilation when --compile is on)")
            done = step + 1
            if done % args.log_every == 0 or done == total_steps:
                m = summarize(total)
                dt = time.time() - t_last
                tok_s = tokens_since / max(dt, 1e-9)
                mem = peak_memory_mb(device)
                print0(f"step {done}: loss {m['loss']:.4f}  tau {m['tau']:.3f}  acc@1 {m['acc'][0]:.3f}  lr {lr:.2e}  "
                       f"grad {grad_norm.item():.2f}  {tok_s:,.0f} tok/s  peak {mem:,.0f} MB")
                log_metrics({"step": done, "loss": m["loss"], "tau": m["tau"], "acc": m["acc"], "lr": lr,
                             "grad_norm": grad_norm.item(), "tokens_per_s": tok_s, "peak_mb": mem})
                bar.set_postfix(loss=f"{m['loss']:.3f}", tau=f"{m['tau']:.2f}")
                t_last, tokens_since = time.time(), 0
            if args.eval_every and done % args.eval_every == 0 and done != total_steps:
                do_eval(done)
            flag = torch.tensor(float(stop.requested), device=device)
            if ddp:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # all ranks agree to stop after the same step
            if flag.item():
                save(done)
                print0(f"interrupted after step {done}; resume with the same command plus --resume")
                break
            if args.save_every and done % args.save_every == 0 and done != total_steps:
                save(done)
        else:
            if total_steps > start_step or not latest_checkpoint(args.out):
                do_eval(total_steps)
                save(total_steps)
        bar.close()
    finally:
        stop.restore()
    if ddp:
        dist.destroy_process_group()
    return drafter, cfg, target


SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def get_parser():
    p = argparse.ArgumentParser(description="Train a DFlash block-diffusion drafter against a frozen target LLM.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target", help="target model: a local directory or a hub id (loaded with AutoModelForCausalLM)")
    a("--data", help="training JSONL: messages | prompt+response | text | input_ids(+loss_mask) per line")
    a("--out", default="out", help="output directory for checkpoints and metrics.jsonl")
    a("--init_from", default=None, help="drafter directory (z-lab's or ours) to fine-tune from")
    a("--resume", action="store_true", help="continue from <out>/latest")
    a("--demo", action="store_true", help="the CPU demo (also what runs with no arguments)")
    g = p.add_argument_group("drafter geometry (new drafters; ignored with --init_from)")
    g.add_argument("--num_draft_layers", type=int, default=5, help="drafter decoder layers")
    g.add_argument("--block_size", type=int, default=16, help="B: one anchor token + B-1 drafted tokens")
    g.add_argument("--target_layer_ids", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated target layers feeding the context (default: DESIGN 2 spread)")
    g.add_argument("--mask_token_id", type=int, default=None, help="mask token id (default: the tokenizer's)")
    g.add_argument("--sliding_window", type=int, default=2048, help="window of the sliding layers (0: all full)")
    g.add_argument("--layer_types", default=None,
                   help="comma-separated sliding|full per layer (default: all sliding but the last)")
    g.add_argument("--num_heads", type=int, default=32, help="attention heads")
    g.add_argument("--num_kv_heads", type=int, default=8, help="key/value heads (GQA)")
    g.add_argument("--head_dim", type=int, default=128, help="head dimension")
    g.add_argument("--intermediate_size", type=int, default=None, help="MLP width (default: the target's)")
    g = p.add_argument_group("data and loss")
    g.add_argument("--max_len", type=int, default=3072, help="truncate samples to this many tokens")
    g.add_argument("--eval_fraction", type=float, default=0.01, help="held-out fraction of --data")
    g.add_argument("--eval_data", default=None, help="held-out JSONL (instead of --eval_fraction)")
    g.add_argument("--num_anchors", type=int, default=512, help="anchors (blocks) per sequence")
    g.add_argument("--gamma", type=float, default=4.0, help="loss decay: weight exp(-(i-1)/gamma) at offset i")
    g.add_argument("--labels", choices=["target", "data"], default="target",
                   help="target: the target's greedy token (teacher-forced); data: the data token")
    g.add_argument("--noise_std", type=float, default=0.02,
                   help="Gaussian noise on the context features, relative to their RMS (0: off)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch_size", type=int, default=1, help="sequences per rank per micro-step")
    g.add_argument("--grad_accum", type=int, default=4, help="micro-steps per optimizer step")
    g.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    g.add_argument("--warmup_ratio", type=float, default=0.04, help="linear warmup fraction, then cosine to 0")
    g.add_argument("--epochs", type=int, default=6, help="epochs (unless --max_steps)")
    g.add_argument("--max_steps", type=int, default=0, help="optimizer steps (0: from --epochs)")
    g.add_argument("--grad_clip", type=float, default=1.0, help="gradient norm clip")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max_bad_steps", type=int, default=10, help="stop after this many consecutive non-finite steps")
    g = p.add_argument_group("system")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="torch.compile the drafter (auto: on for CUDA, off on CPU)")
    g.add_argument("--attention", choices=["auto", "flex", "dense"], default="auto",
                   help="attention path (auto: flex on CUDA, dense SDPA elsewhere)")
    g.add_argument("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto",
                   help="target dtype (auto: bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--save_dtype", choices=list(SAVE_DTYPES), default="fp32",
                   help="checkpoint weights dtype (fp32 resumes exactly; bf16 halves the size)")
    g.add_argument("--device", default=None, help="device (default: cuda:LOCAL_RANK if available, else cpu)")
    g.add_argument("--trust_remote_code", action="store_true", help="allow the target's custom code")
    g.add_argument("--seed", type=int, default=0, help="random seed")
    g.add_argument("--log_every", type=int, default=10, help="log every N steps")
    g.add_argument("--eval_every", type=int, default=500, help="held-out evaluation every N steps (0: at the end)")
    g.add_argument("--save_every", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    g.add_argument("--debug", action="store_true", help="show tracebacks for input errors (or DFLASH_DEBUG=1)")
    return p


def run_main(fn, args):
    """Run fn(args) as a command: bad input (a DFlashError) is one `error:` line on stderr and exit code 2, with the
    traceback only under --debug or DFLASH_DEBUG=1. Shared by dflash.py and eval.py."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no weight-loading bars: stderr is for errors and our own progress
    try:
        return fn(args)
    except DFlashError as e:
        if args.debug or os.environ.get("DFLASH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = get_parser().parse_args(argv)

    def run(args):
        if args.demo or not argv:
            from demo import run_demo
            return run_demo(argv)
        for flag in ("target", "data"):
            if not getattr(args, flag):
                raise DFlashError(f"--{flag} is required (or run `python dflash.py` with no arguments for the demo)")
        return train(args)

    run_main(run, args)


if __name__ == "__main__":
    main()
