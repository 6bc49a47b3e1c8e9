"""The drafter: training-mode forward vs per-block inference, flex vs dense attention, the mask rule against a
brute-force table of who sees what, checkpoints (round trip, atomic save, z-lab directories, strict
loading), RoPE against Hugging Face's, and the default geometry. Tiny fp32 configs on CPU."""

import json
import math
import os
from pathlib import Path

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import dflash
from conftest import (ANCHORS, S, TINY_CFG, VALID, ZL, block_ids, cache_kv, randomized, ref_attention, ref_rms,
                      tiny_cfg, visible, write_zlab_dir, zlab_config, zlab_tensors)
from dflash import DFlashConfig, DFlashDrafter, DFlashError
from eval import NeuralDrafter

V, D, HD, B, W = (TINY_CFG[k] for k in ("vocab_size", "hidden_size", "head_dim", "block_size", "sliding_window"))
MASK_ID = TINY_CFG["mask_token_id"]


@pytest.fixture(scope="module")
def setup():
    cfg = tiny_cfg()
    drafter = randomized(cfg)
    g = torch.Generator().manual_seed(1)
    ctx_feats = torch.randn(2, S, 2 * D, generator=g)
    tokens = torch.randint(0, V - 1, (2, S), generator=g)
    embed = nn.Embedding(V, D)
    lm_head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        embed.weight.normal_(generator=g)
        lm_head.weight.normal_(generator=g)
        x = embed(block_ids(tokens, ANCHORS))
        hidden = drafter(ctx_feats, x, ANCHORS, VALID)
    return dict(cfg=cfg, drafter=drafter, ctx=ctx_feats, tokens=tokens, embed=embed, lm_head=lm_head, x=x, hidden=hidden)


# -----------------------------------------------------------------------------
# An independent reference for one block, from the drafter's weights only: a block token sees the context before
# its anchor (within the window on sliding layers) and its own block (earlier offsets only on causal layers)


def reference_block(drafter, ctx_feats, a, x):
    """ctx_feats (S, m*D) for one sequence, anchor a, x (B, D) block embeddings -> final-normed (B, D), float64."""
    cfg = drafter.cfg
    P = {k: v.double() for k, v in drafter.state_dict().items()}
    ctx = ref_rms(ctx_feats.double()[:a] @ P["fc.weight"].T, P["hidden_norm.weight"])   # only context j < a exists
    h = x.double()
    for li in range(cfg.num_hidden_layers):
        p = f"layers.{li}."
        causal = cfg.layer_types[li] == "sliding_attention"  # is_causal unset: causal iff sliding
        hn = ref_rms(h, P[p + "input_layernorm.weight"])
        h = h + ref_attention(hn, ctx, P, p, a, cfg, causal)
        hn = ref_rms(h, P[p + "post_attention_layernorm.weight"])
        h = h + (F.silu(hn @ P[p + "mlp.gate_proj.weight"].T) * (hn @ P[p + "mlp.up_proj.weight"].T)) \
            @ P[p + "mlp.down_proj.weight"].T
    return ref_rms(h, P["norm.weight"])


def test_training_forward_matches_independent_reference(setup, one_thread):
    s = setup
    for r, n in [(0, 0), (0, 1), (0, 4), (0, 8), (1, 1), (1, 4), (1, 5)]:
        a = int(ANCHORS[r, n])
        ref = reference_block(s["drafter"], s["ctx"][r], a, s["x"][r, n])
        diff = (s["hidden"][r, n].double() - ref).abs().max().item()
        assert diff < 1e-4, f"row {r} anchor {a}: training forward differs from the reference by {diff}"


# -----------------------------------------------------------------------------
# Training-mode forward == inference-mode forward, block by block


def test_training_forward_equals_per_block_inference(setup, one_thread):
    s = setup
    drafter, cfg, hidden = s["drafter"], s["cfg"], s["hidden"]
    assert torch.isfinite(hidden).all(), "padding anchors must not produce NaN/inf"
    checked = 0
    for r in range(2):
        for n in range(ANCHORS.shape[1]):
            if not VALID[r, n]:
                continue
            a = int(ANCHORS[r, n])
            cache = NeuralDrafter(drafter)
            cache.start(target_like(s), [0] * a, s["ctx"][r:r + 1, :a])  # hidden states exist for positions < a
            assert cache.length == a
            with torch.no_grad():
                h = drafter.blocks(s["x"][r:r + 1, n:n + 1], ANCHORS[r:r + 1, n:n + 1],
                                   torch.ones(1, 1, dtype=torch.bool), cache_kv(cache, cfg), a)
            diff = (h[0, 0] - hidden[r, n]).abs().max().item()
            assert diff < 1e-5, f"row {r} anchor {a}: training vs inference hidden differ by {diff}"
            toks = torch.tensor(cache.draft(int(s["tokens"][r, a]), B - 1))
            assert toks.shape == (B - 1,)
            assert torch.equal(toks, s["lm_head"](hidden[r, n, 1:]).argmax(-1)), f"row {r} anchor {a}: drafts differ"
            checked += 1
    assert checked == 15


