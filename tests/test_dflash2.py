"""DFlash2: the grouped dynamic causal convolution, the candidate selector (scores, greedy path), the selector loss
with its schedule and stop-gradient, each against an independent float64 loop reference written here from the rule;
then the whole drafter (identity at init, flex = dense, training forward = inference, checkpoints)."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import dflash
import eval as ev
from conftest import (ANCHORS, DENSE_DRAFTER, DENSE_TARGET, S, SMALL, TINY_CFG, VALID, ZL, block_ids, cache_kv,
                      one_error, randomize, randomized, ref_attention, ref_rms, reference_greedy, tiny_cfg,
                      tiny_qwen3, torch_threads, train_on_continuations, write_data, write_zlab_dir, zlab_config,
                      zlab_tensors)
from dflash import DFlashDrafter, DFlashError
from dflash_tools import dflash2, sampling
from dflash_tools.dflash2 import (CandidateSelector, ChunkedLMHeadTopK, GroupedCausalConv, selector_alpha, selector_ce,
                                  unary_logits)
from eval import NeuralDrafter

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest on a shared CPU


# -----------------------------------------------------------------------------
# The convolution: out[t, c] = sum_j (base[s, j, c] + delta[t, s, j, c // gs]) * x[t - j, c], x[t - j] = 0 for t < j

def ref_conv(x, u, base, proj, side, K, gs):
    """x, u (B, D) float64 one block; base (2, K, D); proj (2*K*G, D) -> (B, D), by loops."""
    B, D = x.shape
    G = D // gs
    out = torch.zeros(B, D, dtype=torch.float64)
    for t in range(B):
        delta = proj @ u[t]                                    # row side*K*G + j*G + g
        for c in range(D):
            for j in range(K):
                if t - j >= 0:
                    out[t, c] += (base[side, j, c] + delta[side * K * G + j * G + c // gs]) * x[t - j, c]
    return out


@pytest.mark.parametrize("K,gs", [(2, 4), (3, 2), (1, 8)])
def test_conv_matches_loop_reference(K, gs):
    D, B = 8, 5
    conv = randomize(GroupedCausalConv(D, K, gs).double(), 1)
    g = torch.Generator().manual_seed(2)
    x, u = torch.randn(2, 3, B, D, generator=g, dtype=torch.float64), torch.randn(2, 3, B, D, generator=g,
                                                                                   dtype=torch.float64)
    delta = conv.dynamic(u)
    for side in (0, 1):
        out = conv(x, delta, side)
        for r in range(2):
            for n in range(3):
                ref = ref_conv(x[r, n], u[r, n], conv.base_kernel.detach(), conv.kernel_projection.weight.detach(),
                               side, K, gs)
                assert (out[r, n] - ref).abs().max().item() < 1e-12, (side, r, n)


def test_conv_is_causal_within_each_block_and_identity_at_init():
    D, B, K = 8, 6, 3
    conv = randomize(GroupedCausalConv(D, K, 4).double(), 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 4, B, D, generator=g, dtype=torch.float64)
    delta = conv.dynamic(torch.randn(1, 4, B, D, generator=g, dtype=torch.float64))
    base = conv(x, delta, 0)
    x2 = x.clone()
    x2[0, 1, 2] += 1.0  # offset 2 of block 1 changes
    out = conv(x2, delta, 0)
    changed = (out - base).abs().amax(-1)[0] > 0                      # (N, B)
    expect = torch.zeros(4, B, dtype=torch.bool)
    expect[1, 2:2 + K] = True                                          # offsets 2..2+K-1 of block 1, nothing else
    assert torch.equal(changed, expect)
    fresh = GroupedCausalConv(D, K, 4)
    y = torch.randn(2, 3, B, D)
    d = fresh.dynamic(torch.randn(2, 3, B, D))
    assert torch.equal(fresh(y, d, 0), y) and torch.equal(fresh(y, d, 1), y)


# -----------------------------------------------------------------------------
# The selector: S(a, b) = U(b) + sum_r A[a, r] * H(h)[r] * Bc[b, r]; the greedy path feeds each pick forward

def ref_score(sel, h, a, b, u):
    A, Bc, Hw = (p.detach().double() for p in (sel.predecessor_codebook, sel.successor_codebook,
                                               sel.hidden_projection.weight))
    hh = Hw @ h.double()
    return float(u) + sum(float(A[a, r] * hh[r] * Bc[b, r]) for r in range(A.shape[1]))


def test_selector_scores_and_greedy_path_match_loops():
    V, D, r, k, n, Bm1 = 20, 6, 3, 4, 3, 5
    sel = randomize(CandidateSelector(D, V, r).double(), 5, scale=1.0)
    g = torch.Generator().manual_seed(6)
    h = torch.randn(n, Bm1, D, generator=g, dtype=torch.float64)
    cand = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(n * Bm1)]).view(n, Bm1, k)
    unary = torch.randn(n, Bm1, k, generator=g, dtype=torch.float64).sort(-1, descending=True).values
    anchors = torch.randint(0, V, (n,), generator=g)
    path = sel.greedy_path(h, cand, unary, anchors)
    s = sel.scores(h[:, 0], anchors, cand[:, 0], unary[:, 0])
    for m in range(n):
        for j in range(k):
            assert abs(s[m, j].item() - ref_score(sel, h[m, 0], anchors[m], cand[m, 0, j], unary[m, 0, j])) < 1e-10
        prev = int(anchors[m])
        for i in range(Bm1):  # a chain: offset i's predecessor is the pick at offset i-1 (the anchor for offset 1)
            sc = [ref_score(sel, h[m, i], prev, cand[m, i, j], unary[m, i, j]) for j in range(k)]
            prev = int(cand[m, i, max(range(k), key=lambda j: (sc[j], -j))])
            assert int(path[m, i]) == prev, (m, i)
    assert not torch.equal(path, cand[..., 0]), "the transition term should move some pick off the unary argmax"
    fresh = CandidateSelector(D, V, r).double()  # successor codebook 0: the path is the unary argmax
    assert torch.equal(fresh.greedy_path(h, cand, unary, anchors), cand[..., 0])


# -----------------------------------------------------------------------------
# The loss: sum(w * CE(z')) + alpha * sum(w * covered * CE_selector), one denominator sum(w); z' = c tanh(m z / c)

def ref_loss(h, W, labels, pred, w, sel, k, alpha, m, c, stop_gradient):
    """Everything from full (T, V) logits in float64, by loops over tokens."""
    A, Bc, Hw = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    num = 0
    for t in range(h.shape[0]):
        z = W @ h[t] * m
        z = c * torch.tanh(z / c) if c else z
        num = num + w[t] * (torch.logsumexp(z, 0) - z[labels[t]])
        order = sorted(range(len(z)), key=lambda v: -float(z[v].detach()))[:k]        # the strict unary top-k
        if int(labels[t]) not in order:
            continue
        ht, zt = (h[t].detach(), z.detach()) if stop_gradient else (h[t], z)
        proj = Hw @ ht
        s = torch.stack([zt[b] + (A[pred[t]] * proj * Bc[b]).sum() for b in order])
        num = num + alpha * w[t] * (torch.logsumexp(s, 0) - s[order.index(int(labels[t]))])
    return num / w.sum()


def impl_loss(h, W, labels, pred, w, sel, k, alpha, m, c, stop_gradient, chunk=3):
    ce, _, vals, idx = ChunkedLMHeadTopK.apply(h, W, None, labels, chunk, k, m, c)
    sce, covered, _ = selector_ce(sel, h, pred, vals, idx, labels, stop_gradient)
    return ((ce * w).sum() + alpha * (sce * w).sum()) / w.sum(), covered


@pytest.mark.parametrize("m,c", [(1.0, None), (0.7, 3.0)])
@pytest.mark.parametrize("stop_gradient", [False, True])
def test_loss_and_both_gradients_match_reference(m, c, stop_gradient):
    T, D, V, r, k, alpha = 7, 5, 13, 3, 4, 0.6
    g = torch.Generator().manual_seed(7)
    W = torch.randn(V, D, generator=g, dtype=torch.float64)
    h0 = torch.randn(T, D, generator=g, dtype=torch.float64)
    logits = h0 @ W.T
    top = logits.topk(k).indices
    labels = torch.randint(0, V, (T,), generator=g)
    labels[:4] = top[torch.arange(4), torch.arange(4) % k]  # covered; the other labels are random (some misses)
    pred = torch.randint(0, V, (T,), generator=g)
    w = torch.rand(T, generator=g, dtype=torch.float64)
    grads = []
    for fn in (ref_loss, impl_loss):
        sel = randomize(CandidateSelector(D, V, r).double(), 8, scale=1.0)
        h = h0.clone().requires_grad_(True)
        out = fn(h, W, labels, pred, w, sel, k, alpha, m, c, stop_gradient)
        loss = out[0] if isinstance(out, tuple) else out
        if isinstance(out, tuple):
            assert 0 < int(out[1].sum()) < T, "the labels should be covered by the top-k for some tokens only"
        loss.backward()
        grads.append((loss.item(), h.grad.clone(), [p.grad.clone() for p in sel.parameters()]))
    (lr, gr, pr), (li, gi, pi) = grads
    assert abs(lr - li) < 1e-5 * max(1, abs(lr))
    assert (gr - gi).abs().max().item() < 1e-5
    for a, b in zip(pr, pi):
        assert (a - b).abs().max().item() < 1e-5
    assert any(p.abs().sum() > 0 for p in pi), "the selector term must train the selector"
    # stop-gradient: h's gradient is the base term's alone; coupled: it differs from it
    h = h0.clone().requires_grad_(True)
    impl_loss(h, W, labels, pred, w, randomize(CandidateSelector(D, V, r).double(), 8, scale=1.0), k, 0.0, m, c,
              False)[0].backward()
    same = (h.grad - gi).abs().max().item() < 1e-9
    assert same == stop_gradient


def test_selector_alpha_schedule():
    # warmup floor(100 * 0.1) = 10 steps at 0, then a ramp over floor(100 * 0.05) = 5 steps, then alpha
    got = [selector_alpha(s, 100, 2.0, 0.1, 0.05) for s in range(18)]
    assert got[:10] == [0.0] * 10
    assert got[10:16] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0, 2.0])
    assert selector_alpha(0, 100, 2.0) == 2.0 and selector_alpha(3, 100, 2.0, 0.05) == 0.0
    assert selector_alpha(5, 100, 2.0, 0.05) == 2.0  # no ramp: alpha at once


def test_unary_logits():
    z = torch.tensor([-50.0, -1.0, 0.0, 2.0, 40.0])
    assert torch.equal(unary_logits(z), z)
    out = unary_logits(z, 0.5, 10.0)
    assert torch.allclose(out, 10 * torch.tanh(0.5 * z / 10))
    assert out.abs().max() < 10


# -----------------------------------------------------------------------------
# The whole DFlash2 drafter

V2 = dict(conv_kernel_size=2, conv_group_size=4, selector_rank=4, selector_top_k=5)
FLAGS = SimpleNamespace(selector_alpha=None, selector_warmup_ratio=None, selector_ramp_ratio=None,
                        selector_stop_gradient=False)  # --dflash2's flags at their defaults
D, HD, B, W, V = (TINY_CFG[k] for k in ("hidden_size", "head_dim", "block_size", "sliding_window", "vocab_size"))


@pytest.fixture(scope="module")
def v2():
    cfg = tiny_cfg(V2)
    drafter = randomized(cfg, seed=3)
    g = torch.Generator().manual_seed(11)
    ctx = torch.randn(2, S, 2 * D, generator=g)
    tokens = torch.randint(0, V - 1, (2, S), generator=g)
    embed, lm_head = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
    with torch.no_grad():
        embed.weight.normal_(generator=g)
        lm_head.weight.normal_(generator=g)
        x = embed(block_ids(tokens, ANCHORS))
        hidden = drafter(ctx, x, ANCHORS, VALID)
    return dict(cfg=cfg, drafter=drafter, ctx=ctx, tokens=tokens, x=x, hidden=hidden,
                target=SimpleNamespace(embed=embed, lm_head=lm_head))


def reference_block2(drafter, ctx_feats, a, x):
    """One DFlash2 block in float64 from the weights alone: the DFlash layer (context j < a, own block, window and
    causality by layer type) with ref_conv on both sides of each sublayer after its pre-norm."""
    cfg = drafter.cfg
    P = {k: v.double() for k, v in drafter.state_dict().items()}
    K, gs = cfg.conv_kernel_size, cfg.conv_group_size
    ctx = ref_rms(ctx_feats.double()[:a] @ P["fc.weight"].T, P["hidden_norm.weight"])
    h = x.double()
    for li in range(cfg.num_hidden_layers):
        p = f"layers.{li}."
        conv = lambda name, y, u, side: ref_conv(y, u, P[p + name + ".base_kernel"],  # noqa: E731
                                                 P[p + name + ".kernel_projection.weight"], side, K, gs)
        sliding = cfg.layer_types[li] == "sliding_attention"
        u = ref_rms(h, P[p + "input_layernorm.weight"])
        hn = conv("attention_conv", u, u, 0)
        h = h + conv("attention_conv", ref_attention(hn, ctx, P, p, a, cfg, sliding), u, 1)
        u = ref_rms(h, P[p + "post_attention_layernorm.weight"])
        hn = conv("mlp_conv", u, u, 0)
        y = (F.silu(hn @ P[p + "mlp.gate_proj.weight"].T) * (hn @ P[p + "mlp.up_proj.weight"].T)) \
            @ P[p + "mlp.down_proj.weight"].T
        h = h + conv("mlp_conv", y, u, 1)
    return ref_rms(h, P["norm.weight"])


def test_dflash2_forward_matches_independent_reference(v2, one_thread):
    for r, n in [(0, 0), (0, 4), (0, 8), (1, 1), (1, 5)]:
        a = int(ANCHORS[r, n])
        ref = reference_block2(v2["drafter"], v2["ctx"][r], a, v2["x"][r, n])
        diff = (v2["hidden"][r, n].double() - ref).abs().max().item()
        assert diff < 1e-4, f"row {r} anchor {a}: DFlash2 forward differs from the reference by {diff}"


def selector_path(drafter, target, hidden, anchor_ids):
    """The greedy path from hidden states (n, B, D) by dflash2_drafts."""
    logits = target.lm_head(hidden[:, 1:])
    return drafter.draft(logits, hidden[:, 1:], anchor_ids)[0]


def test_dflash2_training_forward_equals_inference(v2, one_thread):
    drafter, hidden = v2["drafter"], v2["hidden"]
    for r, n in [(0, 1), (0, 5), (0, 8), (1, 0), (1, 4)]:
        a = int(ANCHORS[r, n])
        cache = NeuralDrafter(drafter)
        cache.start(v2["target"], [0] * a, v2["ctx"][r:r + 1, :a])
        with torch.no_grad():
            h = drafter.blocks(v2["x"][r:r + 1, n:n + 1], ANCHORS[r:r + 1, n:n + 1],
                               torch.ones(1, 1, dtype=torch.bool), cache_kv(cache, v2["cfg"]), a)
        assert (h[0, 0] - hidden[r, n]).abs().max().item() < 1e-5
        anchor = int(v2["tokens"][r, a])
        with torch.no_grad():
            want = selector_path(drafter, v2["target"], hidden[r, n:n + 1], torch.tensor([anchor]))[0]
        assert cache.draft(anchor, B - 1) == want.tolist(), f"row {r} anchor {a}: inference drafts differ"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_dflash2_flex_equals_dense(v2, monkeypatch):
    from torch.nn.attention.flex_attention import flex_attention
    monkeypatch.setattr(dflash, "compiled_flex_attention", flex_attention)
    drafter = v2["drafter"]
    drafter.attention = "flex"
    try:
        with torch.no_grad():
            flex = drafter(v2["ctx"], v2["x"], ANCHORS, VALID)
    finally:
        drafter.attention = "dense"
    assert (flex - v2["hidden"]).abs().max().item() < 1e-5


def every_anchor(drafter, target, ctx, tokens):
    return dflash.draft_every_anchor(drafter, target, ctx, tokens, 3)[0]


def test_fresh_dflash2_is_the_dflash_drafter_and_init_from_keeps_it(v2, one_thread):
    """A fresh DFlash2 drafter (same seed) has DFlash's backbone, identity convolutions and a zero successor
    codebook: the same hidden states and the same drafted blocks; a DFlash drafter turned into DFlash2
    (dflash2_from, what --init_from with --dflash2 does) likewise."""
    cfg1, cfg2 = tiny_cfg(), v2["cfg"]
    torch.manual_seed(5)
    d1 = DFlashDrafter(cfg1).eval()
    torch.manual_seed(5)
    d2 = cfg2.Drafter(cfg2).eval()
    s1, s2 = d1.state_dict(), d2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1), "the same seed must give DFlash's backbone"
    assert set(s2) - set(s1) == {k for k in s2 if k.startswith("candidate_selector.") or "_conv." in k} != set()
    trained = randomized(cfg1, seed=9)
    for a, b in ((d1, d2), (trained, dflash2.prepare(trained, cfg2, FLAGS).eval())):
        with torch.no_grad():
            h1 = a(v2["ctx"], v2["x"], ANCHORS, VALID)
            h2 = b(v2["ctx"], v2["x"], ANCHORS, VALID)
            assert torch.equal(h1, h2)
            tgt, ctx, tok = v2["target"], v2["ctx"][:1], v2["tokens"][:1]
            assert torch.equal(every_anchor(a, tgt, ctx, tok), every_anchor(b, tgt, ctx, tok))
    assert not b.candidate_selector.successor_codebook.any()


# -----------------------------------------------------------------------------
# Checkpoints in z-lab's DFlash2 layout

def test_dflash2_checkpoint_layout_and_round_trip(v2, tmp_path):
    cfg = tiny_cfg(V2, output_multiplier=0.5, final_logit_softcapping=30.0)
    d = randomized(cfg, seed=4)
    p = dflash.save_drafter(d, str(tmp_path / "v2"), dtype=torch.float32)
    with open(os.path.join(p, "config.json")) as f:
        c = json.load(f)
    assert c["architectures"] == ["DFlash2DraftModel"]
    dc = c["dflash_config"]
    assert {k: dc[k] for k in V2} == V2 and (dc["output_multiplier"], dc["final_logit_softcapping"]) == (0.5, 30.0)
    assert "input_embedding_scale" not in dc and not any(k in c for k in (*V2, "output_multiplier"))
    with safe_open(os.path.join(p, "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    K, G, r = V2["conv_kernel_size"], D // V2["conv_group_size"], V2["selector_rank"]
    assert shapes["candidate_selector.predecessor_codebook"] == shapes["candidate_selector.successor_codebook"] == \
        (V, r)
    assert shapes["candidate_selector.hidden_projection.weight"] == (r, D)
    assert shapes["layers.2.mlp_conv.base_kernel"] == (2, K, D)
    assert shapes["layers.0.attention_conv.kernel_projection.weight"] == (2 * K * G, D)
    assert set(shapes) == set(dflash.expected_shapes(cfg))
    loaded = dflash.load_drafter(p)
    assert loaded.cfg == cfg
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in d.state_dict().items())
    # a plain DFlash config.json is as before: none of DFlash2's keys
    p1 = dflash.save_drafter(randomized(tiny_cfg()), str(tmp_path / "v1"))
    with open(os.path.join(p1, "config.json")) as f:
        c1 = json.load(f)
    assert c1["architectures"] == ["DFlashDraftModel"]
    assert not any(k in c1 or k in c1["dflash_config"] for k in (*V2, *dflash2.UNARY))


ZL2 = dict(conv_group_size=8, conv_kernel_size=2, selector_rank=6, selector_top_k=4)


def zlab_dflash2(tmp_path, name="z2", over=None, dc_over=None, drop=()):
    """A DFlash2 directory as z-lab releases it: their config.json keys and tensor names, written by hand."""
    c = zlab_config(**{"architectures": ["DFlash2DraftModel"], "is_causal": False, "sliding_window": 2 * ZL["Bs"],
                       "layer_types": ["sliding_attention"] * ZL["layers"], **(over or {})})
    c["dflash_config"] = {**c["dflash_config"], "block_size": ZL["Bs"], **ZL2, "output_multiplier": 0.25,
                          "final_logit_softcapping": 20.0, **(dc_over or {})}
    g = torch.Generator().manual_seed(1)
    t = zlab_tensors()
    Dz, Vz, K, r = ZL["D"], ZL["V"], ZL2["conv_kernel_size"], ZL2["selector_rank"]
    t["candidate_selector.hidden_projection.weight"] = torch.randn(r, Dz, generator=g).to(torch.bfloat16)
    t["candidate_selector.predecessor_codebook"] = torch.randn(Vz, r, generator=g).to(torch.bfloat16)
    t["candidate_selector.successor_codebook"] = torch.randn(Vz, r, generator=g).to(torch.bfloat16)
    for i in range(ZL["layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            t[f"layers.{i}.{conv}.base_kernel"] = torch.randn(2, K, Dz, generator=g).to(torch.bfloat16)
            t[f"layers.{i}.{conv}.kernel_projection.weight"] = \
                (0.1 * torch.randn(2 * K * Dz // ZL2["conv_group_size"], Dz, generator=g)).to(torch.bfloat16)
    for k in drop:
        t.pop(k)
    return write_zlab_dir(str(tmp_path / name), c, t), t


def test_zlab_dflash2_directory_loads_and_drafts(tmp_path):
    path, t = zlab_dflash2(tmp_path)
    d = dflash.load_drafter(path)
    cfg = d.cfg
    assert cfg.architecture == "DFlash2DraftModel" and {k: getattr(cfg, k) for k in ZL2} == ZL2
    assert (cfg.output_multiplier, cfg.final_logit_softcapping, cfg.input_embedding_scale) == (0.25, 20.0, 1.0)
    assert cfg.layer_kind(0) == (False, 2 * ZL["Bs"])  # is_causal false: bidirectional sliding layers
    sd = d.state_dict()
    assert all(torch.equal(sd[k], v.float()) for k, v in t.items())
    g = torch.Generator().manual_seed(3)
    target = SimpleNamespace(embed=nn.Embedding(ZL["D"] and ZL["V"], ZL["D"]), lm_head=nn.Linear(ZL["D"], ZL["V"],
                                                                                                  bias=False))
    cache = NeuralDrafter(d)
    cache.start(target, [0] * 9, torch.randn(1, 9, 2 * ZL["D"], generator=g))
    toks = cache.draft(7, ZL["Bs"] - 1)
    assert len(toks) == ZL["Bs"] - 1 and all(0 <= x < ZL["V"] for x in toks)


@pytest.mark.parametrize("change,needle", [
    (dict(dc_over={"conv_group_size": None}), "only conv_kernel_size, selector_rank, selector_top_k set"),
    (dict(dc_over={"selector_rank": 0, "selector_top_k": 0}), "set all four or none"),
    (dict(dc_over={"conv_kernel_size": 9}), "conv_kernel_size 9 is larger than block_size 8"),
    (dict(dc_over={"conv_group_size": 5}), "conv_group_size 5 does not divide hidden_size 32"),
    (dict(dc_over={"final_logit_softcapping": 0}), "final_logit_softcapping must be null (off) or > 0, got 0"),
    (dict(dc_over={"output_multiplier": -1}), "output_multiplier must be a positive finite number"),
    (dict(over={"architectures": ["DFlashDraftModel"]}), "set architectures to [\"DFlash2DraftModel\"]"),
    (dict(dc_over={"selector_top_k": 500}), "selector_top_k 500 is larger than the vocabulary 120"),
])
def test_what_the_engines_refuse_is_one_line(tmp_path, change, needle):
    path, _ = zlab_dflash2(tmp_path, **change)
    with pytest.raises(DFlashError) as e:
        dflash.load_drafter(path)
    lines = str(e.value).splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_dflash2_keys_only_at_top_level_or_without_the_class(tmp_path):
    c = zlab_config(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4,
                    architectures=["DFlash2DraftModel"])
    path = write_zlab_dir(str(tmp_path / "top"), c, zlab_tensors())
    with pytest.raises(DFlashError, match="at the top level, not in dflash_config"):
        dflash.load_drafter(path)
    released = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)  # its defaults too
    path = write_zlab_dir(str(tmp_path / "top_released"), zlab_config(**released, architectures=["DFlash2DraftModel"]),
                          zlab_tensors())
    with pytest.raises(DFlashError, match="at the top level, not in dflash_config"):
        dflash.load_drafter(path)
    path = write_zlab_dir(str(tmp_path / "arch"), zlab_config(architectures=["DFlash2DraftModel"]), zlab_tensors())
    with pytest.raises(DFlashError, match="names DFlash2DraftModel but dflash_config lacks"):
        dflash.load_drafter(path)
    path, _ = zlab_dflash2(tmp_path, "half", drop=("candidate_selector.successor_codebook",))
    with pytest.raises(DFlashError, match="missing tensor candidate_selector.successor_codebook"):
        dflash.load_drafter(path)


# -----------------------------------------------------------------------------
# tau with the selector: the walk (exact) = a real decoding loop drafting with the selector = plain greedy;
# sampling at T > 0 with the selector's q; no trees


@pytest.fixture(scope="module")
def dense2(tmp_path_factory):
    """A tiny dense target (the eval tests'), its greedy continuations of 4 random prompts, and a DFlash2 drafter
    trained on them for a few steps with the DFlash2 loss."""
    target = dflash.load_target(tiny_qwen3(str(tmp_path_factory.mktemp("dense2") / "target"), **DENSE_TARGET))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, DENSE_DRAFTER["mask_token_id"], (8,), generator=g).tolist() for _ in range(4)]
    continuations = [reference_greedy(target, p, 24) for p in prompts]
    torch.manual_seed(0)
    with torch_threads(1):
        d2 = train_on_continuations(target, dflash2.Drafter(tiny_cfg(DENSE_DRAFTER, V2)), prompts, continuations,
                                    steps=24)
    randomize(d2.candidate_selector, 12)  # transitions of O(1): the path leaves the unary argmax (24 steps do not)
    return {"target": target, "prompts": prompts, "continuations": continuations, "drafter2": d2}


def test_dflash2_exact_walk_equals_selector_loop_equals_greedy(dense2):
    target, prompts, ref = dense2["target"], dense2["prompts"], dense2["continuations"]
    drafters = {"v2": dense2["drafter2"]}
    exact = ev.evaluate_drafters(target, drafters, prompts, 24, continuations=ref, progress=False)
    loop = ev.evaluate_drafters(target, drafters, prompts, 24, mode="loop", continuations=ref, progress=False)
    re_, rl = exact["results"][0], loop["results"][0]
    assert rl["matches_greedy"] and [e["continuation"] for e in rl["prompts"]] == ref
    assert [e["acceptance_lengths"] for e in re_["prompts"]] == [e["acceptance_lengths"] for e in rl["prompts"]]
    assert re_["tau"] > 1.5, re_["tau"]
    assert 0 < re_["topk_recall"] <= 1
    # the selector's path is not the unary argmax's (measured: tau 3.06, the unary argmax's 4.13): the walk and the
    # loop both draft the selector's path
    assert re_["unary_tau"] > 1 and abs(re_["unary_tau"] - re_["tau"]) > 0.2, (re_["tau"], re_["unary_tau"])


def test_dflash2_tiny_temperature_is_greedy(dense2):
    """At T -> 0 the target's p' and the selector's q are one-hot: the sampled walk is the greedy walk."""
    target, prompts = dense2["target"], dense2["prompts"][:2]
    drafters = {"v2": dense2["drafter2"]}
    greedy = ev.evaluate_drafters(target, drafters, prompts, 12, progress=False)
    sampled = ev.evaluate_drafters(target, drafters, prompts, 12, progress=False,
                                   sampling=ev.Sampling(1e-4, samples=2))
    g = [e["acceptance_lengths"] for e in greedy["results"][0]["prompts"]]
    s = [e["acceptance_lengths"] for e in sampled["results"][0]["prompts"]]
    assert s == [x for x in g for _ in range(2)]


def test_selector_gradient_is_deterministic():
    """Many tokens sharing predecessors and candidates (their codebook rows are summed in backward) on 2 threads: the
    same gradient every time, bit for bit (a resumed or re-run DFlash2 training is then exactly the same run)."""
    g = torch.Generator().manual_seed(0)
    sel = CandidateSelector(32, 512, 16)
    h, pred = torch.randn(2048, 32, generator=g), torch.randint(0, 20, (2048,), generator=g)
    idx, vals = torch.randint(0, 40, (2048, 8), generator=g), torch.randn(2048, 8, generator=g)
    grads = []
    with torch_threads(2):
        for _ in range(4):
            sel.zero_grad()
            selector_ce(sel, h, pred, vals, idx, idx[:, 0].clone())[0].sum().backward()
            grads.append([p.grad.clone() for p in sel.parameters()])
    assert all(torch.equal(a, b) for gr in grads[1:] for a, b in zip(grads[0], gr))


def test_selector_sampled_lengths_rule():
    """Accepted with probability min(1, q(x)/p'(x)): q >= p' always accepts, q = 0 never, and in between the
    acceptance rate is min(1, q/p') (the coupling of rejection sampling)."""
    cont = list(range(9))
    p = torch.full((9,), 0.5)
    assert sampling.sampled_lengths(cont, p, torch.ones(8, 3), torch.Generator().manual_seed(0)) == [4, 4]
    assert sampling.sampled_lengths(cont, p, torch.zeros(8, 3), torch.Generator().manual_seed(0)) == [1] * 8
    accepted, steps = 0, 0
    for seed in range(300):
        lengths = sampling.sampled_lengths(cont, p, torch.full((8, 1), 0.2), torch.Generator().manual_seed(seed))
        accepted, steps = accepted + sum(x - 1 for x in lengths), steps + len(lengths)
    assert abs(accepted / steps - 0.4) < 0.04, accepted / steps  # one draft per block: P(accept) = 0.2 / 0.5


def test_tree_budget_is_refused_for_dflash2(dense2):
    with pytest.raises(DFlashError, match=r"drafter v2 \(DFlash2DraftModel\) drafts one chain"):
        ev.evaluate_drafters(dense2["target"], {"v2": dense2["drafter2"]}, dense2["prompts"][:1], 8,
                             tree_budgets=(4,), progress=False)


# -----------------------------------------------------------------------------
# Training: --dflash2 through the command line, checkpoints, exact resume, --init_from a DFlash checkpoint

def run_cli(args):
    with torch_threads(1):
        dflash.main(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("v2train")
    return {"dir": d, "q3": tiny_qwen3(d / "q3"), "data": write_data(d / "data.jsonl", 48)}


TRAIN = ["--max_steps", "4", "--batch_size", "4", "--grad_accum", "1", "--eval_walk_prompts", "4",
         "--eval_walk_tokens", "12"]
V2_FLAGS = ["--dflash2", "--conv_group_size", "4", "--selector_rank", "8", "--selector_top_k", "6"]


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return list(map(json.loads, f))


def test_cli_trains_dflash2_and_resumes_exactly(runs, tmp_path):
    out = tmp_path / "a"
    run_cli(["--target", runs["q3"], "--data", runs["data"], *SMALL[:-6], *TRAIN, *V2_FLAGS, "--save_every", "2",
             "--eval_every", "2", "--eval_fraction", "0.25", "--selector_warmup_ratio", "0.25", "--out", str(out)])
    with open(out / "step_4" / "config.json") as f:
        c = json.load(f)
    assert c["architectures"] == ["DFlash2DraftModel"]
    assert {k: c["dflash_config"][k] for k in V2} == dict(V2, selector_rank=8, selector_top_k=6)
    recs = records(out)
    steps = [r for r in recs if "loss" in r]
    evals = [r for r in recs if "eval_loss" in r]
    assert [r["selector_alpha"] for r in steps] == [0.0, 1.0, 1.0, 1.0]  # warmup floor(4 * 0.25) = 1 step
    for r in evals:
        assert r["eval_walk_tau"] >= 1 and r["eval_walk_unary_tau"] >= 1 and 0 <= r["eval_topk_recall"] <= 1
    # resume from step_2 in a fresh directory: the same step_4, bit for bit
    resumed = tmp_path / "b"
    os.makedirs(resumed)
    shutil.copytree(out / "step_2", resumed / "step_2")
    (resumed / "latest").write_text("step_2\n")
    run_cli(["--target", runs["q3"], "--data", runs["data"], *SMALL[:-6], *TRAIN, *V2_FLAGS, "--save_every", "2",
             "--eval_every", "2", "--eval_fraction", "0.25", "--selector_warmup_ratio", "0.25", "--out",
             str(resumed), "--resume"])
    a, b = dflash.read_safetensors(str(out / "step_4")), dflash.read_safetensors(str(resumed / "step_4"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_from_dflash_checkpoint_is_that_drafter_at_step_0(runs, tmp_path):
    v1 = tmp_path / "v1"
    common = ["--target", runs["q3"], "--data", runs["data"], *SMALL[:-6], *TRAIN, "--eval_fraction", "0.25",
              "--eval_every", "0", "--save_every", "0"]
    run_cli([*common, "--out", str(v1)])
    last = [r for r in records(v1) if "eval_loss" in r][-1]
    v2 = tmp_path / "v2"
    run_cli([*common, *V2_FLAGS, "--init_from", str(v1 / "step_4"), "--max_steps", "1", "--out", str(v2)])
    first = [r for r in records(v2) if "eval_loss" in r][0]
    assert first["step"] == 0
    for k in ("eval_loss", "eval_tau", "eval_walk_tau"):
        assert first[k] == pytest.approx(last[k], abs=1e-6), (k, first, last)
    assert first["eval_walk_unary_tau"] == pytest.approx(first["eval_walk_tau"], abs=1e-9)


def test_dflash2_flag_problems_are_one_line(runs, tmp_path, capsys):
    base = ["--target", runs["q3"], "--data", runs["data"], *SMALL, "--out", str(tmp_path / "x")]
    one_error(capsys, dflash.main, [*base, *V2_FLAGS, "--eval_walk_tree_budget", "4"], "--eval_walk_tree_budget",
              "DFlash2")
    one_error(capsys, dflash.main, [*base, "--dflash2", "--conv_group_size", "5"], "conv_group_size 5 does not "
              "divide hidden_size 32")
    one_error(capsys, dflash.main, [*base, "--dflash2", "--conv_kernel_size", "5"], "larger than block_size 4")
    one_error(capsys, dflash.main, [*base, "--selector_top_k", "4"], "--selector_top_k", "--variant dflash2")
    one_error(capsys, dflash.main, [*base, *V2_FLAGS, "--loss", "dpace"], "--loss dpace", "DFlash2")


def test_demo_runs_dflash2_at_reduced_size(tmp_path, small_demo, capsys):
    """`python dflash.py --demo --dflash2` end to end at a size of seconds: the tiny target, its data, a DFlash2
    drafter trained by the loop, tau by eval.py (the selector's path, the unary argmax's beside it)."""
    out = tmp_path / "demo"
    small_demo(out, "--dflash2")
    assert "a DFlash2 drafter" in capsys.readouterr().out
    report = json.load(open(out / "demo_eval.json"))
    trained = next(r for r in report["results"] if r["drafter"] == "trained")
    assert trained["tau"] >= 1 and trained["unary_tau"] >= 1 and 0 <= trained["topk_recall"] <= 1
    with open(out / "step_3" / "config.json") as f:
        assert json.load(f)["architectures"] == ["DFlash2DraftModel"]
