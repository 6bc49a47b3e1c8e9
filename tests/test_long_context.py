"""Long context: tau by context depth (eval.py's depth buckets sum back to the pooled figures), prompts and samples
past the target's positions refused in one line, the target's yarn taken by a drafter trained past its
max_position_embeddings (and written into config.json), the dense path's saved tensors linear in the length at
fixed anchors, and the memory plan's longest fitting length. Tiny random models on CPU."""

import json
import os
from dataclasses import asdict

import pytest
import torch

import dflash
import eval as ev
from conftest import DENSE_DRAFTER, DENSE_TARGET, SMALL, VOCAB, one_error, tiny_cfg, tiny_qwen3
from dflash import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread_module")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    return {"dir": d, "plain": tiny_qwen3(d / "plain"),  # 256 positions, plain RoPE
            "yarn": tiny_qwen3(d / "yarn", rope_parameters={**YARN, "rope_theta": 10000.0}),  # reaches 1024
            "dense": tiny_qwen3(d / "dense", **DENSE_TARGET)}  # 512 positions


# -----------------------------------------------------------------------------
# tau by context depth


def test_step_depths_and_buckets_hand_example():
    entry = {"prompt_tokens": 10, "acceptance_lengths": [3, 1, 3, 2]}
    assert ev.step_depths(entry) == [10, 13, 14, 17]  # the anchor's absolute position, prompt + continuation so far
    buckets = ev.depth_stats([entry], 4, [12, 16])
    assert [(b["depth"], b["steps"], b["accepted_tokens"]) for b in buckets] == [("< 12", 1, 3), ("12-16", 2, 4),
                                                                                (">= 16", 1, 2)]
    assert buckets[1]["histogram"] == [1, 0, 1, 0] and buckets[1]["tau"] == 2.0
    assert ev.depth_stats([entry], 4, [100]) == [{**ev.acceptance_stats([3, 1, 3, 2], 4), "depth": "< 100", "lo": 0,
                                                   "hi": 100, "accepted_tokens": 9}]  # one bucket: the pooled figures
    assert ev.depth_edges(300) == [128, 256, 512, 1024, 2048]
    assert ev.depth_edges(70000) == [1024, 4096, 16384, 65536]
    assert ev.depth_label(1024, 4096) == "1k-4k" and ev.depth_label(65536, None) == ">= 64k"


def check_sums(r):
    """The depth buckets of one result sum back to its pooled figures."""
    buckets, B = r["depth"], r["block_size"]
    lengths = [n for e in r["prompts"] for n in e["acceptance_lengths"]]
    assert sum(b["steps"] for b in buckets) == r["steps"] == len(lengths)
    assert sum(b["accepted_tokens"] for b in buckets) == sum(lengths)
    assert [sum(col) for col in zip(*(b["histogram"] for b in buckets))] == r["histogram"]
    assert sum(b["tau"] * b["steps"] for b in buckets) / r["steps"] == pytest.approx(r["tau"], rel=1e-12)
    for k in range(B - 1):
        pooled = sum(b["per_offset_acceptance"][k] * b["steps"] for b in buckets) / r["steps"]
        assert pooled == pytest.approx(r["per_offset_acceptance"][k], rel=1e-12, abs=1e-15)
    assert all(b["steps"] > 0 for b in buckets)  # empty buckets are left out


def test_depth_report_sums_to_pooled_table_json_compare(targets, tmp_path, capsys):
    target = dflash.load_target(targets["dense"])
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (8, 150, 300, 420)]
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(tiny_cfg(DENSE_DRAFTER))
    drafters = {"untrained": drafter.eval(), "prompt-lookup": ev.PromptLookupDrafter()}
    report = ev.evaluate_drafters(target, drafters, prompts, 40, progress=False, depth_buckets=[64, 128, 256])
    assert report["depth_edges"] == [64, 128, 256]
    for r in report["results"]:
        check_sums(r)
        assert [b["depth"] for b in r["depth"]] == ["< 64", "128-256", ">= 256"]  # 64-128 holds no anchor: left out
    lookup = report["results"][1]
    assert lookup["tau"] > 1.2  # random tiny targets repeat themselves: the lookup is accepted, the sums not vacuous
    ev.print_report(report)
    out = capsys.readouterr().out
    assert "by context depth" in out
    assert any(line.split()[:2] == ["prompt-lookup", ">="] for line in out.splitlines())
    path = ev.write_json(report, str(tmp_path / "r.json"))
    saved = json.load(open(path))
    assert saved["results"][1]["depth"] == lookup["depth"]
    compared = ev.compare_reports([path])  # recomputed from the saved entries: the same buckets
    assert compared["results"][1]["depth"] == lookup["depth"]
    default = ev.add_depth(json.loads(json.dumps(saved)))  # default edges for a deepest anchor below 4k
    assert default["depth_edges"] == list(ev.DEPTH_EDGES_SHORT)
    for r in default["results"]:
        check_sums(r)
    pytest.importorskip("matplotlib")
    fig = ev.dflash.import_tool("plot", "--plot").draw_histograms(report)
    assert len(fig.axes) == 4 and "depth" in fig.axes[2].get_title()  # histograms, then tau by depth per drafter


