"""Sliding windows at B = 8 for W in {3, B-1, B, 2B}: W < B is legal (the window then cuts inside the block).

For each W: the mask rule against a brute-force table written from the one sentence "a key is visible only if
q_pos - k_pos < W (and, in a sliding layer that is explicitly non-causal, also k_pos - q_pos < W)"; the
training-mode forward against eval.NeuralDrafter drafting one block at a time; flex attention (eager) against
the dense path. Tiny fp32 configs on CPU."""

import math

import pytest
import torch
import torch.nn as nn
from types import SimpleNamespace

import dflash
from conftest import tiny_cfg, visible
from eval import NeuralDrafter

B = 8
WINDOWS = [3, B - 1, B, 2 * B]
S = 21                                   # context length: longer than every window
ANCHORS = torch.tensor([[0, 1, 3, 7, 8, 12, 19, 20, 0]])
VALID = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
CAUSALITY = [None, False]                # None: sliding layers causal (the default); False: explicitly non-causal


def table(causal, window):
    """The flex layout, written out: queries N*B, keys [S context ; N blocks of B]."""
    N = ANCHORS.shape[1]
    out = torch.zeros(1, N * B, S + N * B, dtype=torch.bool)
    for n in range(N):
        a, ok = int(ANCHORS[0, n]), bool(VALID[0, n])
        for i in range(B):
            for j in range(S):
                out[0, n * B + i, j] = visible(a, ok, i, "ctx", j, causal, window)
            for n2 in range(N):
                for i2 in range(B):
                    out[0, n * B + i, S + n2 * B + i2] = visible(a, ok, i, "blk", i2, causal, window, n2 == n)
    return out


def config(window, is_causal):
    return tiny_cfg(block_size=B, sliding_window=window, is_causal=is_causal,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])


@pytest.mark.parametrize("is_causal", CAUSALITY)
@pytest.mark.parametrize("window", WINDOWS)
def test_window_mask_equals_brute_force(window, is_causal):
    from torch.nn.attention.flex_attention import create_mask
    cfg = config(window, is_causal)
    N = ANCHORS.shape[1]
    dense = dflash.build_masks(cfg, ANCHORS, VALID, S, "dense")
    for li in (0, 2):
        causal, win = cfg.layer_kind(li)
        assert win == (window if li < 2 else None)
        assert causal == (li < 2 if is_causal is None else False)
        expected = table(causal, win)
        mod = dflash.make_mask_mod(ANCHORS, VALID, S, B, causal, win)
        got = create_mask(mod, 1, 1, N * B, S + N * B, device="cpu")[:, 0]
        assert torch.equal(got, expected), f"W={window} layer {li}: mask_mod differs from the table"
        own = torch.stack([expected[0, n * B:(n + 1) * B][:, list(range(S)) + list(range(S + n * B, S + n * B + B))]
                           for n in range(N)])[None]
        assert torch.equal(torch.cat(dense[(causal, win)][:2], -1), own), \
            f"W={window} layer {li}: dense masks differ from the table"
    if window < B:  # the window cuts inside the block: offset B-1 cannot see the anchor
        assert not table(True, window)[0, B - 1, S]


def randomized(cfg, seed=0):
    torch.manual_seed(seed)
    d = dflash.DFlashDrafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else torch.randn_like(p) / math.sqrt(p.shape[1]))
    return d.eval()


@pytest.fixture(scope="module")
def parts():
    g = torch.Generator().manual_seed(3)
    cfg = config(3, None)
    embed, lm_head = nn.Embedding(cfg.vocab_size, cfg.hidden_size), nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
    with torch.no_grad():
        embed.weight.normal_(generator=g)
        lm_head.weight.normal_(generator=g)
    ctx = torch.randn(1, S, 2 * cfg.hidden_size, generator=g)
    tokens = torch.randint(0, cfg.vocab_size - 1, (1, S), generator=g)
    return SimpleNamespace(embed=embed, lm_head=lm_head, ctx=ctx, tokens=tokens)


def forward(drafter, p):
    with torch.no_grad():
        x = p.embed(dflash.block_input_ids(p.tokens, ANCHORS.clamp(max=S - 1), B, drafter.cfg.mask_token_id))
        return drafter(p.ctx, x, ANCHORS, VALID)


