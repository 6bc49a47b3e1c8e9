"""DFlash2: the grouped dynamic causal convolution, the candidate selector (scores, greedy path), the selector loss
with its schedule and stop-gradient, each against an independent float64 loop reference written here from the rule;
then the whole drafter (identity at init, flex = dense, training forward = inference, checkpoints)."""

import math

import pytest
import torch

from dflash2_scratch import (ChunkedLMHeadTopK, CandidateSelector, GroupedCausalConv, selector_alpha, selector_ce,
                             unary_logits)


def randomize(module, seed, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


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