def test_padding_anchors_backward_is_finite(setup):
    cfg = setup["cfg"]
    drafter = randomized(cfg).train()
    x = setup["x"].clone().requires_grad_(True)
    hidden = drafter(setup["ctx"], x, ANCHORS, VALID)
    (hidden * VALID[..., None, None]).square().sum().backward()
    for name, p in drafter.named_parameters():
        assert torch.isfinite(p.grad).all(), f"non-finite gradient in {name} (fully masked padding rows?)"
    assert torch.equal(x.grad[~VALID], torch.zeros_like(x.grad[~VALID])), "padding anchors leak gradient"


def target_like(setup):
    """What NeuralDrafter reads of a target: its embedding and lm_head."""
    return SimpleNamespace(embed=setup["embed"], lm_head=setup["lm_head"])


def test_draft_cache_extend_in_pieces(setup, one_thread):
    drafter, ctx, cfg = setup["drafter"], setup["ctx"][:1], setup["cfg"]
    whole = NeuralDrafter(drafter)
    whole.start(target_like(setup), [0] * 15, ctx[:, :15])
    parts = NeuralDrafter(drafter)
    parts.start(target_like(setup), [0] * 7, ctx[:, :7])
    parts.accept([0], ctx[:, 7:8])
    parts.accept([0] * 7, ctx[:, 8:15])
    assert parts.length == whole.length == 15
    for (k0, v0), (k1, v1) in zip(whole.kv, parts.kv):
        assert k0.shape == k1.shape == (1, 15, cfg.num_key_value_heads, cfg.head_dim)
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=0)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0)
    assert parts.draft(5, cfg.block_size - 1) == whole.draft(5, cfg.block_size - 1)


# -----------------------------------------------------------------------------
# flex_attention == the dense path (compiled and eager flex)


def attention_outputs(drafter, setup, path):
    drafter.attention, outs = path, []
    hooks = [layer.self_attn.register_forward_hook(lambda m, i, o: outs.append(o)) for layer in drafter.layers]
    try:
        with torch.no_grad():
            hidden = drafter(setup["ctx"], setup["x"], ANCHORS, VALID)
    finally:
        drafter.attention = "dense"
        for h in hooks:
            h.remove()
    return hidden, outs


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_flex_equals_dense(setup, mode, monkeypatch):
    if mode == "eager":
        from torch.nn.attention.flex_attention import flex_attention
        monkeypatch.setattr(dflash, "compiled_flex_attention", flex_attention)
    drafter = setup["drafter"]
    dense, dense_attn = attention_outputs(drafter, setup, "dense")
    flex, flex_attn = attention_outputs(drafter, setup, "flex")
    if mode == "compiled":
        from torch.nn.attention.flex_attention import flex_attention
        assert dflash.compiled_flex_attention is not flex_attention
    assert (flex[VALID] - dense[VALID]).abs().max().item() < 1e-5
    assert (flex[~VALID] - dense[~VALID]).abs().max().item() < 1e-5
    for a_d, a_f in zip(dense_attn, flex_attn):
        # fully masked rows (padding anchors): zero attention output on both paths (o_proj has no bias)
        assert torch.equal(a_d[~VALID], torch.zeros_like(a_d[~VALID]))
        assert torch.equal(a_f[~VALID], torch.zeros_like(a_f[~VALID]))
        assert (a_d - a_f).abs().max().item() < 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_plain_attention_is_what_both_fast_paths_compute(setup, monkeypatch, one_thread):
    """Part I's plain attention (softmax(q k^T / sqrt(hd)) v over the mask rule's whole table) against the dense path
    and flex's forward (eager: it runs on CPU): every layer's attention output and the drafter's, padding anchors 0;
    and the dense path's gradients, finite."""
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(dflash, "compiled_flex_attention", flex_attention)
    drafter = setup["drafter"]
    plain, plain_attn = attention_outputs(drafter, setup, "plain")
    assert len(plain_attn) == TINY_CFG["num_hidden_layers"] and plain.abs().max() > 0.1
    for path in ("dense", "flex"):
        fast, fast_attn = attention_outputs(drafter, setup, path)
        assert (plain - fast).abs().max().item() < 1e-5, f"plain attention != the {path} path"
        for a_p, a_f in zip(plain_attn, fast_attn):
            assert torch.equal(a_p[~VALID], torch.zeros_like(a_p[~VALID]))
            assert (a_p - a_f).abs().max().item() < 1e-5, f"a layer's plain attention != the {path} path"
    grads = {}
    for path in ("plain", "dense"):
        d = randomized(setup["cfg"]).train()
        d.attention = path
        (d(setup["ctx"], setup["x"], ANCHORS, VALID) * VALID[..., None, None]).square().sum().backward()
        grads[path] = {k: p.grad for k, p in d.named_parameters()}
    for k, g in grads["plain"].items():
        assert torch.isfinite(g).all(), f"non-finite plain gradient in {k}"
        torch.testing.assert_close(g, grads["dense"][k], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [3, 1000])