def test_prompt_past_the_targets_positions_is_one_error(targets, tmp_path, capsys):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5] * 20}) + "\n" + json.dumps({"input_ids": [7] * 600}) + "\n")
    one_error(capsys, ev.main, ["--target", targets["dense"], "--prompts", str(prompts), "--no_prompt_lookup",
                                     "--drafter", "prompt-lookup", "--max_new_tokens", "4"],
                   "prompt 1 is 600 tokens", "512 positions")


# -----------------------------------------------------------------------------
# Positions past the target's native window


def test_drafter_past_the_native_window_takes_the_targets_yarn(targets):
    meta = dflash.load_target(targets["yarn"], "meta")
    kw = dict(num_draft_layers=2, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2], sliding_window=8,
              say=lambda *a: None)
    short = dflash.new_drafter_config(meta, max_len=256, **kw)
    assert short.rope_scaling is None and short.max_position_embeddings == 256  # within the window: unchanged
    cfg = dflash.new_drafter_config(meta, max_len=1000, **kw)
    assert cfg.rope_scaling == YARN and cfg.max_position_embeddings == 1024  # 256 x 4
    d = dflash.DFlashDrafter(cfg)
    real = dflash.load_target(targets["yarn"])
    torch.testing.assert_close(d.inv_freq, real.backbone.rotary_emb.inv_freq, atol=0, rtol=1e-6)  # the target's own
    assert d.rope_scale == pytest.approx(real.backbone.rotary_emb.attention_scaling) and d.rope_scale > 1
    written = dflash.config_to_json(cfg)
    assert written["rope_parameters"] == {**YARN, "rope_theta": 10000.0} and written["max_position_embeddings"] == 1024
    assert dflash.config_from_json(json.loads(json.dumps(written))) == cfg  # the engines read what was trained
    assert dflash.new_drafter_config(meta, max_len=2000, **kw).rope_scaling == YARN  # past the reach: the data says
    plain = dflash.load_target(targets["plain"], "meta")  # plain RoPE: the drafter stays plain, the data is checked
    assert dflash.new_drafter_config(plain, max_len=1000, **kw).rope_scaling is None
    samples = [([1] * 1025, [1] * 1025)]  # (input_ids, loss_mask), as load_samples gives them
    with pytest.raises(DFlashError, match="a 1025-token sample is past the target's 1024 positions \\(yarn reach\\); "
                                          "use --max_len 1024$"):
        dflash.check_lengths(samples, meta.model.config, "--data")
    dflash.check_lengths([([1] * 1024, [1] * 1024)], meta.model.config, "--data")


