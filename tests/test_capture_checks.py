"""A capture (dflash_tools/features.py) without silent mistakes: its default layers are training's (never a repeated
layer) and each refusal's fix, taken literally, trains; a capture from a target whose decoder layers differ is refused;
a truncated file is refused before a step, with nothing written to --out; a run from features says so in one line and
reads its walks rather than announcing them generated; each capture phase has its own labelled progress."""
import json
import os
import re
import shutil

import pytest
import torch
from conftest import SMALL, fails_with, replace, tiny_qwen3, torch_threads, write_data

import dflash
from dflash_tools import features

WALK = ["--eval_fraction", "0.4", "--eval_walk_prompts", "4", "--eval_walk_tokens", "12"]


def without(argv, flag):  # argv less flag and its value
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def capture(target, data, out, *extra):
    with torch_threads(1):
        features.main(["capture", "--target", target, "--data", data, "--out", str(out), "--features_dtype", "fp32",
                       *WALK, *extra])
    return str(out)


def train(out, *argv):
    with torch_threads(1):
        dflash.main([*argv, "--out", str(out)])
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    d = tmp_path_factory.mktemp("checks")
    q3, data = tiny_qwen3(d / "q3"), write_data(d / "data.jsonl", 24)
    run = [*replace(without(SMALL, "--target_layer_ids"), "--eval_fraction", "0.4"), *WALK[2:], "--max_steps", "2",
           "--batch_size", "2", "--no_progress"]
    return {"dir": d, "q3": q3, "data": data, "run": ["--target", q3, "--data", data, *run],
            "default": capture(q3, data, d / "default")}


def suggested(err, flag):
    """The value an error line tells to pass with flag."""
    return re.search(rf"pass {flag} (\S+?)[;,)]?(?:\s|$)", err)[1]


def test_default_layers_are_trainings_and_each_fix_trains(cap, capsys, tmp_path):
    """On the 4-layer tiny target the capture's default is training's valid default, [1, 2] (a 5-layer drafter's
    rule spreads [1, 1, 1, 1, 1]); training without --target_layer_ids is refused naming --target_layer_ids 1,2, which
    then trains; a drafter asking for a layer the capture lacks is told a --target_layer_ids it holds, which trains;
    another --max_len or walk than the capture's is told the capture's flags, which train; a capture storing a layer
    twice, or the last layer (which no drafter reads), is refused."""
    m = json.load(open(os.path.join(cap["default"], "manifest.json")))
    assert m["target_layer_ids"] == dflash.valid_target_layer_ids(4, 5) == [1, 2]
    assert dflash.default_target_layer_ids(4, 5) == [1, 1, 1, 1, 1]
    run = [*cap["run"], "--features", cap["default"]]
    err = fails_with(capsys, [*run, "--out", str(tmp_path / "a")], "repeat a layer", "--target_layer_ids 1,2")
    assert len(train(tmp_path / "b", *run, "--target_layer_ids", suggested(err, "--target_layer_ids"))) > 2
    err = fails_with(capsys, [*run, "--target_layer_ids", "0,2", "--out", str(tmp_path / "c")], "no layer 0;",
                     "into a new --out")
    assert len(train(tmp_path / "d", *run, "--target_layer_ids", suggested(err, "--target_layer_ids"))) > 2
    run = [*run, "--target_layer_ids", "1,2"]
    for flags, needle in ((["--max_len", "100"], "--max_len 3072"),
                          (["--eval_walk_prompts", "6", "--eval_walk_tokens", "10"], "--eval_walk_tokens 12 "
                                                                                     "--eval_walk_prompts 4")):
        out = str(tmp_path / flags[0].strip("-"))
        fails_with(capsys, [*run, *flags, "--out", out], f"captured with {needle}", f"pass {needle}")
        assert len(train(out + "_fixed", *run, *flags, *needle.split())) > 2
    for layers, needle in (("1,2,1", "store layer(s) [1] twice"), ("1,3", "not its last")):
        with pytest.raises(SystemExit):
            capture(cap["q3"], cap["data"], tmp_path / "bad", "--target_layer_ids", layers)
        assert needle in capsys.readouterr().err


