"""dflash_tools/recipe.py end to end on a tiny Llama (a byte-level BPE and a chat template), in-process: every phase's
output is there (the prompt groups disjoint by source file, the data in a format dflash.py reads, the capture, both
drafters, tau and the loop's report, recipe.json, the --ready file); a rerun skips every phase; a regeneration cut
short generates only the answers it lacks."""
import json
import os

import pytest
import torch
from conftest import build_llama, torch_threads

from dflash_tools import recipe
from dflash_tools.tiny_target import train_tokenizer

TINY = dict(train=4, new=2, heldout=2, loop_prompts=1, new_tokens=6, regen_batch=3, eval_tokens=6, steps=2,
            anchors=4, save_every=1)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|endoftext|>{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
PHASES = ["prompts", "regenerate", "capture", "train_dflash", "train_dflash2", "eval"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny tied Llama with a 300-token byte-level BPE (eos <|endoftext|> 0, mask <|mask|> 1) and a chat template."""
    path = tmp_path_factory.mktemp("recipe") / "target"
    tok = train_tokenizer(["def add(a, b):\n    return a + b  # Return the sum of two numbers.\n" * 8], vocab_size=300)
    tok.chat_template = TEMPLATE
    build_llama(vocab_size=320, tie_word_embeddings=True, max_position_embeddings=2048, bos_token_id=0,
                eos_token_id=0, pad_token_id=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def run(target, out, *extra):
    args = recipe.get_parser().parse_args(["--target", target, "--out", str(out), "--threads", "0", *extra])
    with torch_threads(1):
        return recipe.run(args, dict(TINY))


@pytest.fixture(scope="module")
def done(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "out"
    ready = out.parent / "READY"
    return out, ready, run(target, out, "--ready", str(ready))


def test_every_phase_leaves_its_output(done):
    out, ready, summary = done
    groups = {g: recipe.read_jsonl(out / f"prompts_{g}.jsonl") for g in recipe.GROUPS}
    assert {g: len(v) for g, v in groups.items()} == {"train": 4, "new": 2, "heldout": 2}
    files = {g: {r["source"] for r in v} for g, v in groups.items()}
    assert not files["train"] & files["heldout"] and not files["new"] & (files["train"] | files["heldout"])
    data = recipe.read_jsonl(out / "data.jsonl")
    assert sorted(r["id"] for r in data) == [0, 1, 2, 3]
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in data)
    assert json.loads((out / "features" / "manifest.json").read_text())["complete"]
    for v in ("dflash", "dflash2"):
        assert summary["results"][f"train_{v}"]["drafter"] == str(out.resolve() / v / "step_2")
        assert os.path.isfile(out / v / "step_2" / "config.json")
    tau = json.loads((out / "eval_tau.json").read_text())
    assert [r["drafter"] for r in tau["results"]] == ["dflash", "dflash2", "untrained", "prompt-lookup"]
    assert tau["num_prompts"] == 2
    loop = json.loads((out / "eval_loop.json").read_text())
    assert loop["mode"] == "loop" and all(r["matches_greedy"] for r in loop["results"])
    assert set(summary["phases_s"]) == set(PHASES) and summary["peak_rss_mb"] > 0
    assert json.loads((out / "recipe.json").read_text())["total_s"] == summary["total_s"]
    lines = dict(line.split(": ", 1) for line in ready.read_text().splitlines())
    assert lines["drafter"] == summary["results"]["train_dflash"]["drafter"]
    assert os.path.isfile(lines["prompts_new"]) and os.path.isdir(lines["features"])


def test_a_rerun_skips_every_phase(done, target, capsys):
    out, _, first = done
    phases = json.loads((out / "phases.json").read_text())
    phases["capture"]["peak_rss_mb"] = 10 ** 6  # as if an earlier process had peaked there: the summary keeps it
    (out / "phases.json").write_text(json.dumps(phases))
    capsys.readouterr()
    again = run(target, out)
    said = capsys.readouterr().out
    assert [p for p in PHASES if f"{p}: done in an earlier run" in said] == PHASES
    assert again["phases_s"] == first["phases_s"] and again["peak_rss_mb"] == 10 ** 6


def test_regeneration_cut_short_generates_only_what_it_lacks(done, target, tmp_path):
    out, _, _ = done
    for name in ("prompts_train.jsonl", "data.jsonl"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    data = (tmp_path / "data.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "data.jsonl").write_text("".join(data[:2]) + data[2][:10])  # two whole lines and a torn one
    import dflash
    with torch_threads(1):
        t = dflash.load_target(target, "cpu", torch.float32)
        result = recipe.phase_regenerate(str(tmp_path), t, TINY, print)
    again = recipe.read_jsonl(tmp_path / "data.jsonl")
    assert [r["id"] for r in again[:2]] == [json.loads(line)["id"] for line in data[:2]]
    assert sorted(r["id"] for r in again) == [0, 1, 2, 3] and result["answers"] == 4
    assert result["generated_now"] == 2
