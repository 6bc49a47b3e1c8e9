"""Target hooks, labels, data, anchors, context noise and the corrected loss, on tiny random
targets of every supported class (Qwen3, Llama, Qwen3.5 hybrid, Qwen3.5 multimodal), built in-process in fp32,
saved and loaded back through dflash.load_target."""

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dflash
from conftest import (build_llama, build_qwen3, build_qwen35, build_qwen35_multimodal, loss_of, tiny_cfg, tiny_tokenizer,
                      write_lines)
from dflash import DFlashError

V, D, L = 128, 64, 4
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
HYBRID = dict(linear_key_head_dim=16, linear_value_head_dim=16)  # conftest's hybrid layout, at this head_dim
# kind -> (HF class expected from AutoModelForCausalLM, path of its decoder stack, the in-memory model)
KINDS = {
    "qwen3": ("Qwen3ForCausalLM", "model", lambda: build_qwen3(**COMMON)),
    "llama": ("LlamaForCausalLM", "model", lambda: build_llama(**COMMON)),
    "qwen3_5": ("Qwen3_5ForCausalLM", "model", lambda: build_qwen35(**COMMON, **HYBRID)),
    # multimodal checkpoint, text-only class
    "qwen3_5_mm_checkpoint": ("Qwen3_5ForCausalLM", "model", lambda: build_qwen35_multimodal(**COMMON, **HYBRID)),
    "qwen3_5_mm_class": ("Qwen3_5ForConditionalGeneration", "model.language_model", None),  # built from the above
}
# tiny_cfg overrides for a drafter over these targets
DRAFTER = dict(hidden_size=D, intermediate_size=96, num_hidden_layers=2, head_dim=16, vocab_size=V, block_size=4,
               mask_token_id=V - 1, target_layer_ids=[0, 2], num_target_layers=L,
               layer_types=["sliding_attention", "full_attention"], sliding_window=8)

# tiny models run many small ops: one intra-op thread (tests marked all_threads keep the default)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """kind -> (Target, the original in-memory HF model); each model is built and loaded once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            if kind == "qwen3_5_mm_class":  # the multimodal class itself: no Auto class loads it as a causal LM
                model = get("qwen3_5_mm_checkpoint")[1].eval().requires_grad_(False)  # as load_target does
                back = dflash.find_decoder(model)
                cache[kind] = (dflash.Target(model, back, model.get_input_embeddings(),
                                             model.get_output_embeddings(), None, kind), model)
            else:
                model = KINDS[kind][2]().eval()
                path = str(tmp_path_factory.mktemp(kind))
                model.save_pretrained(path)
                cache[kind] = (dflash.load_target(path), model)
        return cache[kind]
    return get


def ids_for(seed, b=2, S=12):
    return torch.randint(0, V, (b, S), generator=torch.Generator().manual_seed(seed))


def module_at(model, dotted):
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


# -----------------------------------------------------------------------------
# Loading and hooks on every target class


@pytest.mark.parametrize("kind", list(KINDS))
def test_load_target_class_and_decoder(zoo, kind):
    target, original = zoo(kind)
    cls, dec, _ = KINDS[kind]
    assert type(target.model).__name__ == cls
    assert target.backbone is module_at(target.model, dec)
    assert target.layers is target.backbone.layers and len(target.layers) == L
    assert target.norm is target.backbone.norm
    assert target.embed is target.model.get_input_embeddings() and target.lm_head is target.model.get_output_embeddings()
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (L, D, V)
    assert not target.model.training and not any(p.requires_grad for p in target.model.parameters())
    ids = ids_for(0)
    with torch.no_grad():  # the reloaded weights are the saved ones (for the mm checkpoint: the language part)
        assert torch.equal(target.model(input_ids=ids).logits, original(input_ids=ids).logits)


