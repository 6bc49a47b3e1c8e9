"""Every numeric flag at the edges of the range its rule accepts (the smallest value, the next one above an open
bound, the largest or a huge one where there is no upper bound), run through the computation it feeds: the run
works, or ends in one error line that names the flag's real limit. Here eval.py and dflash.py (regenerate's flags are
run so in tests/test_regenerate_hostile.py)."""

import json
import os
import signal

import pytest
import torch

import dflash
import eval as ev
from dflash_tools import sampling
from conftest import CYCLE, SMALL, VOCAB, flag_edges, tiny_cfg, tiny_qwen3, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread_module")

PROMPT = [5, 9, 13, 22, 31, 40]


@pytest.fixture(scope="module")
def ev_files(tmp_path_factory):
    """A tiny target, the same target with its first greedy token as eos (a greedy run of any length stops at once),
    a random drafter, a prompts file and a --bench_dir."""
    d = tmp_path_factory.mktemp("edges")
    target = tiny_qwen3(d / "target")
    tiny_tokenizer().save_pretrained(target)
    first = dflash.greedy_continuation(dflash.load_target(target), PROMPT, 1, set())[0]
    stops = tiny_qwen3(d / "stops", eos_token_id=first)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(tiny_cfg(vocab_size=VOCAB, mask_token_id=VOCAB - 1, num_target_layers=4,
                                            target_layer_ids=[1, 2]))
    dflash.save_drafter(drafter, str(d / "drafter"), dtype=torch.float32)
    (d / "p.jsonl").write_text(json.dumps({"input_ids": PROMPT}) + "\n")
    (d / "bench").mkdir()
    (d / "bench" / "gsm8k.jsonl").write_text(json.dumps({"question": "hi there", "answer": "#### 4"}) + "\n")
    return dict(dir=d, target=target, stops=stops, drafter=str(d / "drafter"), prompts=str(d / "p.jsonl"))


def eval_edges():
    return [(a.option_strings[0], v) for a in ev.get_parser()._actions if hasattr(a.type, "text")
            for v in flag_edges(a)]


@pytest.mark.parametrize("flag,value", eval_edges())
def test_eval_flag_at_its_edge(ev_files, tmp_path, capsys, flag, value):
    f = ev_files
    argv = ["--target", f["target"], "--drafter", f["drafter"], "--prompts", f["prompts"], "--max_new_tokens", "6",
            "--no_progress", "--json", str(tmp_path / "r.json"), flag, repr(value)]
    if flag in ("--top_p", "--top_k", "--samples", "--seed"):
        argv += ["--temperature", "1"]
    if flag == "--samples":
        argv[argv.index("--max_new_tokens") + 1] = "2"  # the most samples, each short
    if flag == "--max_new_tokens" and value > 6:
        argv[1] = f["stops"]  # any length: greedy stops at eos
    if flag == "--max_samples":
        argv = ["--target", f["target"], "--bench", "gsm8k", "--bench_dir", str(f["dir"] / "bench"), "--max_new_tokens",
                "4", "--no_progress", "--json", str(tmp_path / "r.json"), flag, repr(value)]
    if flag == "--block_size" and value > 4:  # the drafter's trained block size bounds it: one line saying so
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and "'s 4; give at most that" in err
        return
    ev.main(argv)
    report = json.loads((tmp_path / "r.json").read_text())
    results = report["results"] if "results" in report else report["benchmarks"]["gsm8k"]["results"]
    # a continuation of one token (--max_new_tokens 1, or eos at once) has no verification step to measure
    assert all(r["tau"] is None or r["tau"] >= 1 for r in results) and any(r["tau"] for r in results) == (
        flag != "--max_new_tokens")
    if flag[2:] in report:  # the value is the one measured at
        assert report[flag[2:]] == value


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-300, 1e-30])
def test_temperatures_float32_cannot_hold(temperature):
    """Temperatures that float32 rounds to 0, or under which logits / T overflows it: p' is the argmax, one-hot."""
    logits = torch.tensor([[3.0, 1.0, -2.0, 3.5], [0.0, 0.0, -1.0, -5.0]])
    p = sampling.sampling_probs(logits, ev.Sampling(temperature))
    assert torch.isfinite(p).all() and p[0].tolist() == [0, 0, 0, 1] and p[1].tolist() == [0.5, 0.5, 0, 0]
    p = sampling.sampling_probs(logits, ev.Sampling(1.0, top_p=5e-324))  # the smallest top_p: the top token alone
    assert p[0].tolist() == [0, 0, 0, 1]
    huge = sampling.sampling_probs(logits, ev.Sampling(1.7e308))  # the largest: uniform
    assert torch.allclose(huge, torch.full_like(huge, 0.25))


# -----------------------------------------------------------------------------
# dflash.py: a two-step tiny run per edge (in this process: ~0.5 s each)

# an edge that cannot run here ends in one error line naming what limits it (another flag, the data, the target)
DFLASH_LIMITED = {("--max_len", 2): "no usable samples", ("--batch_size", 10 ** 18): "< one global batch",
                  ("--grad_accum", 10 ** 18): "lower --batch_size or --grad_accum",
                  ("--mask_token_id", 10 ** 18): "outside the vocabulary",
                  ("--conv_kernel_size", 256): "larger than block_size 4",
                  ("--conv_group_size", 65536): "does not divide hidden_size 32",
                  ("--selector_top_k", 1024): "larger than the vocabulary 96"}
