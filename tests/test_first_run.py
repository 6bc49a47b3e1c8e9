"""A first run on your own model: a new drafter's geometry follows the target, every config problem is reported at
once with a value that works, the held-out split has a floor, and the smaller surprises are said where a user looks."""


import pytest

import dflash
import eval as ev
from conftest import VOCAB, tiny_qwen3, tiny_qwen35, tiny_tokenizer, write_data


def defaults(**over):
    args = dflash.get_parser().parse_args([])
    return {**{k: getattr(args, k) for k in dflash.DRAFTER_FLAGS}, **over}


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory):
    """Qwen3-8B from its config.json alone, on the meta device: 36 layers, 4096 wide, 32 heads, 8 kv heads of 128."""
    from transformers import Qwen3Config
    path = tmp_path_factory.mktemp("q3-8b")
    Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1e6).save_pretrained(path)
    return dflash.load_target(str(path), "meta")


def test_default_drafter_geometry_follows_the_target(tmp_path, qwen3_8b):
    """Heads, kv heads, head_dim and MLP width are the target's: z-lab's Qwen3-8B drafter from Qwen3-8B's config;
    a small target's own; a hybrid's full-attention layers'. Explicit flags still win."""
    q8 = dflash.new_drafter_config(qwen3_8b, **defaults(
        mask_token_id=151669, sliding_window=0))
    assert (q8.hidden_size, q8.num_attention_heads, q8.num_key_value_heads, q8.head_dim, q8.intermediate_size) == \
        (4096, 32, 8, 128, 12288)
    assert q8.target_layer_ids == [1, 9, 17, 25, 33] and q8.layer_types == ["full_attention"] * 5
    small = dflash.load_target(tiny_qwen3(tmp_path / "small", hidden_size=48, num_attention_heads=6,
                                          num_key_value_heads=3, head_dim=16, intermediate_size=80), "meta")
    cfg = dflash.new_drafter_config(small, **defaults(mask_token_id=VOCAB - 1, num_draft_layers=2,
                                                      target_layer_ids=[1, 2]))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.intermediate_size) == (48, 6, 3, 16, 80)
    hybrid = dflash.load_target(tiny_qwen35(tmp_path / "hybrid", num_attention_heads=8, num_key_value_heads=4), "meta")
    cfg = dflash.new_drafter_config(hybrid, **defaults(mask_token_id=VOCAB - 1, num_draft_layers=2,
                                                       target_layer_ids=[1, 2], head_dim=4))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 4, 4)


def test_every_config_problem_at_once_with_the_value_to_use(tmp_path, capsys, monkeypatch):
    """A 4-layer target whose tokenizer has 18 tokens, no mask token, 96 embedding rows; 5 drafter layers (the default
    spread repeats a layer) and 3 kv heads for 4 heads, and a data file that does not exist: four error lines, each
    with what to do, before any weights or data load (the target loads on the meta device only)."""
    target = tiny_qwen3(tmp_path / "t")
    tiny_tokenizer().save_pretrained(target)
    devices = []
    load = dflash.load_target
    monkeypatch.setattr(dflash, "load_target", lambda name, device="cpu", *a, **k: devices.append(str(device)) or
                        load(name, device, *a, **k))
    with pytest.raises(SystemExit) as e:
        dflash.main(["--target", target, "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o"),
                     "--num_kv_heads", "3", "--device", "cpu"])
    assert e.value.code == 2 and devices == ["meta"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 4, lines
    data, mask, ids, kv = lines
    assert "missing.jsonl" in data and "does not exist" in data and "--data" in data
    assert "no mask token" in mask and "--mask_token_id" in mask
    assert "repeat a layer" in ids and "--target_layer_ids 1,2" in ids
    assert "--num_kv_heads" in kv and "--num_heads" in kv


def test_valid_target_layer_ids():
    assert dflash.valid_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # the default where it is valid
    assert dflash.valid_target_layer_ids(4, 5) == [1, 2]
    assert dflash.valid_target_layer_ids(5, 3) == [1, 2, 3]
    for L in range(1, 12):
        for n in range(1, 7):
            ids = dflash.valid_target_layer_ids(L, n)
            assert ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < max(L - 1, 1) and len(ids) <= n


def test_held_out_floor():
    """At least 16 held-out samples, never more than half the data; 0 only when asked (or with one sample)."""
    assert dflash.held_out_count(480, 0.01) == 16   # 1% would be 4
    assert dflash.held_out_count(5000, 0.01) == 50
    assert dflash.held_out_count(20, 0.01) == 10    # small data: half, training keeps the other half
    assert dflash.held_out_count(2, 0.01) == 1 and dflash.held_out_count(1, 0.01) == 0
    assert dflash.held_out_count(480, 0) == 0
    train, held = dflash.split_eval([([i, i], [1, 1]) for i in range(480)], 0.01, seed=0)
    assert (len(train), len(held)) == (464, 16) and not set(map(str, train)) & set(map(str, held))


def test_help_states_each_default_once():
    for parser in (dflash.get_parser(), ev.get_parser()):
        fmt = parser._get_formatter()
        for action in parser._actions:
            h = fmt._get_help_string(action) if action.help else ""
            assert h.count("(default") <= 1 and "(default: [])" not in h, (action.option_strings, h)
            if isinstance(action.default, str) and f"{action.default}:" in (action.help or ""):
                assert "(default:" not in h, h  # "auto: flex on CUDA ..." already says it


def test_help_shows_defaults_and_never_suppress():
    """--help of dflash.py, eval.py and features.py capture: defaults shown, none printed as ==SUPPRESS== (-h's)."""
    import argparse
    from dflash_tools import features
    sub = next(a for a in features.get_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for parser in (dflash.get_parser(), ev.get_parser(), sub.choices["capture"]):
        text = " ".join(parser.format_help().split())
        assert "SUPPRESS" not in text and "(default: " in text, parser.prog
    assert "--max_len MAX_LEN as dflash.py's --max_len (default: 3072)" in " ".join(sub.choices["capture"].format_help()
                                                                                   .split())


def test_cpu_target_drops_the_advice_to_install_cuda_kernels(tmp_path):
    """transformers advises installing causal_conv1d and flash-linear-attention (CUDA-only kernels) on the first pass
    of a hybrid target, also on a CPU where there is nothing to install: dropped there, other warnings kept."""
    import logging
    log = logging.getLogger("transformers.integrations.hub_kernels")
    record = lambda msg: log.makeRecord(log.name, logging.WARNING, __file__, 0, msg, None, None)  # noqa: E731
    advice = record("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because "
                    "`causal_conv1d` is not installed. This is correct but much slower")
    dflash.load_target(tiny_qwen35(tmp_path / "q35"), "cpu")
    assert not log.filter(advice) and log.filter(record("a kernel failed to load"))


def test_plan_pointer_says_what_to_do():
    from dflash_tools import plan
    assert "README" not in plan.NOTHING_FITS and "--zero" in plan.NOTHING_FITS