@pytest.mark.parametrize("kind", list(KINDS))
def test_hooks_equal_hf_hidden_states(zoo, kind):
    target, _ = zoo(kind)
    watched = [*target.layers, target.norm]
    hook_ids = lambda: [set(m._forward_hooks) for m in watched]  # noqa: E731
    before = hook_ids()
    ids = ids_for(1)
    norm_in = {}
    pre = target.norm.register_forward_pre_hook(lambda m, a: norm_in.__setitem__("x", a[0]))
    try:
        with dflash.capture_hidden(target, list(range(L))) as store:
            ours = [now - old for now, old in zip(hook_ids(), before)]
            assert [len(o) for o in ours] == [1] * len(watched), "one hook per watched layer and on the norm"
            with torch.no_grad():
                out = target.model(input_ids=ids, output_hidden_states=True)
    finally:
        pre.remove()
    hs = out.hidden_states
    assert len(hs) == L + 1
    for t in range(L - 1):
        assert torch.equal(store[t], hs[t + 1]), f"h[{t}] != output_hidden_states[{t + 1}]"
    # the last decoder layer: compare with the final norm's *input* (HF's last entry is after the norm)
    assert torch.equal(store[L - 1], norm_in["x"])
    assert not torch.allclose(store[L - 1], hs[L])
    assert torch.equal(store["final"], hs[L]), "f must be the final norm's output"
    with torch.no_grad():
        assert torch.equal(target.lm_head(store["final"]), out.logits)

    # our hooks are gone after the context manager (HF may add its own output recorders: those stay), nothing
    # is captured any more, and the target still generates
    assert all(not (o & now) for o, now in zip(ours, hook_ids())), "capture_hidden left a hook behind"
    snapshot = {k: v for k, v in store.items()}
    gen = target.model.generate(ids[:1, :5], max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert gen.shape == (1, 8) and torch.equal(gen[:, :5], ids[:1, :5])
    assert store.keys() == snapshot.keys() and all(store[k] is snapshot[k] for k in store)


def test_hooks_removed_on_error(zoo):
    target, _ = zoo("qwen3")
    before = [set(m._forward_hooks) for m in [*target.layers, target.norm]]
    with pytest.raises(RuntimeError, match="boom"):
        with dflash.capture_hidden(target, [0, 2]):
            raise RuntimeError("boom")
    assert [set(m._forward_hooks) for m in [*target.layers, target.norm]] == before


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_5_mm_class"])
def test_target_features_no_logits_no_all_hidden_states(zoo, kind):
    target, _ = zoo(kind)
    ids = ids_for(2)
    layer_ids = [0, 2, 3]
    calls, kwargs_seen = [], []
    h1 = target.lm_head.register_forward_hook(lambda *a: calls.append(1))
    h2 = target.backbone.register_forward_pre_hook(lambda m, a, k: kwargs_seen.append(dict(k)), with_kwargs=True)
    try:
        context, final = dflash.target_features(target, ids, layer_ids)
    finally:
        h1.remove()
        h2.remove()
    assert calls == [], "target_features must not run the lm_head (full-vocabulary logits)"
    assert len(kwargs_seen) == 1 and not kwargs_seen[0].get("output_hidden_states")
    assert context.shape == (2, 12, len(layer_ids) * D) and final.shape == (2, 12, D)
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    # layer 3 is the last decoder layer: its output is the final norm's input, not hs[4]
    norm_in = {}
    h = target.norm.register_forward_pre_hook(lambda m, a: norm_in.__setitem__("x", a[0]))
    with torch.no_grad():
        target.model(input_ids=ids)
    h.remove()
    torch.testing.assert_close(context, torch.cat([hs[1], hs[3], norm_in["x"]], -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(final, hs[L], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_greedy_labels(zoo, kind):
    target, _ = zoo(kind)
    ids = ids_for(3, S=13)
    _, final = dflash.target_features(target, ids, [1])
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits
    for chunk in (None, 5, 1):
        y = dflash.greedy_labels(final, target.lm_head, chunk=chunk)
        assert y.shape == ids.shape and y.dtype == torch.long
        assert (y[:, 0] == -1).all(), "position 0 has no label"
        assert torch.equal(y[:, 1:], logits[:, :-1].argmax(-1)), f"chunk={chunk}: y[j] != argmax logits[j-1]"


# -----------------------------------------------------------------------------
# dflash_loss: context noise only on the context, never at eval


def tiny_batch():
    g = torch.Generator().manual_seed(5)
    samples = [(torch.randint(0, V - 1, (16,), generator=g).tolist(), [0] * 4 + [1] * 12),
               (torch.randint(0, V - 1, (11,), generator=g).tolist(), [0] * 3 + [1] * 8)]
    return dflash.collate(samples, pad_id=0, keys=[101, 202])


def run_forward_batch(target, drafter, cfg, batch, anchors, valid, noise_std, train, monkeypatch):
    seen = {}
    real_greedy, real_loss = dflash.greedy_labels, dflash.weighted_ce

    def greedy(final, lm_head, chunk=None):
        seen["final"] = final.clone()
        return real_greedy(final, lm_head, chunk)

    def loss(hidden, lm_head, labels, weights, chunk=None, **kw):
        seen["labels"], seen["weights"] = labels.clone(), weights.clone()
        return real_loss(hidden, lm_head, labels, weights, chunk, **kw)

    monkeypatch.setattr(dflash, "greedy_labels", greedy)
    monkeypatch.setattr(dflash, "weighted_ce", loss)
    h1 = drafter.fc.register_forward_pre_hook(lambda m, a: seen.__setitem__("fc_in", a[0].clone()))
    h2 = drafter.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[1].clone()))
    try:
        out = loss_of(drafter, target, batch, anchors, valid, noise_std=noise_std if train else 0)
    finally:
        h1.remove()
        h2.remove()
        monkeypatch.undo()
    return out, seen


def test_noise_only_on_context(zoo, monkeypatch):
    target, _ = zoo("qwen3")
    cfg = tiny_cfg(DRAFTER)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg)
    batch = tiny_batch()
    anchors, valid = dflash.batch_anchors(batch, 6)
    clean_ctx, clean_final = dflash.target_features(target, batch["input_ids"], cfg.target_layer_ids)
    labels_all = dflash.greedy_labels(clean_final, target.lm_head)
    S = batch["input_ids"].shape[1]
    exp_labels = torch.stack([torch.stack([labels_all[r, (anchors[r, n] + torch.arange(4)).clamp(max=S - 1)]
                                           for n in range(6)]) for r in range(2)])
    blk = torch.full((2, 6, 4), cfg.mask_token_id)
    blk[..., 0] = batch["input_ids"].gather(1, anchors)
    with torch.no_grad():
        exp_x = target.embed(blk)

    (_, noisy_stats), noisy = run_forward_batch(target, drafter, cfg, batch, anchors, valid, 0.1, True, monkeypatch)
    assert not torch.equal(noisy["fc_in"], clean_ctx), "noise_std > 0 in training must change fc's input"
    assert torch.equal(noisy["final"], clean_final), "f (labels) must stay clean"
    assert torch.equal(noisy["labels"], exp_labels)
    assert torch.equal(noisy["x"], exp_x), "block embeddings must stay clean"
    # magnitude: relative to the RMS of each layer's vector h[t][j]
    diff = (noisy["fc_in"] - clean_ctx).unflatten(-1, (2, D))
    ref = clean_ctx.unflatten(-1, (2, D))
    ratio = diff.pow(2).mean(-1).sqrt() / ref.pow(2).mean(-1).sqrt()   # (b, S, m)
    assert 0.08 < ratio.mean().item() < 0.12

    (_, eval_stats), ev = run_forward_batch(target, drafter, cfg, batch, anchors, valid, 0.1, False, monkeypatch)
    assert torch.equal(ev["fc_in"], clean_ctx), "no noise at evaluation"
    (_, zero_stats), zero = run_forward_batch(target, drafter, cfg, batch, anchors, valid, 0.0, True, monkeypatch)
    assert torch.equal(zero["fc_in"], clean_ctx), "noise_std = 0 leaves the context identical"
    assert torch.equal(zero_stats["ce_w"], eval_stats["ce_w"])
    assert torch.equal(noisy["weights"], ev["weights"]) and torch.equal(noisy["labels"], ev["labels"])


def test_noise_is_relative_per_layer_and_keyed():
    g = torch.Generator().manual_seed(0)
    ctx = torch.cat([torch.randn(2, 50, 32, generator=g), 100 * torch.randn(2, 50, 32, generator=g)], -1)
    keep = ctx.clone()
    noisy = dflash.add_context_noise(ctx, 0.05, 2, keys=[1, 2])
    assert torch.equal(ctx, keep), "the input must not be modified in place"
    diff, ref = (noisy - ctx).unflatten(-1, (2, 32)), ctx.unflatten(-1, (2, 32))
    ratio = (diff.pow(2).mean(-1).sqrt() / ref.pow(2).mean(-1).sqrt()).mean((0, 1))  # per layer
    assert ((ratio > 0.04) & (ratio < 0.06)).all(), f"noise/RMS per layer = {ratio.tolist()}, expected ~0.05 each"
    assert torch.equal(dflash.add_context_noise(ctx, 0.05, 2, keys=[1, 2]), noisy), "noise is keyed, reproducible"
    other = dflash.add_context_noise(ctx, 0.05, 2, keys=[1, 3])
    assert torch.equal(other[0], noisy[0]) and not torch.equal(other[1], noisy[1])
    assert dflash.add_context_noise(ctx, 0.0, 2, keys=[1, 2]) is ctx


# -----------------------------------------------------------------------------
# Loss weights, block labels, the tau estimate: a hand-computed example (B=4, gamma=2)


def test_weights_labels_tau_by_hand():
    B, gamma, c = 4, 2.0, 3.0
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 0]])
    labels_all = torch.tensor([[-1, 0, 1, 2, 3, 4, 0, 1, 2, 3]])
    anchors = torch.tensor([[2, 4, 6, 7, 0]])
    valid = torch.tensor([[True, True, True, True, False]])
    e1, e2 = math.exp(-1 / gamma), math.exp(-2 / gamma)

    w = dflash.loss_weights(anchors, valid, loss_mask, B, gamma)
    expected_w = torch.tensor([[[0, 1, e1, e2],     # a=2: positions 3,4,5 all response
                                [0, 1, e1, e2],     # a=4: 5,6,7
                                [0, 1, e1, 0],      # a=6: 7,8 response, 9 is not
                                [0, 1, 0, 0],       # a=7: 8 response, 9 not, 10 outside the sequence
                                [0, 0, 0, 0]]])     # padding anchor
    torch.testing.assert_close(w, expected_w, atol=1e-7, rtol=0)

    labels = dflash.block_labels(labels_all, anchors, B)
    assert labels[0, :4].tolist() == [[1, 2, 3, 4], [3, 4, 0, 1], [0, 1, 2, 3], [1, 2, 3, 3]]

    # predictions at offsets 1..3 (offset 0 unused): hidden = c * onehot(pred), lm_head = identity
    preds = [[0, 2, 3, 0],    # a=2, labels 2,3,4: right, right, wrong   -> accepted 2
             [0, 1, 0, 1],    # a=4, labels 4,0,1: wrong, right, right   -> accepted 0
             [0, 1, 2, 3],    # a=6, labels 1,2,- : right, right, (invalid) -> accepted 2
             [0, 2, 0, 0],    # a=7, labels 2,-,- : right               -> accepted 1
             [0, 0, 0, 0]]    # padding: not a block
    hidden = c * F.one_hot(torch.tensor([preds]), 5).float()
    lm_head = nn.Linear(5, 5, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.eye(5))
    loss_sum, stats = dflash.weighted_ce(hidden, lm_head, labels, w)
    m = dflash.summarize(stats)

    assert stats["blocks"].item() == 4
    assert m["tau"] == pytest.approx(1 + (2 + 0 + 2 + 1) / 4)
    assert m["acc"] == pytest.approx([3 / 4, 3 / 3, 1 / 2])
    right = math.log(math.exp(c) + 4) - c   # CE when argmax == label
    wrong = math.log(math.exp(c) + 4)       # CE when the label's logit is 0
    num = right * (3 + 3 * e1 + e2) + wrong * (1 + e2)
    den = 4 + 3 * e1 + 2 * e2
    assert stats["w"].item() == pytest.approx(den, rel=1e-6)
    assert loss_sum.item() == pytest.approx(num, rel=1e-6)
    assert m["loss"] == pytest.approx(num / den, rel=1e-6)