# companions an edge needs to be valid at all (heads divide evenly) or to do anything (a held-out set, --plan)
DFLASH_WITH = {"--num_heads": ["--num_kv_heads", "1"], "--num_kv_heads": ["--num_heads", "256"],
               "--eval_walk_prompts": ["--eval_fraction", "0.5"], "--eval_walk_tokens": ["--eval_fraction", "0.5"],
               "--eval_walk_tree_budget": ["--eval_fraction", "0.5"], "--plan_world_size": ["--plan"],
               "--plan_gpu_gb": ["--plan"],
               **{f: ["--dflash2"] for f in ("--conv_kernel_size", "--conv_group_size", "--selector_rank",
                                             "--selector_top_k", "--selector_alpha", "--selector_warmup_ratio",
                                             "--selector_ramp_ratio")}}


@pytest.fixture(scope="module")
def train_files(tmp_path_factory):
    """A tiny target, the same target with its first greedy token after PROMPT as eos (every walked continuation, of
    any length, stops at once), and 32 samples that all start with PROMPT."""
    d = tmp_path_factory.mktemp("dflash_edges")
    target = tiny_qwen3(d / "target")
    first = dflash.greedy_continuation(dflash.load_target(target), PROMPT, 1, set())[0]
    stops = tiny_qwen3(d / "stops", eos_token_id=first)
    with open(d / "data.jsonl", "w") as f:
        for i in range(32):
            response = [CYCLE[(i + k) % len(CYCLE)] for k in range(18)]
            f.write(json.dumps({"input_ids": PROMPT + response, "loss_mask": [0] * len(PROMPT) + [1] * 18}) + "\n")
    return dict(target=target, stops=stops, data=str(d / "data.jsonl"))


def dflash_edges():
    return [(a.option_strings[0], v) for a in dflash.get_parser()._actions if hasattr(a.type, "text")
            for v in flag_edges(a)]


def set_flag(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    return argv


@pytest.mark.parametrize("flag,value", dflash_edges())
def test_dflash_flag_at_its_edge(train_files, tmp_path, capsys, monkeypatch, flag, value):
    f = train_files
    out = str(tmp_path / "out")
    argv = ["--target", f["stops"] if flag == "--eval_walk_tokens" else f["target"], "--data", f["data"],
            "--max_steps", "2", "--batch_size", "2", "--grad_accum", "1", *SMALL, "--max_len", "64", "--out", out,
            "--eval_walk_prompts", "2", "--eval_walk_tokens", "8"]
    if flag == "--max_steps" and value == 0:  # steps from --epochs: one epoch of two batches
        argv = set_flag(set_flag(argv, "--epochs", "1"), "--batch_size", "16")
    argv = set_flag(argv, flag, repr(value))
    extra = DFLASH_WITH.get(flag, [])
    argv = set_flag(argv, *extra) if len(extra) == 2 else argv + extra
    if (flag, value) in DFLASH_LIMITED:
        with pytest.raises(SystemExit) as e:
            dflash.main(argv)
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error")]
        assert e.value.code == 2 and len(err) == 1 and DFLASH_LIMITED[flag, value] in err[0], err
        return
    if flag == "--max_steps" and value > 2:  # a run that long is stopped as a user would: SIGTERM after step 1
        real = dflash.train_step

        def step(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)
            return real(*a, **k)
        monkeypatch.setattr(dflash, "train_step", step)
    if flag in ("--plan_world_size", "--plan_gpu_gb"):
        with pytest.raises(SystemExit) as e:  # --plan prints the plan and exits 0
            dflash.main(argv)
        assert e.value.code == 0 and "plan" in capsys.readouterr().out
        return
    if flag == "--max_steps" and value > 2:
        with pytest.raises(SystemExit) as e:  # interrupted: 128 + SIGTERM, after its checkpoint
            dflash.main(argv)
        assert e.value.code == 128 + signal.SIGTERM
    else:
        dflash.main(argv)
    text = capsys.readouterr().out
    if flag == "--show_data" and value:
        assert not os.path.exists(out) or not os.listdir(out)  # it printed, and wrote nothing
        return
    latest = open(os.path.join(out, "latest")).read().strip()
    assert latest == ("step_1" if flag == "--max_steps" and value > 2 else "step_2"), text
    if flag.startswith("--eval_walk") and flag != "--eval_walk_prompts" or (flag == "--eval_walk_prompts" and value):
        with open(os.path.join(out, "metrics.jsonl")) as m:
            assert any("eval_walk_tau" in r for r in map(json.loads, m))


def test_eval_tree_budget_list_at_its_edges(ev_files, tmp_path, capsys):
    """--tree_budget 1 and the largest budget run; one more is one error line naming the bound."""
    f = ev_files
    argv = ["--target", f["target"], "--drafter", f["drafter"], "--prompts", f["prompts"], "--max_new_tokens", "6",
            "--no_progress", "--json", str(tmp_path / "r.json"), "--tree_budget", f"1,{dflash.TREE_BUDGET_MAX}"]
    ev.main(argv)
    tree = json.loads((tmp_path / "r.json").read_text())["results"][0]["tree"]
    assert 1 <= tree["1"]["tau"] <= tree[str(dflash.TREE_BUDGET_MAX)]["tau"]
    with pytest.raises(SystemExit):
        ev.main(argv[:-1] + [str(dflash.TREE_BUDGET_MAX + 1)])
    assert f"at most {dflash.TREE_BUDGET_MAX}" in capsys.readouterr().err
