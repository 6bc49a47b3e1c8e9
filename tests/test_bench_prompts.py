"""eval.py --bench: z-lab's benchmark prompts built from small local files in each dataset's own schema (offline),
mt-bench's later turns following the target's own answers, the deterministic subset, and bad input as one
error line."""

import json
import sys
import types

import pytest

import eval as ev
from conftest import tiny_qwen3, tiny_tokenizer
from dflash import DFlashError
from dflash_tools import benchmarks as bm

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
ROWS = {
    "gsm8k": [{"question": "hi there", "answer": "#### 4"}, {"question": "good day", "answer": "#### 5"}],
    "math500": [{"problem": "hello world", "solution": "a", "answer": "1", "subject": "x", "level": 1,
                 "unique_id": "u"}],
    "humaneval": [{"task_id": "HumanEval/0", "prompt": "def f(a):\n    \"\"\"ok\"\"\"\n", "canonical_solution": "",
                   "test": "assert f(1)", "entry_point": "f"}],
    "mbpp": [{"source_file": "s", "task_id": 2, "prompt": "sure thing", "code": "pass", "test_imports": [],
              "test_list": ["assert True"]}],
    "mt-bench": [{"prompt": ["hi there", "good day"], "prompt_id": 81, "category": "writing", "reference": []}],
}


@pytest.fixture
def bench_dir(tmp_path):
    for name, rows in ROWS.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_prompts_as_zlab_builds_them(bench_dir):
    got = {name: bm.conversations(name, bm.load_rows(name, bench_dir=str(bench_dir))) for name in ROWS}
    assert got["gsm8k"] == [["hi there" + REASON], ["good day" + REASON]]
    assert got["math500"] == [["hello world" + REASON]]
    assert got["humaneval"] == [["Write a solution to the following problem and make sure that it passes the tests:\n"
                                 "```python\ndef f(a):\n    \"\"\"ok\"\"\"\n\n```"]]
    assert got["mbpp"] == [["sure thing"]]
    assert got["mt-bench"] == [["hi there", "good day"]]
    json_file = bench_dir / "g.json"  # NAME=FILE, a JSON list
    json_file.write_text(json.dumps(ROWS["gsm8k"]))
    assert ev.load_bench(f"gsm8k={json_file}", None, None) == {"gsm8k": got["gsm8k"]}


def test_subset_is_deterministic():
    rows = list(range(50))
    a, b = bm.subset(rows, 7), bm.subset(rows, 7)
    assert a == b and len(set(a)) == 7 and a != rows[:7]
    assert bm.subset(rows, 50) == rows and bm.subset(rows, None) == rows


class FakeTarget:
    """What bench_turns reads of a target: the tokenizer and eos ids; greedy answers are patched in."""

    def __init__(self, tok):
        self.tokenizer = tok

    def eos_ids(self):
        return {4}


def test_mt_bench_turn_two_follows_the_targets_answer(monkeypatch):
    tok = tiny_tokenizer()
    answers = iter([[7, 8], [9, 10, 9]])  # "good day", then "bye ok bye"
    seen = []

    def fake_greedy(target, prompt, max_new_tokens, eos):
        seen.append(prompt)
        assert max_new_tokens == 5 and eos == {4}
        return next(answers)

    monkeypatch.setattr(ev, "greedy_continuation", fake_greedy)
    prompts, continuations = ev.bench_turns([["hi there", "hello world"]], FakeTarget(tok), 5, None, progress=False)
    turn1 = [{"role": "user", "content": "hi there"}]
    turn2 = turn1 + [{"role": "assistant", "content": "good day"}, {"role": "user", "content": "hello world"}]
    assert prompts == seen == [ev.chat_ids(tok, turn1, add_generation_prompt=True),
                               ev.chat_ids(tok, turn2, add_generation_prompt=True)]
    assert continuations == [[7, 8], [9, 10, 9]]  # tau is walked on each assistant turn's continuation


def test_bad_bench_input_is_one_error(bench_dir, tmp_path, monkeypatch):
    with pytest.raises(DFlashError, match="unknown benchmark 'gsm9k'"):
        ev.load_bench("gsm8k,gsm9k", str(bench_dir), None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "mbpp.jsonl").write_text(json.dumps({"text": "no prompt here"}) + "\n")
    with pytest.raises(DFlashError, match="row 0: no field 'prompt'"):
        ev.load_bench("mbpp", str(tmp_path / "bad"), None)
    (tmp_path / "bad" / "mt-bench.jsonl").write_text(json.dumps({"prompt": "not a list"}) + "\n")
    with pytest.raises(DFlashError, match="list of non-empty strings"):
        ev.load_bench("mt-bench", str(tmp_path / "bad"), None)
    with pytest.raises(DFlashError, match="has no math500.jsonl"):
        ev.load_bench("math500", str(tmp_path / "bad"), None)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(DFlashError, match="pip install datasets"):
        ev.load_bench("gsm8k", None, None)

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(DFlashError, match="could not load openai/gsm8k.*pass --bench_dir"):
        ev.load_bench("gsm8k", None, None)


def test_cli_bench_errors(bench_dir, capsys):
    for argv, msg in [(["--bench", "gsm8k", "--max_samples", "0"], "--max_samples"),
                      (["--bench", "nope", "--bench_dir", str(bench_dir)], "unknown benchmark"),
                      (["--max_samples", "3"], "go with --bench"),
                      (["--bench", "gsm8k", "--mode", "loop"], "drop --mode loop")]:
        with pytest.raises(SystemExit):
            ev.main(["--target", "unused", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and msg in err[0], err


def test_cli_bench_end_to_end(bench_dir, tmp_path, capsys, one_thread):
    path = tiny_qwen3(tmp_path / "target", vocab_size=96)
    tiny_tokenizer().save_pretrained(path)
    out = tmp_path / "bench.json"
    ev.main(["--target", path, "--bench", "gsm8k,mt-bench", "--bench_dir", str(bench_dir), "--max_samples", "1",
             "--max_new_tokens", "6", "--no_progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert "== gsm8k: 1 samples, 1 assistant turns" in text and "== mt-bench: 1 samples, 2 assistant turns" in text
    assert "tau/prompt (z-lab's convention) per benchmark" in text
    report = json.loads(out.read_text())
    assert set(report["benchmarks"]) == {"gsm8k", "mt-bench"}
    assert report["benchmarks"]["mt-bench"]["max_new_tokens"] == 6
    taus = [report["benchmarks"][n]["results"][0]["tau_per_prompt"] for n in ("gsm8k", "mt-bench")]
    assert report["average"]["prompt-lookup"]["tau_per_prompt"] == pytest.approx(sum(taus) / 2)