def test_loss_weights_default_gamma_decay():
    w = dflash.loss_weights(torch.tensor([[0]]), torch.tensor([[True]]), torch.ones(1, 40, dtype=torch.long), 16, 4.0)
    expected = [0.0] + [math.exp(-(i - 1) / 4.0) for i in range(1, 16)]
    torch.testing.assert_close(w[0, 0], torch.tensor(expected), atol=1e-7, rtol=0)
    # a block running past the end of the sequence: offsets beyond S get weight 0 even where loss_mask ends in 1
    w = dflash.loss_weights(torch.tensor([[38]]), torch.tensor([[True]]), torch.ones(1, 40, dtype=torch.long), 16, 4.0)
    torch.testing.assert_close(w[0, 0], torch.tensor([0.0, 1.0] + [0.0] * 14), atol=0, rtol=0)


# -----------------------------------------------------------------------------
# Anchors


def test_sample_anchors():
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 1, 1])
    candidates = {1, 4, 5, 10}  # a with loss_mask[a] = loss_mask[a+1] = 1, by hand
    a, v = dflash.sample_anchors(loss_mask, 6, torch.Generator().manual_seed(0))
    assert a.shape == v.shape == (6,) and a.dtype == torch.long and v.dtype == torch.bool
    assert v.tolist() == [True] * 4 + [False] * 2
    assert set(a[v].tolist()) == candidates
    counts = {c: 0 for c in candidates}
    draws = set()
    for seed in range(300):
        a, v = dflash.sample_anchors(loss_mask, 2, torch.Generator().manual_seed(seed))
        assert v.all() and len(set(a.tolist())) == 2, "without replacement"
        assert set(a.tolist()) <= candidates
        draws.add(tuple(sorted(a.tolist())))
        for x in a.tolist():
            counts[x] += 1
    assert len(draws) == 6, "different generators give different anchors (all 6 pairs appear)"
    assert all(0.38 < n / 300 < 0.62 for n in counts.values()), f"not uniform: {counts}"
    a1, _ = dflash.sample_anchors(loss_mask, 2, torch.Generator().manual_seed(7))
    a2, _ = dflash.sample_anchors(loss_mask, 2, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)
    a, v = dflash.sample_anchors(torch.tensor([1, 0, 1, 0]), 3, torch.Generator().manual_seed(0))
    assert not v.any()