def test_a_capture_of_another_fine_tune_is_refused(cap, capsys, tmp_path):
    """A target whose one decoder layer differs (the embedding the same: the record's fingerprint agrees) has its
    weights' digest differ, and a capture of the other is refused in one line; a capture made before the digest is
    accepted with a note that only the embedding was checked."""
    from safetensors.torch import load_file, save_file
    other = str(tmp_path / "tuned")
    shutil.copytree(cap["q3"], other)
    w = load_file(os.path.join(other, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for k in w:
        if k.startswith("model.layers.3."):
            w[k] = w[k] + 0.01 * torch.randn(w[k].shape, generator=g)
    save_file(w, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    a, b = dflash.load_target(cap["q3"]), dflash.load_target(other)
    assert dflash.target_record(a)["fingerprint"] == dflash.target_record(b)["fingerprint"]
    assert features.weights_digest(cap["q3"]) != features.weights_digest(other)
    run = replace([*cap["run"], "--target_layer_ids", "1,2"], "--target", other)
    fails_with(capsys, [*run, "--features", cap["default"], "--out", str(tmp_path / "o")], "weights differ from "
               "--target", "beyond the embedding", "recapture with this target")
    old = str(tmp_path / "old")  # a capture made before the digest: accepted, saying what was checked
    shutil.copytree(cap["default"], old)
    m = json.load(open(os.path.join(old, "manifest.json")))
    del m["layers_digest"]
    json.dump(m, open(os.path.join(old, "manifest.json"), "w"))
    assert len(train(tmp_path / "accepted", *run, "--features", old)) > 2
    assert "predates the layers' digest: only the target's embedding is checked" in capsys.readouterr().err


def test_a_truncated_file_is_refused_before_a_step(cap, capsys, tmp_path):
    """A sample file cut short (its header intact) and a walk file cut into its header: each named in one line before
    the first step, and --out holds no metrics.jsonl nor step folder."""
    run = [*cap["run"], "--target_layer_ids", "1,2"]
    for victim, cut in (("s00000005.safetensors", 4), ("w00001.safetensors", None)):
        d = str(tmp_path / f"copy_{victim}")
        shutil.copytree(cap["default"], d)
        f = os.path.join(d, "rank000", victim)
        with open(f, "r+b") as h:
            h.truncate(os.path.getsize(f) - cut if cut else 20)
        out = tmp_path / f"o_{victim}"
        fails_with(capsys, [*run, "--features", d, "--out", str(out)], victim, "unreadable", "rerun the capture")
        assert not os.path.exists(out / "metrics.jsonl") and not [n for n in os.listdir(out) if n.startswith("step")]


def test_a_run_from_features_says_so_and_reads_its_walks(cap, capsys, tmp_path):
    """One line names the capture, its dtype, layers and samples; the held-out walk is read, not announced generated.
    The capture's phases have their own progress: samples, then walk prompts with the tokens generated."""
    train(tmp_path / "o", *cap["run"], "--target_layer_ids", "1,2", "--features", cap["default"])
    out = capsys.readouterr().out
    assert (f"features: training from {cap['default']} (fp32, layers [1, 2] of [1, 2], 24 of 24 samples, 4 held-out "
            f"walks); the target's layers not loaded") in out
    assert "held-out walk: reading the captured greedy continuations of 4" in out and "generating" not in out
    capture(cap["q3"], cap["data"], tmp_path / "again")
    err = capsys.readouterr().err
    assert "capture: samples" in err and "24/24" in err and "tokens" in err
    assert "capture: held-out walk prompts" in err and "4/4" in err and "tokens generated" in err