@pytest.mark.parametrize("is_causal", CAUSALITY)
@pytest.mark.parametrize("window", WINDOWS)
def test_window_training_forward_equals_block_at_a_time(window, is_causal, parts, one_thread):
    drafter = randomized(config(window, is_causal))
    hidden = forward(drafter, parts)
    for n in range(ANCHORS.shape[1]):
        if not VALID[0, n]:
            continue
        a = int(ANCHORS[0, n])
        one = NeuralDrafter(drafter)
        if a == 0:  # no context at all: an empty cache
            z = torch.zeros(1, 0, drafter.cfg.num_key_value_heads, drafter.cfg.head_dim)
            one.target, one.kv, one.length = parts, [(z, z)] * drafter.cfg.num_hidden_layers, 0
        else:
            one.start(parts, [0] * a, parts.ctx[:, :a])
        drafts = one.draft(int(parts.tokens[0, a]), B - 1)
        assert drafts == parts.lm_head(hidden[0, n, 1:]).argmax(-1).tolist(), f"W={window} anchor {a}"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", WINDOWS)
def test_window_flex_equals_dense(window, parts, monkeypatch, one_thread):
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(dflash, "compiled_flex_attention", flex_attention)  # eager flex: fast to start on CPU
    for is_causal in CAUSALITY:
        drafter = randomized(config(window, is_causal))
        dense = forward(drafter, parts)
        drafter.attention = "flex"
        flex = forward(drafter, parts)
        assert (flex - dense).abs().max().item() < 1e-5, f"W={window} is_causal={is_causal}"


def quadratic_attention(q, k, v, block_mask, enable_gqa):
    """A differentiable stand-in for flex on CPU (flex has no backward here), in plain math: every query of the flex
    layout (b, h, N*B, hd) against [context ; all blocks], the mask_mod materialised; a row that sees nothing
    (a padding anchor) gives 0, as flex does."""
    from torch.nn.attention.flex_attention import create_mask
    b, h, L, hd = q.shape
    seen = create_mask(block_mask.mask_mod, b, 1, L, k.shape[2], device=q.device)  # (b, 1, N*B, S + N*B)
    k, v = (t.repeat_interleave(h // t.shape[1], 1) for t in (k, v))
    any_key = seen.any(-1, keepdim=True)
    s = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~seen, float("-inf")).masked_fill(~any_key, 0.0)
    return torch.softmax(s, -1) * any_key @ v


@pytest.mark.parametrize("window", WINDOWS)
def test_window_dense_gradients_equal_quadratic_reference(window, parts, monkeypatch, one_thread):
    """The dense path's two-part softmax against one softmax over the whole flex layout: the same outputs and the
    same gradients (every parameter, the block embeddings, the context features) to fp32 rounding, for sliding
    layers with this W (causal and not) and the full layer; with all blocks in one group over the whole context,
    and split into groups over their own spans of it (dflash.context_spans at a small tile)."""
    monkeypatch.setattr(dflash, "compiled_flex_attention", quadratic_attention)
    for is_causal in CAUSALITY:
        drafter = randomized(config(window, is_causal)).train()
        x = parts.embed(dflash.block_input_ids(parts.tokens, ANCHORS.clamp(max=S - 1), B, drafter.cfg.mask_token_id))

        def run(path):
            drafter.attention = path
            drafter.zero_grad(set_to_none=True)
            xg, ctx = x.detach().requires_grad_(True), parts.ctx.clone().requires_grad_(True)
            hidden = drafter(ctx, xg, ANCHORS, VALID)
            (hidden * VALID[..., None, None]).square().sum().backward()
            return {"hidden": hidden.detach(), "x": xg.grad, "ctx": ctx.grad,
                    **{k: p.grad for k, p in drafter.named_parameters()}}

        quad = run("flex")
        for tile in (S, 5):  # S: one group; 5: four groups of blocks over spans of 21 context keys
            monkeypatch.setattr(dflash, "CONTEXT_TILE", tile)
            dense = run("dense")
            for k in dense:
                scale = quad[k].abs().max().item()
                assert torch.isfinite(dense[k]).all(), f"W={window} is_causal={is_causal}: non-finite {k}"
                assert (dense[k] - quad[k]).abs().max().item() <= 1e-5 * max(scale, 1.0), \
                    f"W={window} is_causal={is_causal} tile={tile}: {k} differs from the quadratic reference"