# -----------------------------------------------------------------------------
# The chunked loss: same numbers and gradient as plain cross-entropy, a fraction of the memory


def reference_loss(hidden, lm_head, labels, weights):
    logits = lm_head(hidden.reshape(-1, hidden.shape[-1]))          # the full (T, V) logits
    ce = F.cross_entropy(logits, labels.flatten().clamp(min=0), reduction="none")
    return (ce * weights.flatten()).sum()


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_loss_equals_unchunked(chunk):
    g = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(16, 300, bias=True)
    with torch.no_grad():
        lm_head.weight.normal_(generator=g)
        lm_head.bias.normal_(generator=g)
    lm_head.requires_grad_(False)
    hidden = torch.randn(2, 5, 4, 16, generator=g)
    labels = torch.randint(0, 300, (2, 5, 4), generator=g)
    weights = torch.rand(2, 5, 4, generator=g) * (torch.rand(2, 5, 4, generator=g) > 0.3)
    weights[..., 0] = 0
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    loss, _ = dflash.weighted_ce(h1, lm_head, labels, weights, chunk=chunk)
    loss.backward()
    ref = reference_loss(h2, lm_head, labels, weights)
    ref.backward()
    # within 1e-6 relative to the magnitude (fp32 sums of O(10) terms: absolute 1e-6 would test rounding)
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    assert (h1.grad - h2.grad).abs().max() <= 1e-6 * h2.grad.abs().max()
    assert torch.equal(h1.grad[weights == 0], torch.zeros_like(h1.grad[weights == 0]))