def test_plain_ce_is_the_chunked_loss(setup, chunk, one_thread):
    """Part I's loss in plain form (full logits, F.cross_entropy, the weights) against weighted_ce's chunked one
    (ChunkedLMHead, CE.reweigh) in one chunk and in many: sum(w * CE) and its gradient within 1e-5, the same stats;
    and the drafter's block_loss takes the plain form under --attention plain."""
    hidden, lm_head = setup["hidden"].detach(), setup["lm_head"]
    g = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, hidden.shape[:3], generator=g)
    labels[..., 0] = -1                                                        # as block_labels gives at y[0]
    weights = dflash.loss_weights(ANCHORS, VALID, torch.ones(2, S), B, 4.0)    # 0 at offset 0 and padding anchors
    out = {}
    for name, fn in (("plain", dflash.plain_ce), ("chunked", lambda *a: dflash.weighted_ce(*a, chunk=chunk))):
        h = hidden.clone().requires_grad_()
        ce_w, stats = fn(h, lm_head, labels, weights)
        ce_w.backward()
        out[name] = ce_w.detach(), stats, h.grad
    (p, ps, pg), (c, cs, cg) = out["plain"], out["chunked"]
    assert p > 1 and weights.sum() > 5 and pg.abs().max() > 0
    torch.testing.assert_close(p, c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pg, cg, rtol=1e-5, atol=1e-6)
    assert ps.keys() == cs.keys()
    for k in ps:
        torch.testing.assert_close(ps[k], cs[k], rtol=1e-5, atol=1e-5)
    assert (ps["w"] - weights.sum()).abs() < 1e-5                            # the loss is ce_w / sum(w)
    d = randomized(setup["cfg"])
    for path, used in (("plain", "plain_ce"), ("dense", "weighted_ce")):
        d.attention, seen = path, []
        real = getattr(dflash, used)
        with pytest.MonkeyPatch.context() as m:
            m.setattr(dflash, used, lambda *a, **k: seen.append(1) or real(*a, **k))
            d.block_loss(hidden, lm_head, labels, weights, None, loss=dflash.CE())
        assert seen == [1], f"--attention {path}: block_loss did not take {used}"


# -----------------------------------------------------------------------------
# The hooks a variant overrides: blocks (the final hidden state) and Layer(cfg, index)


class OffsetBias(DFlashDrafter):
    """A toy variant changing the final hidden state through blocks: a random vector per block offset added."""

    def __init__(self, cfg, attention="dense"):
        super().__init__(cfg, attention)
        g = torch.Generator().manual_seed(3)
        self.offset_bias = nn.Parameter(10 * torch.randn(cfg.block_size, cfg.hidden_size, generator=g))

    def blocks(self, x, anchors, anchor_valid, kv, S):
        return super().blocks(x, anchors, anchor_valid, kv, S) + self.offset_bias


