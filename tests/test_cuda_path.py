"""The default CUDA configuration (compiled drafter, flex_attention, bf16 autocast), checked on the CPU with torch's
own counters and flags: held-out evaluation compiles the flex kernel once per run (not once per length or batch
size), the compiled flex stays the module's one compiled kernel, the frozen target runs at the batch's natural
length under --compile on, q/k/v reach flex in one dtype under autocast, block masks are compiled the
non-deprecated way, and eval.py sizes its anchor chunks for the attention path in use."""
import inspect
import os
import random
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dflash
from conftest import SMALL, VOCAB, tiny_cfg, tiny_qwen3, write_data

EAGER_FLEX = "flex_attention called without torch.compile"  # what flex warns when it runs unfused
LENGTHS = [20, 27, 33, 41, 50, 23, 37]  # 7 eval samples, batch 2: distinct lengths and a ragged last batch


@pytest.fixture(scope="module")
def setup(one_thread_module, tmp_path_factory):
    target = dflash.load_target(tiny_qwen3(tmp_path_factory.mktemp("cuda") / "q3"))
    cfg = tiny_cfg(vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=[1, 3], num_target_layers=4)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg, "flex").eval()
    rng = random.Random(0)
    samples = [([rng.randrange(1, VOCAB - 1) for _ in range(n)], [0] * 6 + [1] * (n - 6)) for n in LENGTHS]
    return {"target": target, "cfg": cfg, "drafter": drafter, "samples": samples}


def evaluate(setup, samples):
    return dflash.evaluate(setup["drafter"], setup["target"], samples, 2, 4, 0, 0, 0, 1, gamma=4.0, labels="target",
                           pad_to=dflash.padded_length(max(LENGTHS)))


def flex_graphs():
    return counters["stats"]["unique_graphs"]


def test_evaluation_compiles_flex_once(setup):
    """One full batch compiles what one shape needs (one graph per mask kind); then an evaluation over several
    lengths and a ragged last batch must not compile again (a recompile is an error here), nor fall back to unfused
    flex (a warning turned into an error)."""
    torch._dynamo.reset()  # other test files in this process compiled flex at other shapes
    counters.clear()
    evaluate(setup, setup["samples"][:2])
    one_shape = flex_graphs()
    assert one_shape == len({setup["cfg"].layer_kind(i) for i in range(setup["cfg"].num_hidden_layers)})
    with torch._dynamo.config.patch(error_on_recompile=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_FLEX)
        m = evaluate(setup, setup["samples"])
    assert flex_graphs() == one_shape
    assert m["tau"] >= 1.0 and m["loss"] > 0


def test_compiled_flex_survives_a_compiled_model_and_is_what_evaluation_runs(setup, monkeypatch):
    """The compiled model traces flex inside its own graph; afterwards the module still holds the one compiled flex
    (made when the flex drafter was built, not a raw flex_attention assigned later), and held-out evaluation calls
    it, once per layer of its one batch (a watcher around it counts; with the evaluation skipped it counts none)."""
    compiled_before = dflash.compiled_flex_attention
    d, cfg = setup["drafter"], setup["cfg"]
    ctx = torch.randn(2, 128, len(cfg.target_layer_ids) * cfg.hidden_size)
    x = torch.randn(2, 4, cfg.block_size, cfg.hidden_size)
    anchors, valid = torch.tensor([[3, 7, 12, 20]] * 2), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():  # flex has no backward on the CPU; inductor's CPU flex cannot lower inside a larger graph
        torch.compile(d, backend="aot_eager")(ctx, x, anchors, valid)
    assert dflash.compiled_flex_attention is compiled_before
    assert dflash.compiled_flex_attention is not flex_attention
    assert getattr(dflash.compiled_flex_attention, "_torchdynamo_orig_callable", None) is flex_attention
    calls = []

    def watched(*a, **k):  # the module's one compiled flex, every call of it during evaluation counted
        calls.append(a[0].shape)
        return compiled_before(*a, **k)

    monkeypatch.setattr(dflash, "compiled_flex_attention", watched)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_FLEX)
        evaluate(setup, setup["samples"][:2])
    assert len(calls) == cfg.num_hidden_layers, "held-out evaluation did not run the compiled flex (once per layer)"