def test_compiled_chunk_rows_equal_eager(monkeypatch):
    """On CUDA build_drafter compiles the chunked CE's per-chunk function (dflash.loss_rows: its pointwise work fused
    around the two matmuls, no fp32 copy of the logits), with dynamic shapes: the last chunk is ragged and the
    weighted token count changes every step. Here through dynamo with aot_eager (the CPU cannot afford inductor in the
    default run): CE traces as one graph (fullgraph: no break that would leave work unfused), gives the eager loss,
    statistics and gradient with and without a gradient, and compiles once per gradient mode, not per chunk size or
    token count."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(16, 300, bias=True).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.normal_(generator=g)
        lm_head.bias.normal_(generator=g)
    hidden = torch.randn(2, 6, 4, 16, generator=g)
    labels = torch.randint(0, 300, (2, 6, 4), generator=g)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(dflash.loss_rows, dynamic=True, backend=counter, fullgraph=True)

    def run(rows, weights, grad):
        monkeypatch.setattr(dflash.ChunkedLMHead, "rows", rows)
        h = hidden.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            loss, stats = dflash.weighted_ce(h, lm_head, labels, weights, chunk=5)
        if grad:
            loss.backward()
        return loss, h.grad, stats

    offsets = torch.arange(48) % 4  # the 48 block tokens' offsets; offset 0 (the anchor) weighs 0
    for n in (23, 17, 14):  # 3 token counts, each with a ragged last chunk (not of 1 row: dynamo specializes 1)
        pick = torch.nonzero(offsets > 0).squeeze(1)[torch.randperm(36, generator=g)[:n]]
        weights = torch.zeros(48).index_put((pick,), torch.rand(n, generator=g) + 0.1).view(2, 6, 4)
        for grad in (True, False):
            loss, dh, stats = run(compiled, weights, grad)
            ref, ref_dh, ref_stats = run(dflash.loss_rows, weights, grad)
            assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
            assert torch.equal(stats["correct"], ref_stats["correct"]) and torch.equal(stats["w"], ref_stats["w"])
            if grad:
                assert (dh - ref_dh).abs().max() <= 1e-6 * ref_dh.abs().max()
    assert counter.frame_count == 2, f"{counter.frame_count} compiles: one per gradient mode expected"


def peak_cpu_bytes(fn):
    """Peak of the bytes allocated by fn (net of what existed before), from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return peak


