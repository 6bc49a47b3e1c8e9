"""Every numeric flag at the edges of the range its rule accepts (the smallest value, the next one above an open
bound, the largest or a huge one where there is no upper bound), run through the computation it feeds: the run
works, or ends in one error line that names the flag's real limit. Here eval.py (regenerate's flags are run so in
tests/test_regenerate_hostile.py)."""

import json

import pytest
import torch

import dflash
import eval as ev
from conftest import VOCAB, flag_edges, tiny_cfg, tiny_qwen3, tiny_tokenizer

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
        assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err and "block size <= 4" in err
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
    p = ev.sampling_probs(logits, ev.Sampling(temperature))
    assert torch.isfinite(p).all() and p[0].tolist() == [0, 0, 0, 1] and p[1].tolist() == [0.5, 0.5, 0, 0]
    p = ev.sampling_probs(logits, ev.Sampling(1.0, top_p=5e-324))  # the smallest top_p: the top token alone
    assert p[0].tolist() == [0, 0, 0, 1]
    huge = ev.sampling_probs(logits, ev.Sampling(1.7e308))  # the largest: uniform
    assert torch.allclose(huge, torch.full_like(huge, 0.25))
