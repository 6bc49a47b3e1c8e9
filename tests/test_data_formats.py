"""The data formats of the field: ShareGPT conversations (from/value or role/content), JSON arrays, Parquet files and
datasets.save_to_disk directories give exactly the token ids and loss masks of the same conversations as JSONL
messages; a bad record is one error naming the file and row; eval.py --prompts and regenerate's --data read them."""

import json
import sys

import pytest

import dflash
from conftest import tiny_tokenizer
from dflash import DFlashError

EOS = [4]  # <|end|> ends a turn in conftest's chat template
CONVERSATIONS = [
    [("system", "ok sure"), ("user", "hi there"), ("assistant", "hello world"), ("user", "good day"),
     ("assistant", "bye a b c")],
    [("user", "hello"), ("assistant", "sure thing ok")],
    [("user", "a b"), ("assistant", "c c c"), ("tool", "ok"), ("assistant", "thing")],
]
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def as_messages(conv):
    return {"messages": [{"role": r, "content": c} for r, c in conv]}


def as_sharegpt(conv):
    return {"id": "x", "conversations": [{"from": SHAREGPT_FROM[r], "value": c} for r, c in conv]}


def as_sharegpt_roles(conv):
    return {"conversations": [{"role": r, "content": c} for r, c in conv]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_parquet(path, records):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    keys = list(dict.fromkeys(k for r in records for k in r))  # a column per field of any row, null elsewhere
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in records]), str(path))
    return str(path)


def save_to_disk(path, records, split=None):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(records)
    (datasets.DatasetDict({split: ds}) if split else ds).save_to_disk(str(path))
    return str(path)


def load(path, tok):
    return dflash.load_samples(path, tok, 4096, say=lambda *a: None, eos_ids=EOS, vocab_size=64)


def test_every_format_gives_the_same_ids_and_masks(tmp_path):
    tok = tiny_tokenizer()
    reference = load(write_jsonl(tmp_path / "messages.jsonl", [as_messages(c) for c in CONVERSATIONS]), tok)
    assert len(reference) == 3 and all(sum(m) for _, m in reference)
    # the loss covers exactly the assistant turns through their end-of-turn token
    ids, mask = reference[1]
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "sure thing ok <|end|>"
    sharegpt = [as_sharegpt(c) for c in CONVERSATIONS]
    mixed = [as_sharegpt(CONVERSATIONS[0]), as_messages(CONVERSATIONS[1]), as_sharegpt_roles(CONVERSATIONS[2])]
    inputs = {
        "sharegpt.jsonl": write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt),
        "sharegpt roles": write_jsonl(tmp_path / "roles.jsonl", [as_sharegpt_roles(c) for c in CONVERSATIONS]),
        "json array": str(tmp_path / "sharegpt.json"),
        "parquet messages": write_parquet(tmp_path / "m.parquet", [as_messages(c) for c in CONVERSATIONS]),
        "parquet sharegpt": write_parquet(tmp_path / "s.parquet", sharegpt),
        "parquet mixed formats": write_parquet(tmp_path / "x.parquet", mixed),  # null columns per row
        "save_to_disk": save_to_disk(tmp_path / "ds", sharegpt),
        "save_to_disk split": save_to_disk(tmp_path / "dd", [as_messages(c) for c in CONVERSATIONS], "train"),
    }
    (tmp_path / "sharegpt.json").write_text(json.dumps(sharegpt, indent=1))
    for name, path in inputs.items():
        assert load(path, tok) == reference, name


def test_pretokenized_parquet_and_other_formats(tmp_path):
    tok = tiny_tokenizer()
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}, {"text": "hi there good day"},
            {"prompt": "hello", "response": "sure thing"}]
    assert load(write_parquet(tmp_path / "p.parquet", rows), tok) == load(write_jsonl(tmp_path / "p.jsonl", rows), tok)


def errors(path, tok=None):
    with pytest.raises(DFlashError) as e:
        load(path, tok or tiny_tokenizer())
    return str(e.value)


def test_bad_records_name_the_file_and_row(tmp_path):
    good = [as_sharegpt(c) for c in CONVERSATIONS]
    bad_from = good[:2] + [{"conversations": [{"from": "robot", "value": "hi"}]}]
    p = write_parquet(tmp_path / "bad.parquet", bad_from)
    assert errors(p) == f"{p} row 2: conversations[0] has from 'robot'; expected human, gpt, system or tool (or " \
                        f"role/content turns)"
    p = write_jsonl(tmp_path / "bad.jsonl", bad_from)
    assert errors(p).startswith(f"{p}:3: conversations[0] has from 'robot'")
    p = save_to_disk(tmp_path / "bad_ds", [{"text": "hi there"}, {"nothing": "here"}])
    assert errors(p).startswith(f"{p} row 1: none of the known fields")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet PAR1")
    assert "cannot read data file" in errors(str(tmp_path / "broken.parquet"))
    (tmp_path / "plain_dir").mkdir()
    assert "not one written by datasets' save_to_disk" in errors(str(tmp_path / "plain_dir"))
    two = tmp_path / "two"
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(good), "test": datasets.Dataset.from_list(good)}) \
        .save_to_disk(str(two))
    assert "holds the splits train, test; pass one of them" in errors(str(two))
    assert load(str(two / "train"), tiny_tokenizer()) == load(write_jsonl(tmp_path / "g.jsonl", good), tiny_tokenizer())
    (tmp_path / "array.json").write_text('[{"text": "hi"}, 3]')
    assert errors(str(tmp_path / "array.json")).startswith(f"{tmp_path / 'array.json'} item 1: expected a JSON object")


def test_missing_package_is_one_line(tmp_path, monkeypatch):
    p = write_parquet(tmp_path / "m.parquet", [as_messages(c) for c in CONVERSATIONS])
    d = save_to_disk(tmp_path / "ds", [as_messages(c) for c in CONVERSATIONS])
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert errors(p) == f"data file {p!r} is Parquet: reading it needs the pyarrow package: pip install pyarrow"
    assert errors(d).endswith("needs the datasets package: pip install datasets")


def test_eval_prompts_and_regenerate_read_the_same_formats(tmp_path):
    import eval as ev
    from dflash_tools import regenerate
    tok = tiny_tokenizer()
    jsonl = write_jsonl(tmp_path / "m.jsonl", [as_messages(c) for c in CONVERSATIONS])
    others = [write_jsonl(tmp_path / "s.jsonl", [as_sharegpt(c) for c in CONVERSATIONS]),
              write_parquet(tmp_path / "s.parquet", [as_sharegpt(c) for c in CONVERSATIONS]),
              save_to_disk(tmp_path / "ds", [as_sharegpt(c) for c in CONVERSATIONS])]
    prompts = ev.load_prompts(jsonl, tok)
    assert tok.decode(prompts[1]) == "<|user|> hello <|end|> <|assistant|>"  # up to the last assistant turn
    turns = regenerate.read_input(jsonl)
    assert [n for n, _ in turns] == [1, 2, 3] and turns[1][1][-1] == {"role": "assistant", "content": "sure thing ok"}
    for path in others:
        assert ev.load_prompts(path, tok) == prompts, path
        assert [t for _, t in regenerate.read_input(path)] == [t for _, t in turns], path
    assert [n for n, _ in regenerate.read_input(others[1])] == [0, 1, 2]  # a table's rows