def write_long(path, n, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": torch.randint(0, VOCAB - 1, (length,), generator=g).tolist()}) + "\n")
    return str(path)


def test_training_past_the_window_refused_or_with_yarn(targets, tmp_path, capsys):
    flags = SMALL[:-2] + ["--eval_fraction", "0.25", "--batch_size", "2", "--grad_accum", "1"]  # SMALL ends in it
    long_data = write_long(tmp_path / "long.jsonl", 4, 600)
    # a sample the target cannot take, under the default --max_len 3072: refused after the data is read
    one_error(capsys, dflash.main, ["--target", targets["plain"], "--data", long_data, *flags, "--max_steps",
                                         "1", "--out", str(tmp_path / "refused")],
                   "a 600-token sample is past the target's 256 positions (max_position_embeddings)",
                   "use --max_len 256 or a yarn rope_parameters (factor 3)")
    out = tmp_path / "yarn"
    dflash.main(["--target", targets["yarn"], "--data", long_data, *flags, "--max_len", "800", "--max_steps", "2",
                 "--eval_walk_prompts", "0", "--out", str(out), "--no_progress"])
    config = json.load(open(out / "step_2" / "config.json"))
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["max_position_embeddings"] == 1024
    assert dflash.load_drafter(str(out / "step_2")).cfg.rope_scaling == YARN


# -----------------------------------------------------------------------------
# Memory at long context: linear in the length at fixed anchors


def saved_for_backward(drafter, S, N, seed=0):
    """Bytes of the distinct storages the dense drafter's forward saves for backward, at length S with N anchors drawn
    uniformly over the whole sequence."""
    cfg = drafter.cfg
    g = torch.Generator().manual_seed(seed)
    anchors, valid = dflash.sample_anchors(torch.ones(S, dtype=torch.long), N, g)
    ctx = torch.randn(1, S, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    x = torch.randn(1, N, cfg.block_size, cfg.hidden_size, generator=g)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        drafter(ctx, x, anchors[None], valid[None]).sum().backward()
    return sum(seen.values())


def test_dense_path_saves_linear_in_length_at_fixed_anchors():
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(tiny_cfg(max_position_embeddings=1 << 16, layer_types=["sliding_attention",
                                                                                            "sliding_attention",
                                                                                            "full_attention"],
                                            sliding_window=64)).train()
    sizes = {S: saved_for_backward(drafter, S, 16) for S in (1024, 2048, 4096, 8192)}
    assert sizes[8192] > 3 * sizes[1024]  # it does grow with the context (the context keys, each group's scores)
    for S in (1024, 2048, 4096):  # at most linearly: twice the length, at most about twice the bytes (quadratic: 4x)
        assert sizes[2 * S] <= 2.05 * sizes[S], (S, sizes)


def test_plan_prices_long_lengths_and_says_where_a_run_stops_fitting():
    plan = dflash.import_tool("plan", "--plan")
    cfg = dflash.DFlashConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1e6,
                              max_position_embeddings=40960, mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33],
                              num_target_layers=36, layer_types=["full_attention"] * 5, sliding_window=None)
    d = plan.drafter_sizes(asdict(cfg), dflash.expected_shapes(cfg))
    t = {"params": 8.19e9, "hidden_size": 4096, "intermediate_size": 12288, "vocab_size": 151936,
         "context_layers": 5}
    for attention in ("flex", "dense"):
        run = {"world": 1, "zero": False, "grad_checkpoint": False, "num_anchors": 512, "batch_size": 1,
               "max_len": 3072, "attention": attention, "target_bytes": 2, "act_bytes": 2, "cuda": True}
        peak = lambda n: plan.plan_rows(t, d, {**run, "max_len": n})[-1][1]  # noqa: E731
        longest = plan.longest_fitting(t, d, run, 80e9)
        assert 3072 < longest and peak(longest) <= 80e9 < peak(longest + (1 if attention == "dense" else longest))
        grow = [peak(2 ** k) - peak(2 ** (k - 1)) for k in (15, 16, 17)]  # linear: each doubling costs twice the last
        assert grow[1] == pytest.approx(2 * grow[0], rel=0.01) and grow[2] == pytest.approx(2 * grow[1], rel=0.01)
        line = plan.length_line(t, d, run, 80e9)
        assert f"fits up to --max_len {longest:,}" in line and "32k" in line and "256k" in line


def test_bench_long_runs_small(capsys):
    """The long-context benchmark's CPU rows (tiny lengths) and its flex timing's code path (eager, forward only on
    CPU): they run, and report what they measured."""
    bench = dflash.import_tool("bench_long", "bench_long")
    rows = bench.main(["--lengths", "256,512", "--anchors", "8"])["rows"]
    assert [r["length"] for r in rows] == [256, 512]
    assert rows[1]["drafter_saved_mb"] > rows[0]["drafter_saved_mb"] > 0 and all(r["target_s"] > 0 for r in rows)
    flex = bench.main(["--flex", "--flex_device", "cpu", "--flex_lengths", "128", "--flex_anchors", "2"])["rows"]
    assert [(r["length"], r["enable_gqa"]) for r in flex] == [(128, True), (128, False)]
    out = capsys.readouterr().out
    assert "machine:" in out and "enable_gqa / repeated K/V" in out