def test_overriding_blocks_changes_what_is_trained_and_measured_alike(dense, one_thread):
    """One hook for the final hidden state: training's loss, the walk's drafts and eval.py's per-block drafts all go
    through blocks, so the toy's override moves all three, and the walk drafts what training's forward gives."""
    from conftest import loss_of
    target, base = dense["target"], dense["drafter"]
    toy = OffsetBias(base.cfg).eval()
    toy.load_state_dict(base.state_dict(), strict=False)
    prompt, cont = dense["prompts"][0], dense["continuations"][0]
    batch = dflash.collate([(prompt + cont, [0] * len(prompt) + [1] * len(cont))], 0)
    anchors, valid = dflash.batch_anchors(batch, 8)
    with torch.no_grad():
        assert loss_of(toy, target, batch, anchors, valid)[0] != loss_of(base, target, batch, anchors, valid)[0]
    walked = {d: dflash.walk_continuation(d, target, prompt, cont)[1] for d in (base, toy)}
    assert walked[toy] != walked[base]
    ids = torch.tensor([prompt + cont])
    context, _ = dflash.target_features(target, ids, toy.cfg.target_layer_ids)
    every = torch.arange(len(prompt), ids.shape[1] - 1)[None]  # the walk's anchors, through training's forward
    with torch.no_grad():
        x = dflash.embed_blocks(target, dflash.block_input_ids(ids, every, toy.cfg.block_size, toy.cfg.mask_token_id))
        hidden = toy(context, x, every, torch.ones_like(every, dtype=torch.bool))
    assert target.lm_head(hidden[0, :, 1:]).argmax(-1).tolist() == walked[toy]
    cache = NeuralDrafter(toy)  # eval.py's loop: one block over an incremental cache
    cache.start(target, prompt, context[:, :len(prompt)])
    assert cache.draft(cont[0], toy.cfg.block_size - 1) == walked[toy][0]  # the block anchored at s[0]


def test_a_variant_layer_gets_its_index():
    """Layer(cfg, index): a variant mixes layer kinds by index (here: layer 1 skips its MLP)."""
    class NoMLP(dflash.DecoderLayer):
        def __init__(self, cfg, index):
            super().__init__(cfg, index)
            self.index = index
            if index == 1:
                self.mlp = None

        def forward(self, x, *a):
            return super().forward(x, *a) if self.mlp else x + self.self_attn(self.input_layernorm(x), *a)

    class Mixed(DFlashDrafter):
        Layer = NoMLP

    cfg = tiny_cfg()
    torch.manual_seed(0)
    drafter = Mixed(cfg)
    assert [layer.index for layer in drafter.layers] == list(range(cfg.num_hidden_layers))
    assert not any(k.startswith("layers.1.mlp.") for k in drafter.state_dict())
    assert any(k.startswith("layers.0.mlp.") for k in drafter.state_dict())
    g = torch.Generator().manual_seed(0)
    ctx, x = torch.randn(1, S, 2 * D, generator=g), torch.randn(1, 2, B, D, generator=g)
    assert torch.isfinite(drafter(ctx, x, torch.tensor([[3, 7]]), torch.ones(1, 2, dtype=torch.bool))).all()


def test_overriding_forward_is_refused():
    """A variant's Drafter overriding forward would change training only: its config is refused in one line."""
    class Forward(DFlashDrafter):
        def forward(self, *a):
            return super().forward(*a) * 2

    class Config(DFlashConfig):
        Drafter = Forward

    with pytest.raises(DFlashError, match="^Forward overrides forward, which the walk and eval.py never call; over"):
        Config(**TINY_CFG)


# -----------------------------------------------------------------------------
# The mask rule against a brute-force table: context strictly before the anchor, then the own block


def spec_layer_kind(layer_type, is_causal, window):
    """Causal iff config.is_causal says so, else iff sliding; a sliding layer has window W."""
    causal = is_causal if is_causal is not None else layer_type == "sliding_attention"
    return causal, (window if layer_type == "sliding_attention" else None)


MASK_S, MASK_B = 10, 4
MASK_ANCHORS = torch.tensor([[0, 1, 4, 9, 0], [2, 6, 7, 3, 5]])
MASK_VALID = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)


def brute_dense(anchors, valid, S, Bk, causal, window):
    b, N = anchors.shape
    out = torch.zeros(b, N, Bk, S + Bk, dtype=torch.bool)
    for r in range(b):
        for n in range(N):
            for i in range(Bk):
                for j in range(S):
                    out[r, n, i, j] = visible(int(anchors[r, n]), bool(valid[r, n]), i, "ctx", j, causal, window)
                for i2 in range(Bk):
                    out[r, n, i, S + i2] = visible(int(anchors[r, n]), bool(valid[r, n]), i, "blk", i2, causal, window)
    return out