def test_flex_gets_one_dtype_under_autocast(setup, monkeypatch):
    """Under bf16 autocast the fp32 norm weights promote q and k while v stays bf16: flex must get one dtype."""
    seen = []

    def recording_flex(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex_attention(q, k, v, **kw)

    monkeypatch.setattr(dflash, "compiled_flex_attention", recording_flex)
    d, cfg = setup["drafter"], setup["cfg"]
    ctx = torch.randn(1, 128, len(cfg.target_layer_ids) * cfg.hidden_size)
    x = torch.randn(1, 2, cfg.block_size, cfg.hidden_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_FLEX)
        d(ctx, x, torch.tensor([[3, 9]]), torch.ones(1, 2, dtype=torch.bool))
    assert len(seen) == cfg.num_hidden_layers
    assert all(dt == (torch.bfloat16,) * 3 for dt in seen), seen


def test_block_masks_compiled_without_the_deprecated_flag(setup):
    assert "_compile=True" not in inspect.getsource(dflash)
    assert getattr(dflash.compiled_create_block_mask, "_torchdynamo_orig_callable", None) is create_block_mask
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        masks = dflash.build_masks(setup["cfg"], torch.tensor([[3, 9]]), torch.ones(1, 2, dtype=torch.bool), 128,
                                   "flex")
    assert all(isinstance(m, dflash.BlockMask) for m in masks.values())
    assert not [w for w in caught if "_compile" in str(w.message)]


def test_eval_chunks_sized_for_the_attention_path(setup, monkeypatch):
    cfg = setup["cfg"]
    flex, dense = dflash.anchors_per_chunk(cfg, 4096, "flex"), dflash.anchors_per_chunk(cfg, 4096, "dense")
    assert flex > dense and flex == dflash.anchors_per_chunk(cfg, 128, "flex")  # flex shares the context keys/values
    asked = []
    monkeypatch.setattr(dflash, "anchors_per_chunk", lambda cfg, S, attention, budget: asked.append(attention) or 8)
    monkeypatch.setattr(dflash, "compiled_flex_attention", flex_attention)
    ids = torch.tensor([setup["samples"][0][0]])
    feats = torch.randn(1, ids.shape[1], len(cfg.target_layer_ids) * cfg.hidden_size)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=EAGER_FLEX)
        out = dflash.draft_every_anchor(setup["drafter"], setup["target"], feats, ids, 5)[0]
    assert asked == ["flex"] and out.shape == (ids.shape[1] - 6, cfg.block_size - 1)


def test_target_runs_unpadded_under_compile_on(tmp_path, monkeypatch, one_thread):
    """A real `dflash.py --compile on` run (dynamo's eager backend: the CPU cannot afford inductor here): the frozen
    target sees the batch's natural length in training and evaluation; only the drafter's context is padded."""
    lengths, pads = [], []
    load_target, dflash_loss, compile_ = dflash.load_target, dflash.dflash_loss, torch.compile

    def hooked_target(*a, **k):
        t = load_target(*a, **k)
        t.backbone.register_forward_pre_hook(lambda m, args, kw: lengths.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)
        return t

    monkeypatch.setattr(dflash, "load_target", hooked_target)
    monkeypatch.setattr(dflash, "dflash_loss", lambda *a, **k: pads.append(k.get("pad_to")) or dflash_loss(*a, **k))
    monkeypatch.setattr(torch, "compile", lambda m, **k: compile_(m, backend="eager"))
    args = list(SMALL)
    args[args.index("--eval_fraction") + 1] = "0.25"
    dflash.main(args + ["--target", tiny_qwen3(tmp_path / "q3"), "--data", write_data(tmp_path / "d.jsonl", 16),
                        "--out", str(tmp_path / "out"), "--compile", "on", "--eval_walk_prompts", "0", "--max_steps", "1", "--batch_size", "4",
                        "--max_len", "64", "--grad_accum", "1"])
    assert lengths and set(lengths) == {24}  # write_data: 6 prompt + 18 response tokens
    assert pads and set(pads) == {dflash.padded_length(64)}


def test_compile_flex_leaves_room_for_every_walk_length():
    """The default run's stand-in for the six-length walk below (12 flex compiles, minutes on a CPU: it runs with
    DFLASH_SLOW_TESTS=1): compile_flex raises dynamo's recompile limit past what walks compile, 2 layer kinds x a
    power-of-two bucket from 128 to 262,144 positions (dynamo's default, 8, is too few)."""
    dflash.compile_flex()
    buckets = {dflash.padded_length(2 ** k) for k in range(1, 19)}
    assert len(buckets) == 12 and torch._dynamo.config.recompile_limit >= 2 * len(buckets)


@pytest.mark.skipif(not os.environ.get("DFLASH_SLOW_TESTS"), reason="12 flex compiles; DFLASH_SLOW_TESTS=1 runs it")
def test_walk_over_six_lengths_never_falls_back_to_unfused_flex(setup):
    """The walk pads each prompt to a power of two: 6 lengths in 6 buckets x 2 layer kinds are 12 compiled flex
    kernels, past dynamo's default recompile limit of 8, beyond which flex runs unfused with full score matrices.
    compile_flex raises the limit: no walk length hits it (a hit is an error here), none runs unfused."""
    cfg, target, drafter = setup["cfg"], setup["target"], setup["drafter"]
    assert len({cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)}) == 2
    torch._dynamo.reset()
    counters.clear()
    rng = random.Random(1)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings():
        warnings.filterwarnings("error", message=EAGER_FLEX)
        for n in (40, 150, 300, 600, 1100, 2100):  # padded to 128, 256, ..., 4096
            ids = torch.tensor([[rng.randrange(1, VOCAB - 1) for _ in range(n)]])
            features = dflash.target_features(target, ids, cfg.target_layer_ids)[0]
            drafts, _ = dflash.draft_every_anchor(drafter, target, features, ids, n - 4)
            assert drafts.shape == (3, cfg.block_size - 1)
    assert flex_graphs() == 12