@pytest.mark.all_threads  # a large-vocabulary memory measurement, not a swarm of tiny ops
def test_chunked_loss_memory_at_qwen_vocab():
    Vq, Dq, chunk = 248320, 64, 16
    g = torch.Generator().manual_seed(0)
    lm_head = nn.Linear(Dq, Vq, bias=False).requires_grad_(False)
    with torch.no_grad():
        lm_head.weight.normal_(std=0.05, generator=g)
    hidden = torch.randn(1, 8, 16, Dq, generator=g)             # 128 block tokens
    labels = torch.randint(0, Vq, (1, 8, 16), generator=g)
    weights = torch.ones(1, 8, 16)
    out = {}

    def chunked():
        h = hidden.clone().requires_grad_(True)
        loss, _ = dflash.weighted_ce(h, lm_head, labels, weights, chunk=chunk)
        loss.backward()
        out["chunked"] = (loss.item(), h.grad)

    def full():
        h = hidden.clone().requires_grad_(True)
        loss = reference_loss(h, lm_head, labels, weights)
        loss.backward()
        out["full"] = (loss.item(), h.grad)

    peak_chunked, peak_full = peak_cpu_bytes(chunked), peak_cpu_bytes(full)
    T = 8 * 16
    assert peak_full >= T * Vq * 4, "the measurement must see the full logits"
    assert peak_chunked < 0.25 * peak_full, f"chunked peak {peak_chunked / 2**20:.0f} MB vs {peak_full / 2**20:.0f} MB"
    # and it is set by the chunk, not by the number of tokens: a few (chunk, V) fp32 buffers at most
    assert peak_chunked <= 4 * chunk * Vq * 4
    assert out["chunked"][0] == pytest.approx(out["full"][0], rel=1e-5)
    torch.testing.assert_close(out["chunked"][1], out["full"][1], atol=1e-6, rtol=1e-4)


# -----------------------------------------------------------------------------
# Data


U, A, E = 2, 3, 4  # <|user|>, <|assistant|>, <|end|>