def brute_full(anchors, valid, S, Bk, causal, window):
    """The flex layout: queries N*B, keys [S context ; N blocks of B]."""
    b, N = anchors.shape
    out = torch.zeros(b, N * Bk, S + N * Bk, dtype=torch.bool)
    for r in range(b):
        for n in range(N):
            a, ok = int(anchors[r, n]), bool(valid[r, n])
            for i in range(Bk):
                for j in range(S):
                    out[r, n * Bk + i, j] = visible(a, ok, i, "ctx", j, causal, window)
                for n2 in range(N):
                    for i2 in range(Bk):
                        out[r, n * Bk + i, S + n2 * Bk + i2] = visible(a, ok, i, "blk", i2, causal, window, n2 == n)
    return out


@pytest.mark.parametrize("is_causal", [None, False, True])
@pytest.mark.parametrize("window", [2, 5])
def test_mask_equals_brute_force(is_causal, window):
    from torch.nn.attention.flex_attention import create_mask
    cfg = tiny_cfg(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=window,
                   is_causal=is_causal, block_size=MASK_B)
    b, N = MASK_ANCHORS.shape
    masks = dflash.build_masks(cfg, MASK_ANCHORS, MASK_VALID, MASK_S, "dense")
    for li, lt in enumerate(cfg.layer_types):
        causal, win = spec_layer_kind(lt, is_causal, window)
        assert cfg.layer_kind(li) == (causal, win)
        expected = brute_dense(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, causal, win)
        mod = dflash.make_mask_mod(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, causal, win)
        got = torch.cat(dflash.dense_masks(mod, b, N, MASK_S, MASK_B, torch.device("cpu")), -1)  # [ctx ; own]
        assert got.shape == expected.shape
        assert torch.equal(got, expected), f"layer {li} ({lt}, is_causal={is_causal}, W={window}): dense mask wrong"
        assert torch.equal(torch.cat(masks[(causal, win)][:2], -1), expected), "build_masks gave a layer the wrong mask"
        full = create_mask(mod, b, 1, N * MASK_B, MASK_S + N * MASK_B, device="cpu")[:, 0]
        assert torch.equal(full, brute_full(MASK_ANCHORS, MASK_VALID, MASK_S, MASK_B, causal, win)), \
            f"layer {li}: flex mask_mod wrong over [context ; all blocks]"


def test_mask_sanity_examples():
    """A few entries spelled out, so a reader sees the rule: anchor 4, B=4, W=2, non-causal sliding."""
    mod = dflash.make_mask_mod(torch.tensor([[4]]), torch.tensor([[True]]), 10, 4, False, 2)
    m = torch.cat(dflash.dense_masks(mod, 1, 1, 10, 4, torch.device("cpu")), -1)[0, 0]   # (B, S+B)
    assert m[0, 3] and not m[0, 4]          # context j=3 < a=4 visible; the anchor's own position j=4 is not
    assert not m[0, 2]                      # q_pos 4 - j 2 = 2 is not < W=2
    assert not m[2, 3]                      # q_pos 6 - j 3 = 3 >= W
    assert m[0, 10 + 1] and not m[0, 10 + 2]  # non-causal sliding: k_pos - q_pos < W
    assert m[3, 10 + 2] and not m[3, 10 + 0]  # the window cuts inside the block too: q_pos 7 - k_pos 4 = 3 >= W


# -----------------------------------------------------------------------------
# Cost: the dense path's masks and scores are linear in the number of anchors, with no copy of the context


