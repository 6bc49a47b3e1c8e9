"""Bad input gives one clear line and exit code 2 (no traceback); numerical faults never reach the weights."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import dflash
from conftest import ROOT, SMALL, VOCAB, tiny_qwen3, write_data, write_lines


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    d = tmp_path_factory.mktemp("robust")
    q3 = tiny_qwen3(d / "q3")
    data = write_data(d / "data.jsonl", 16)
    base = ["--target", q3, "--data", data, "--max_steps", "2", "--batch_size", "4", *SMALL]
    return {"dir": d, "q3": q3, "data": data, "base": base}


def fails_with(capsys, argv, *needles):
    """Run dflash.main in-process: it must exit 2 with a single `error:` line containing every needle."""
    with pytest.raises(SystemExit) as e:
        dflash.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    line = [x for x in err if x.startswith("error:")]
    assert len(line) == 1, err
    for n in needles:
        assert n in line[0], line[0]
    return line[0]


def replace(argv, flag, value):
    argv = list(argv)
    i = argv.index(flag)
    argv[i + 1] = value
    return argv


def test_missing_paths(w, capsys, tmp_path):
    fails_with(capsys, replace(w["base"], "--data", str(tmp_path / "nope.jsonl")), "nope.jsonl", "does not exist")
    fails_with(capsys, replace(w["base"], "--target", str(tmp_path / "no_model")), "no_model", "config.json")
    fails_with(capsys, w["base"] + ["--out", str(tmp_path / "o"), "--init_from", str(tmp_path / "nodrafter")],
               "nodrafter", "does not exist")


def test_bad_data_files(w, capsys, tmp_path):
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    fails_with(capsys, replace(w["base"], "--data", empty), "empty")
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps({"input_ids": [1, 2, 3]}), "{not json"])
    fails_with(capsys, replace(w["base"], "--data", bad), "bad.jsonl:2", "not valid JSON")
    unknown = write_lines(tmp_path / "unknown.jsonl", [json.dumps({"foo": 1})])
    fails_with(capsys, replace(w["base"], "--data", unknown), "unknown.jsonl:1", "known fields")
    no_resp = write_lines(tmp_path / "noresp.jsonl", [json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}),
                                                      json.dumps({"input_ids": [5]})])
    fails_with(capsys, replace(w["base"], "--data", no_resp), "no usable samples", "2 skipped")


def test_samples_without_response_are_skipped_and_counted(tmp_path, capsys):
    lines = [json.dumps({"input_ids": [1, 2, 3, 4]}), json.dumps({"input_ids": [1, 2], "loss_mask": [1, 0]}),
             json.dumps({"input_ids": [7]})]
    samples = dflash.load_samples(write_lines(tmp_path / "d.jsonl", lines), None, 100)
    assert samples == [([1, 2, 3, 4], [1, 1, 1, 1])]
    assert "skipped 2" in capsys.readouterr().out


def test_bad_flags(w, capsys):
    b = w["base"]
    fails_with(capsys, replace(b, "--target_layer_ids", "1,4"), "out of range", "4 decoder layers")
    fails_with(capsys, replace(b, "--target_layer_ids", "1,1"), "duplicates")
    fails_with(capsys, replace(b, "--target_layer_ids", "3,1"), "increasing")
    fails_with(capsys, replace(b, "--mask_token_id", str(VOCAB + 5)), "mask_token_id", "outside the vocabulary")
    i = b.index("--mask_token_id")
    fails_with(capsys, b[:i] + b[i + 2:], "no mask token", "--mask_token_id")  # no tokenizer, no flag
    fails_with(capsys, replace(b, "--block_size", "1"), "--block_size", "1 is outside", "an integer >= 2")
    fails_with(capsys, replace(b, "--num_anchors", "0"), "--num_anchors", "0 is outside", "an integer >= 1")


def test_mismatched_drafter_and_resume(w, capsys, tmp_path):
    out = str(tmp_path / "run")
    fails_with(capsys, w["base"] + ["--out", out, "--resume"], "no checkpoint", "--resume")
    dflash.main(w["base"] + ["--out", out])  # a good run, then reuse its drafter against other targets
    drafter = os.path.join(out, "step_2")
    for name, kw, needle in [("wide", {"hidden_size": 48}, "hidden size"), ("vocab", {"vocab_size": VOCAB + 32}, "vocab"),
                             ("deep", {"num_hidden_layers": 6}, "num_target_layers")]:
        path = tiny_qwen3(tmp_path / name, **kw)  # tiny_qwen3's geometry but for one field
        fails_with(capsys, replace(w["base"], "--target", path) + ["--out", str(tmp_path / "x"), "--init_from", drafter],
                   needle, "another target")
    # fine-tuning from a drafter directory (ours or z-lab's) keeps its geometry and trains on
    tuned = str(tmp_path / "tuned")
    dflash.main(replace(w["base"], "--block_size", "3") + ["--out", tuned, "--init_from", drafter])
    assert dflash.read_drafter_config(os.path.join(tuned, "step_2")) == dflash.read_drafter_config(drafter)
    before, after = dflash.load_drafter(drafter), dflash.load_drafter(os.path.join(tuned, "step_2"))
    assert not torch.equal(before.fc.weight, after.fc.weight)
    # resuming with another drafter geometry is refused, naming the field
    fails_with(capsys, replace(w["base"], "--block_size", "3") + ["--out", out, "--resume"], "block_size", "cannot resume")


def test_subprocess_error_has_no_traceback_unless_debug(w, tmp_path):
    argv = [sys.executable, os.path.join(ROOT, "dflash.py"), *replace(w["base"], "--data", str(tmp_path / "x.jsonl"))]
    p = subprocess.run(argv, capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: data file")
    with pytest.raises(dflash.DFlashError, match="data file"):  # --debug: the exception itself, traceback and all
        dflash.main(argv[2:] + ["--debug"])


def test_non_finite_steps_are_skipped_and_never_reach_weights(w, monkeypatch, tmp_path, capsys):
    real = dflash.target_features
    calls = {"n": 0}

    def poisoned(target, input_ids, layer_ids):  # the 2nd and 3rd training batches carry NaN features
        calls["n"] += 1
        context, final = real(target, input_ids, layer_ids)
        if calls["n"] in (2, 3):
            context = context.clone()
            context[0, 0, 0] = float("nan")
        return context, final

    monkeypatch.setattr(dflash, "target_features", poisoned)
    out = str(tmp_path / "nan")
    dflash.main(replace(w["base"], "--max_steps", "5") + ["--out", out, "--grad_accum", "1"])
    text = capsys.readouterr().out
    assert "step 2: non-finite" in text and "step 3: non-finite" in text  # log lines count steps from 1
    assert "step 1: non-finite" not in text and "step 4: non-finite" not in text
    weights = load_file(os.path.join(out, "step_5", "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    state = torch.load(os.path.join(out, "step_5", "train_state.pt"), weights_only=True)
    assert all(torch.isfinite(v).all() for s in state["optimizer"]["state"].values() for v in s.values()
               if torch.is_tensor(v))

    calls["n"] = -100  # from now on every batch is poisoned: the run stops after --max_bad_steps
    monkeypatch.setattr(dflash, "target_features", lambda *a: (torch.full_like(real(*a)[0], float("nan")), real(*a)[1]))
    fails_with(capsys, replace(w["base"], "--max_steps", "10") + ["--out", str(tmp_path / "nan2"), "--max_bad_steps", "3"],
               "3 consecutive non-finite steps")