def test_encode_sample_formats():
    tok = tiny_tokenizer()
    msgs = {"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "good day"},
                         {"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok sure thing"}]}
    ids, mask = dflash.encode_sample(msgs, tok, where="x:1")
    assert ids == [U, 5, 6, E, A, 7, 8, E, U, 9, E, A, 10, 11, 12, E]
    # 1 exactly on the assistant turns' tokens (content and its end-of-turn token), 0 on user turns and headers
    assert mask == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]

    ids, mask = dflash.encode_sample({"prompt": "hi", "response": "good day"}, tok, where="x:2")
    assert ids == [U, 5, E, A, 7, 8, E] and mask == [0, 0, 0, 0, 1, 1, 1]
    plain = tiny_tokenizer(chat_template=False)
    ids, mask = dflash.encode_sample({"prompt": "hi there", "response": "good day"}, plain, where="x:3")
    assert ids == [5, 6, 7, 8] and mask == [0, 0, 1, 1]
    ids, mask = dflash.encode_sample({"text": "hello world a"}, tok, where="x:4")
    assert ids == [13, 14, 15] and mask == [1, 1, 1]
    with pytest.raises(DFlashError, match="x:5: loss_mask holds 2"):  # 0 or 1 only: never a guess
        dflash.encode_sample({"input_ids": [5, 6, 7], "loss_mask": [0, 2, 1]}, None, where="x:5")
    assert dflash.encode_sample({"input_ids": [5, 6, 7], "loss_mask": [0, True, 1.0]}, None) == ([5, 6, 7], [0, 1, 1])
    assert dflash.encode_sample({"input_ids": [5, 6, 7]}, None, where="x:6") == ([5, 6, 7], [1, 1, 1])

    with pytest.raises(DFlashError, match="x:7"):
        dflash.encode_sample({"input_ids": [5, 6], "loss_mask": [1]}, None, where="x:7")
    with pytest.raises(DFlashError, match="x:8"):
        dflash.encode_sample({"input_ids": ["a", "b"]}, None, where="x:8")
    with pytest.raises(DFlashError, match="x:9"):
        dflash.encode_sample({"text": "hi"}, None, where="x:9")
    with pytest.raises(DFlashError, match="x:10"):
        dflash.encode_sample({"messages": msgs["messages"]}, plain, where="x:10")
    with pytest.raises(DFlashError, match="x:11"):
        dflash.encode_sample([1, 2], tok, where="x:11")


def test_load_samples(tmp_path):
    tok = tiny_tokenizer()
    logs = []
    path = write_lines(tmp_path / "d.jsonl", [
        json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}),      # kept
        "",                                                                       # blank lines are fine
        json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 1]}),             # 1 response token: skipped
        json.dumps({"input_ids": [5], "loss_mask": [1]}),                         # 1 token: skipped
        json.dumps({"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1, 0, 1, 0, 1]}),  # no anchor candidate: skipped
        json.dumps({"text": "hello world a b c"}),                                # kept, truncated to max_len
    ])
    samples = dflash.load_samples(path, tok, max_len=4, say=logs.append)
    assert samples == [([1, 2, 3, 4], [0, 1, 1, 1]), ([13, 14, 15, 16], [1, 1, 1, 1])]
    assert len(logs) == 1 and "skipped 3" in logs[0]

    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps({"text": "hi there"}), "", '{"input_ids": [1, 2,'])
    with pytest.raises(DFlashError, match=rf"{bad}:3"):
        dflash.load_samples(bad, tok, 16)
    unknown = write_lines(tmp_path / "unk.jsonl", [json.dumps({"text": "hi there"}), json.dumps({"foo": 1})])
    with pytest.raises(DFlashError, match=rf"{unknown}:2") as e:
        dflash.load_samples(unknown, tok, 16)
    assert "foo" in str(e.value)
    empty = write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(DFlashError, match="empty.jsonl"):
        dflash.load_samples(empty, tok, 16)
    with pytest.raises(DFlashError, match="does not exist"):
        dflash.load_samples(str(tmp_path / "nope.jsonl"), tok, 16)