def test_dense_path_is_linear_in_anchors_without_copies(monkeypatch):
    """Every tensor of a dense training step (forward and backward), recorded op by op: the largest is the context
    scores (b, h, N*B, S), linear in N; neither a per-anchor copy of the context keys/values (b, N, S, hk, hd)
    (twice the scores here: hk*hd = 32 > h*B = 16) nor the quadratic (N*B) x (S + N*B) scores of the flex layout
    ever exist. One pair of masks per distinct (causal, window), shared by the layers; no flex BlockMask."""
    from torch.utils._python_dispatch import TorchDispatchMode
    cfg = tiny_cfg(head_dim=16)
    h, Bk = cfg.num_attention_heads, cfg.block_size
    drafter = randomized(cfg).train()
    b, Sx = 2, 24
    real_masks, mask_shapes = dflash.dense_masks, []

    def rec_masks(*a, **k):
        ctx, own = real_masks(*a, **k)
        mask_shapes.append((tuple(ctx.shape), tuple(own.shape)))
        return ctx, own

    def no_flex(*a, **k):
        raise AssertionError("the dense path built a flex BlockMask")

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes.extend(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
            return out

    monkeypatch.setattr(dflash, "dense_masks", rec_masks)
    monkeypatch.setattr(dflash, "create_block_mask", no_flex)
    monkeypatch.setattr(dflash, "compiled_create_block_mask", no_flex)
    for N in (16, 32):
        sizes, mask_shapes[:] = [], []
        anchors = torch.arange(N).repeat(b, 1) % (Sx - 1)
        ctx, x = torch.randn(b, Sx, 2 * D), torch.randn(b, N, Bk, D, requires_grad=True)
        with Sizes():
            drafter(ctx, x, anchors, torch.ones(b, N, dtype=torch.bool)).square().sum().backward()
        assert mask_shapes == [((b, N, Bk, Sx), (b, N, Bk, Bk))] * 2, "one mask pair per distinct (causal, window)"
        assert max(sizes) == b * h * N * Bk * Sx, f"{N} anchors: a tensor larger than the context scores"


# -----------------------------------------------------------------------------
# Checkpoints


def state_equal(d1, d2):
    s1, s2 = d1.state_dict(), d2.state_dict()
    return s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_save_load_round_trip(tmp_path):
    cfg = tiny_cfg(attention_bias=True)
    d = randomized(cfg)
    p = dflash.save_drafter(d, str(tmp_path / "fp32"), dtype=torch.float32)
    loaded = dflash.load_drafter(p)
    assert loaded.cfg == cfg
    assert state_equal(loaded, d), "fp32 round trip must be bit-exact"
    with safe_open(os.path.join(p, "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float32 for k in f.keys())

    p16 = dflash.save_drafter(d, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    with safe_open(os.path.join(p16, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    assert keys == set(dflash.expected_shapes(cfg)), "file keys are exactly the z-lab names"
    with open(os.path.join(p16, "config.json")) as f:
        c = json.load(f)
    assert c["torch_dtype"] == "bfloat16"
    assert c["architectures"] == ["DFlashDraftModel"]
    assert (c["dflash_config"]["mask_token_id"], c["dflash_config"]["target_layer_ids"]) == (MASK_ID, [1, 3])
    assert (c["block_size"], c["num_target_layers"], c["sliding_window"]) == (B, 5, W)
    assert c["layer_types"] == cfg.layer_types
    l16 = dflash.load_drafter(p16)
    ref = {k: v.to(torch.bfloat16).float() for k, v in d.state_dict().items()}
    assert all(torch.equal(l16.state_dict()[k], ref[k]) for k in ref)
    lb = dflash.load_drafter(p16, dtype=torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in lb.state_dict().values() if v.is_floating_point())


def _listing(path):
    return sorted(os.listdir(path))


@pytest.mark.parametrize("crash_in", ["safetensors", "config"])
def test_save_is_atomic(tmp_path, monkeypatch, crash_in):
    cfg = tiny_cfg()
    old, new = randomized(cfg, seed=1), randomized(cfg, seed=2)
    path = str(tmp_path / "drafter")
    dflash.save_drafter(old, path, dtype=torch.float32)
    before = _listing(path)

    import safetensors.torch
    real_save = safetensors.torch.save_file

    def crash_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)          # a partial file, then the process dies
        raise RuntimeError("simulated crash: disk full")

    def crash_dump(obj, f, **kw):
        f.write('{"architectures": [')
        raise RuntimeError("simulated crash: disk full")

    if crash_in == "safetensors":
        monkeypatch.setattr(safetensors.torch, "save_file", crash_save)
    else:
        monkeypatch.setattr(dflash.json, "dump", crash_dump)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dflash.save_drafter(new, path, dtype=torch.float32)
    with pytest.raises(RuntimeError, match="simulated crash"):
        dflash.save_drafter(new, str(tmp_path / "fresh"), dtype=torch.float32)
    monkeypatch.undo()
    assert safetensors.torch.save_file is real_save
    assert _listing(path) == before
    assert state_equal(dflash.load_drafter(path), old), "the previous checkpoint must survive a crashed save"
    assert not os.path.exists(tmp_path / "fresh"), "a crashed first save must not leave a partial directory"
    dflash.save_drafter(new, path, dtype=torch.float32)  # and a later save still works
    assert state_equal(dflash.load_drafter(path), new)


# z-lab layout directories, written by hand in conftest (not from dflash's helpers)


def test_zlab_directory_loads_and_drafts(tmp_path):
    z = ZL
    t = zlab_tensors()
    d = dflash.load_drafter(write_zlab_dir(str(tmp_path / "zlab"), zlab_config(), t))
    cfg = d.cfg
    assert (cfg.mask_token_id, cfg.target_layer_ids, cfg.num_target_layers) == (z["M"], z["T"], z["L"])
    assert (cfg.block_size, cfg.sliding_window, cfg.rope_theta) == (z["Bs"], z["Wz"], 1e6)
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg.rope_scaling is None and cfg.head_dim == z["hd"] and cfg.num_key_value_heads == z["kv"]
    assert [cfg.layer_kind(i)[0] for i in range(3)] == [True, True, False]
    sd = d.state_dict()
    assert all(torch.equal(sd[k], v.float()) for k, v in t.items())

    g = torch.Generator().manual_seed(3)
    embed, head = nn.Embedding(z["V"], z["D"]), nn.Linear(z["D"], z["V"], bias=False)
    target, ctx = SimpleNamespace(embed=embed, lm_head=head), torch.randn(1, 9, 2 * z["D"], generator=g)
    cache = NeuralDrafter(d)
    cache.start(target, [0] * 9, ctx)
    toks = torch.tensor(cache.draft(7, z["Bs"] - 1))
    assert toks.shape == (z["Bs"] - 1,) and toks.dtype == torch.long
    assert ((toks >= 0) & (toks < z["V"])).all()

    # the transformers-5 rope_parameters form and a two-shard checkpoint load the same drafter
    d5 = dflash.load_drafter(write_zlab_dir(str(tmp_path / "zlab5"), zlab_config(rope="nested"), t))
    assert d5.cfg == cfg and state_equal(d5, d)
    ds = dflash.load_drafter(write_zlab_dir(str(tmp_path / "sharded"), zlab_config(), t, shards=2))
    assert len([f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]) == 2
    assert ds.cfg == cfg and state_equal(ds, d)
    # the same drafts, and torch_dtype does not silently change the requested dtype
    cache_s = NeuralDrafter(ds)
    cache_s.start(target, [0] * 9, ctx)
    assert cache_s.draft(7, z["Bs"] - 1) == toks.tolist()
    assert d.fc.weight.dtype == torch.float32


def test_zlab_top_level_fallbacks(tmp_path):
    """Values missing from dflash_config are read from the top level; dflash_config wins when both exist."""
    c = zlab_config()
    c["dflash_config"] = {"mask_token_id": ZL["M"]}
    c["target_layer_ids"] = ZL["T"]
    c["mask_token_id"] = 3  # dflash_config wins
    d = dflash.load_drafter(write_zlab_dir(str(tmp_path / "z"), c, zlab_tensors()))
    assert d.cfg.target_layer_ids == ZL["T"] and d.cfg.mask_token_id == ZL["M"]


# -----------------------------------------------------------------------------
# RoPE == Hugging Face's


@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_rope_matches_hf(rope):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    theta = 1e6
    if rope == "default":
        params, scaling = {"rope_type": "default", "rope_theta": theta}, None
    else:
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
        params = {**scaling, "rope_theta": theta}
    hf_cfg = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=1024, rope_parameters=dict(params))
    hf = Qwen3RotaryEmbedding(hf_cfg)
    cfg = tiny_cfg(hidden_size=64, head_dim=32, rope_theta=theta, rope_scaling=scaling, max_position_embeddings=1024)
    inv, scale = dflash.rope_inv_freq(cfg)
    torch.testing.assert_close(inv, hf.inv_freq, atol=0, rtol=1e-6)
    assert scale == pytest.approx(hf.attention_scaling, rel=1e-12)
    if rope == "yarn":
        assert scale > 1.0  # yarn really differs from plain RoPE here
    pos = torch.arange(0, 3000)[None]
    cos_hf, sin_hf = hf(torch.zeros(1), pos)
    cos, sin = dflash.rope_cos_sin(inv, scale, pos, torch.float32)
    torch.testing.assert_close(cos, cos_hf, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, sin_hf, atol=1e-5, rtol=0)
    d = DFlashDrafter(cfg)
    torch.testing.assert_close(d.inv_freq, hf.inv_freq, atol=0, rtol=1e-6)

    # config.json round trip keeps the rope (ours and the transformers-4 rope_scaling spelling)
    back = dflash.config_from_json(json.loads(json.dumps(dflash.config_to_json(cfg))))
    assert back == cfg
    if scaling:
        c = dflash.config_to_json(cfg)
        c.pop("rope_parameters")
        c["rope_scaling"] = dict(scaling)
        assert dflash.config_from_json(c).rope_scaling == scaling


# -----------------------------------------------------------------------------
# Bad checkpoints fail loudly, naming the problem


@pytest.fixture
def good_dir(tmp_path):
    def make(config=None, tensors=None, name="bad"):
        return write_zlab_dir(str(tmp_path / name), config or zlab_config(), tensors if tensors is not None else zlab_tensors())
    return make


def test_bad_checkpoints(good_dir, tmp_path):
    t = zlab_tensors()
    missing = dict(t)
    del missing["layers.1.mlp.up_proj.weight"]
    with pytest.raises(DFlashError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        dflash.load_drafter(good_dir(tensors=missing, name="missing"))

    wrong = dict(t)
    wrong["layers.0.self_attn.k_norm.weight"] = torch.ones(ZL["hd"] + 1)
    with pytest.raises(DFlashError, match=r"layers\.0\.self_attn\.k_norm\.weight"):
        dflash.load_drafter(good_dir(tensors=wrong, name="shape"))

    c = zlab_config()
    c["dflash_config"] = {"mask_token_id": ZL["M"], "target_layer_ids": [1, 3, 4]}  # fc holds 2 layers, not 3
    with pytest.raises(DFlashError, match=r"fc\.weight") as e:
        dflash.load_drafter(good_dir(config=c, name="fc"))
    assert "target_layer_ids" in str(e.value)

    extra = dict(t)
    extra["embed_tokens.weight"] = torch.zeros(ZL["V"], ZL["D"])
    with pytest.raises(DFlashError, match=r"embed_tokens\.weight"):
        dflash.load_drafter(good_dir(tensors=extra, name="extra"))

    prefixed = {"model." + k: v for k, v in t.items()}
    with pytest.raises(DFlashError, match=r"fc\.weight|model\."):
        dflash.load_drafter(good_dir(tensors=prefixed, name="prefixed"))

    with pytest.raises(DFlashError, match="does not exist"):
        dflash.load_drafter(str(tmp_path / "does_not_exist"))
    nocfg = Path(good_dir(name="nocfg"))
    (nocfg / "config.json").unlink()
    with pytest.raises(DFlashError, match="config.json"):
        dflash.load_drafter(str(nocfg))
    noweights = Path(good_dir(name="noweights"))
    (noweights / "model.safetensors").unlink()
    with pytest.raises(DFlashError, match="model.safetensors"):
        dflash.load_drafter(str(noweights))


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
    {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
])
def test_unknown_rope_type_is_refused(good_dir, rope):
    c = zlab_config()
    c.pop("rope_scaling")
    c.update(rope)
    name = (rope.get("rope_scaling") or rope.get("rope_parameters"))
    kind = name.get("rope_type", name.get("type"))
    with pytest.raises(DFlashError, match=kind):
        dflash.load_drafter(good_dir(config=c))


def test_missing_target_layer_ids(good_dir):
    """No target_layer_ids anywhere: vLLM captures the target model's own default layers, SGLang its spread from
    layer 1 to L-3, so the config is refused (with a spread that works when num_target_layers is known)."""
    c = zlab_config()
    c["dflash_config"] = {"mask_token_id": ZL["M"]}
    c.pop("num_target_layers")
    with pytest.raises(DFlashError, match="target_layer_ids"):
        dflash.load_drafter(good_dir(config=c, name="neither"))
    c = zlab_config(num_hidden_layers=2, num_target_layers=10, layer_types=["sliding_attention", "full_attention"])
    c["dflash_config"] = {"mask_token_id": ZL["M"]}
    with pytest.raises(DFlashError, match=r"target_layer_ids is missing.*vLLM.*SGLang.*\[1, 7\]"):
        dflash.load_drafter(good_dir(config=c, name="derived"))


def test_default_target_layer_ids():
    assert dflash.default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert dflash.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash.default_target_layer_ids(28, 1) == [14]
    assert dflash.default_target_layer_ids(7, 1) == [3]


def test_zlab_qwen36_27b_geometry():
    cfg = DFlashConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (5120, 5, 32, 8)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.block_size, cfg.mask_token_id) == (128, 17408, 16, 248070)
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.num_target_layers == 64
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    shapes = dflash.expected_shapes(cfg)
    assert shapes["fc.weight"] == (5120, 25600)
    n = sum(math.prod(s) for s in shapes.values())
    # by hand: per layer q,o 2*4096*5120 + k,v 2*1024*5120 + mlp 3*17408*5120 + norms 2*5120 + 2*128
    per_layer = 2 * 4096 * 5120 + 2 * 1024 * 5120 + 3 * 17408 * 5120 + 2 * 5120 + 2 * 128
    assert n == 5 * per_layer + 5120 * 25600 + 2 * 5120 == 1_730_213_120
    assert round(n / 1e9, 2) == 1.73