def sample_ids(batch):
    return [int(x) - 100 for x in batch["input_ids"][:, 0]]


def test_batches_order_and_shards():
    samples = [([100 + i, 1, 2], [1, 1, 1]) for i in range(20)]
    bs, accum, world = 2, 2, 2
    mk = lambda rank, seed=3: dflash.Batches(samples, bs, accum, rank, world, seed, pad_id=0)  # noqa: E731
    ranks = [mk(0), mk(1)]
    assert ranks[0].global_batch == 8 and ranks[0].steps_per_epoch == 2

    def global_batch(bb, step):
        return [sample_ids(b.get(step, m)) for m in range(accum) for b in bb]

    for step in range(4):
        parts = global_batch(ranks, step)
        flat = [i for p in parts for i in p]
        assert all(len(p) == bs for p in parts)
        assert len(set(flat)) == 8, "rank/micro shards are disjoint and cover the global batch"
        assert parts == global_batch([mk(0), mk(1)], step), "same seed and step -> same order"
    epoch0 = [i for s in range(2) for p in global_batch(ranks, s) for i in p]
    epoch1 = [i for s in range(2, 4) for p in global_batch(ranks, s) for i in p]
    assert len(set(epoch0)) == 16, "no sample twice within an epoch"
    assert epoch0 != epoch1, "a new shuffle each epoch"
    assert global_batch(ranks, 0) != global_batch([mk(0, seed=4), mk(1, seed=4)], 0)
    # the global batch does not depend on how it is split over ranks and micro-steps
    single = dflash.Batches(samples, 8, 1, 0, 1, 3, pad_id=0)
    for step in range(4):
        assert sorted(sample_ids(single.get(step, 0))) == sorted(i for p in global_batch(ranks, step) for i in p)
    with pytest.raises(DFlashError):
        dflash.Batches(samples[:5], bs, accum, 0, world, 3, pad_id=0)


# -----------------------------------------------------------------------------
# Training step, target loading errors, compatibility checks


def test_one_step_lowers_the_loss(zoo):
    target, _ = zoo("qwen3")
    cfg = tiny_cfg(DRAFTER)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).train()
    batch = tiny_batch()
    anchors, valid = dflash.batch_anchors(batch, 10)  # more anchors than the short row has: padding anchors too
    assert not valid.all()
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)

    def loss():
        return loss_of(drafter, target, batch, anchors, valid, noise_std=0.0)[0]

    l0 = loss()
    l0.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    assert drafter.fc.weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        l1 = loss()
    assert l1.item() < l0.item() - 1e-3, f"loss {l0.item():.4f} -> {l1.item():.4f}"


def test_load_target_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DFlashError, match="config.json"):
        dflash.load_target(str(tmp_path / "empty"))
    with pytest.raises(DFlashError):
        dflash.load_target(str(tmp_path / "missing"))


def test_load_target_without_tokenizer_files_has_no_tokenizer(zoo):
    """A directory with weights but no tokenizer files: tokenizer None (pre-tokenized data only), not an empty
    stand-in tokenizer that turns every text into no tokens."""
    for kind in ("qwen3", "llama"):
        target, _ = zoo(kind)
        tok = target.tokenizer
        assert tok is None, f"{kind}: got a {type(tok).__name__} with {len(tok)} tokens from a directory without one"


def test_check_compatible(zoo):
    target, _ = zoo("qwen3")
    cfg = tiny_cfg(DRAFTER)
    dflash.check_compatible(cfg, target)  # matches
    with pytest.raises(DFlashError, match="hidden size"):
        dflash.check_compatible(tiny_cfg(DRAFTER, hidden_size=32), target)
    with pytest.raises(DFlashError, match="vocab"):
        dflash.check_compatible(tiny_cfg(DRAFTER, vocab_size=V + 1), target)
    with pytest.raises(DFlashError, match="num_target_layers"):
        dflash.check_compatible(tiny_cfg(DRAFTER, num_target_layers=6, target_layer_ids=[1, 5]), target)
    with pytest.raises(DFlashError, match="out of range"):  # checked once, where the config is made
        tiny_cfg(DRAFTER, target_layer_ids=[0, L])
