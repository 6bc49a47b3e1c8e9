"""Bad input, checked where it enters, and faults of a run: every numeric flag of both command lines (swept by
class, enumerated from the parsers, so a flag added later is swept too), list flags, missing paths, the paths a run
writes, every kind of file it reads (truncated or garbage), data without anything to learn, drafters made for
another target, token ids against the target's vocabulary, devices that are not there, non-finite steps; and the
faults a long run meets: outputs that cannot be written, a used --out, a rank lost under torchrun, a resume on other
ranks or other data, a full disk, repeated signals, gzip or binary input. Each mistake ends in exactly one `error:`
line and exit code 2, never a traceback; numerical faults never reach the weights, and no fault loses a checkpoint."""
import errno
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import dflash
import eval as ev
from conftest import (ROOT, VOCAB, ZL, build_qwen3, fails_with, one_error, replace, tiny_qwen3, tree_bytes,
                      write_lines, write_zlab_dir, zlab_config, zlab_tensors)
from dflash import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread_module")

PARSERS = {"dflash": (dflash.get_parser, []), "eval": (ev.get_parser, ["--target", "t"])}
HOSTILE = ["0", "-1", "nan", "inf", "-inf", "1e30", str(10**30), "-1e30", "1.5", "0x10", ""]
Z = dict(ZL, V=VOCAB, M=VOCAB - 1, L=4, T=[1, 2])  # a z-lab geometry over tiny_qwen3(), not its last layer





def raises_one_line(fn, *needles):
    with pytest.raises(DFlashError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(max(1, int(size * keep)))


def garbage(path):
    with open(path, "wb") as f:
        f.write(b"\x93\xff\x00garbage, not what the name says\x01" * 37)


CORRUPT = {"truncated": truncate, "garbage": garbage}


def with_data(w, path, tmp_path):
    """The training command line of w with --data path and a fresh --out."""
    argv = list(w["base"])
    argv[argv.index("--data") + 1] = path
    return argv + ["--out", str(tmp_path / "o")]


# -----------------------------------------------------------------------------
# Flags: every numeric flag of both command lines is checked at parse time by its type (a rule such as
# "an integer >= 1"; an upper bound only where the meaning has one, e.g. a fraction)

def numeric_actions(parser):
    """Every flag whose value is a number; a flag declared with a bare int/float (unchecked) fails the test."""
    acts = [a for a in parser._actions if a.option_strings and a.type is not None]
    bare = [a.dest for a in acts if a.type in (int, float)]
    assert not bare, f"numeric flags without a checked type (use p.add(..., lo=)): {bare}"
    return [a for a in acts if hasattr(a.type, "text")]


def declared_rule(action):
    """(kind, lo, open_lo, hi) of a flag's rule text: 'an integer >= 1', 'a number > 0 and <= 1'."""
    m = re.fullmatch(r"(an integer|a number) (>=|>) (\S+)(?: and <= (\S+))?", action.type.text)
    assert m, action.type.text
    return m[1], float(m[3]), m[2] == ">", float(m[4]) if m[4] else math.inf


def obeys(value, rule):
    kind, lo, open_lo, hi = rule
    return (value > lo if open_lo else value >= lo) and value <= hi and (kind == "a number" or isinstance(value, int))


@pytest.mark.parametrize("cli", PARSERS)
def test_every_numeric_flag_is_checked(cli):
    parser = PARSERS[cli][0]()
    acts = numeric_actions(parser)
    assert len(acts) >= (20 if cli == "dflash" else 3)
    for a in acts:
        if a.default is not None:  # the default itself is valid
            assert obeys(a.default, declared_rule(a)), a.dest


@pytest.mark.parametrize("cli", PARSERS)
def test_numeric_flag_sweep(cli, capsys):
    """0, -1, nan, inf, huge, ...: a parse whose value obeys the flag's rule and is meaningful, or one error line
    naming the flag and its rule, exit 2."""
    make, base = PARSERS[cli]
    parser = make()
    for a in numeric_actions(parser):
        flag, rule = a.option_strings[0], declared_rule(a)
        for v in HOSTILE:
            try:
                value = getattr(parser.parse_args(base + [flag, v]), a.dest)
            except SystemExit as e:
                assert e.code == 2, (flag, v)
                err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
                assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], (flag, v, err)
                if v and not v.startswith("-"):  # argparse takes "-inf" for an option; otherwise the value is named
                    assert v in err[0] and (a.type.text in err[0] or "not an integer" in err[0]
                                            or "not a number" in err[0]), err[0]
                continue
            assert capsys.readouterr().err == ""
            assert isinstance(value, (int, float)) and math.isfinite(value), (flag, v, value)
            assert obeys(value, rule), (flag, v, value)
            if value == 0 and isinstance(value, int) and not re.search(r"_id$|seed", a.dest):
                assert "(0:" in a.help, f"{flag} accepts 0: its --help must say what 0 means"


def test_special_values_stay_meaningful():
    args = dflash.get_parser().parse_args(["--sliding_window", "0", "--noise_std", "0", "--max_steps", "0",
                                           "--eval_every", "0", "--save_every", "0", "--warmup_ratio", "0"])
    assert (args.sliding_window, args.noise_std, args.max_steps, args.eval_every, args.save_every) == (0, 0, 0, 0, 0)
    assert ev.get_parser().parse_args(["--target", "t", "--limit", "0"]).limit == 0


def test_list_flags_fail_in_one_line_on_junk(capsys):
    parse = dflash.get_parser().parse_args
    for flag, junk in [("--target_layer_ids", "a,b"), ("--target_layer_ids", "1,,3"), ("--target_layer_ids", ""),
                       ("--target_layer_ids", "1.5"), ("--layer_types", "sliding,fool"), ("--layer_types", ""),
                       ("--layer_types", "full,")]:
        one_error(capsys, parse, [flag, junk], flag)
    assert parse(["--layer_types", "sliding, full,full_attention"]).layer_types == \
        ["sliding_attention", "full_attention", "full_attention"]
    assert parse(["--target_layer_ids", "1,3"]).target_layer_ids == [1, 3]


# -----------------------------------------------------------------------------
# Paths the run writes: checked before anything is loaded (the target given here does not exist)

def test_write_paths_are_checked_first(w, capsys, tmp_path):
    nowhere = ["--target", str(tmp_path / "no_target"), "--data", w["data"]]
    a_file = write_lines(tmp_path / "a_file", ["x"])
    main = dflash.main
    one_error(capsys, main, nowhere + ["--out", a_file], "--out", "a_file", "is a file")
    one_error(capsys, main, nowhere + ["--out", os.path.join(a_file, "sub")], "--out", "cannot be written")
    one_error(capsys, main, nowhere + ["--out", ""], "--out", "empty")
    for name in ("latest", "metrics.jsonl"):
        out = tmp_path / f"in_the_way_{name}"
        os.makedirs(out / name)
        one_error(capsys, main, nowhere + ["--out", str(out)], name, "in the way")
    for bad, needle in [(str(tmp_path), "is a directory"), (str(tmp_path / "new") + os.sep, "is a directory"),
                        (os.path.join(a_file, "r.json"), "cannot be written")]:
        one_error(capsys, ev.main, ["--target", str(tmp_path / "no_target"), "--json", bad], "--json", needle)


def test_devices_that_are_not_there(w, capsys, tmp_path):
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    bad = [missing, "tpu", "meta", "cuda:-1"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in bad:
        one_error(capsys, dflash.main, w["base"] + ["--out", str(tmp_path / "o"), "--device", device], "--device")
        one_error(capsys, ev.main, ["--target", w["q3"], "--device", device], "--device")


# -----------------------------------------------------------------------------
# Files the run reads, truncated or garbage

@pytest.mark.parametrize("how", CORRUPT)
def test_corrupt_drafter_safetensors_single(w, capsys, tmp_path, how):
    d = write_zlab_dir(str(tmp_path / "zl"), zlab_config(Z), zlab_tensors(Z))
    CORRUPT[how](os.path.join(d, "model.safetensors"))
    one_error(capsys, ev.main, ["--target", w["q3"], "--drafter", d], "model.safetensors", "corrupt")


@pytest.mark.parametrize("how", CORRUPT)
def test_corrupt_drafter_safetensors_sharded(tmp_path, how):
    d = write_zlab_dir(str(tmp_path / "zl"), zlab_config(Z), zlab_tensors(Z), shards=2)
    index, shard = os.path.join(d, "model.safetensors.index.json"), os.path.join(d, "model-00002-of-00002.safetensors")
    shutil.copy(shard, shard + ".good")
    CORRUPT[how](shard)
    raises_one_line(lambda: dflash.load_drafter(d), "model-00002-of-00002.safetensors", "corrupt")
    shutil.copy(shard + ".good", shard)
    shutil.copy(index, index + ".good")
    CORRUPT[how](index)
    raises_one_line(lambda: dflash.load_drafter(d), "model.safetensors.index.json", "corrupt")
    for bad in ([1, 2], {"weight_map": ["a"]}, {"weight_map": {"fc.weight": 3}}):
        with open(index, "w") as f:
            json.dump(bad, f)
        raises_one_line(lambda: dflash.load_drafter(d), "model.safetensors.index.json", "corrupt")
    with open(index, "w") as f:
        json.dump({"weight_map": {"fc.weight": "model-00009-of-00002.safetensors"}}, f)
    raises_one_line(lambda: dflash.load_drafter(d), "model-00009-of-00002.safetensors", "corrupt")
    shutil.copy(index + ".good", index)
    assert dflash.load_drafter(d).cfg.vocab_size == VOCAB


@pytest.mark.parametrize("how", CORRUPT)
def test_corrupt_config_json(w, capsys, tmp_path, how):
    d = write_zlab_dir(str(tmp_path / "zl"), zlab_config(Z), zlab_tensors(Z))
    CORRUPT[how](os.path.join(d, "config.json"))
    one_error(capsys, ev.main, ["--target", w["q3"], "--drafter", d], "config.json", "corrupt")
    t = str(tmp_path / "target")
    shutil.copytree(w["q3"], t)
    CORRUPT[how](os.path.join(t, "config.json"))
    one_error(capsys, ev.main, ["--target", t], "cannot load target", "config.json")


def test_config_json_with_nonsense_values(tmp_path):
    """Valid JSON, impossible values: one line naming the file and the field, never a traceback."""
    for over, field in [(dict(num_key_value_heads=0), "num_key_value_heads"), (dict(hidden_size=-4), "hidden_size"),
                        (dict(head_dim="8"), "head_dim"), (dict(head_dim=7), "head_dim"),
                        (dict(sliding_window=-3), "sliding_window"), (dict(rms_norm_eps=None), "rms_norm_eps"),
                        (dict(rope_theta="x"), "rope_theta"), (dict(layer_types=5), "layer_types"),
                        (dict(dflash_config={"mask_token_id": "x", "target_layer_ids": [1, 3]}), "mask_token_id"),
                        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": "13"}), "target_layer_ids")]:
        d = write_zlab_dir(str(tmp_path / field.replace(" ", "_")), zlab_config(Z, **over), {})
        raises_one_line(lambda: dflash.read_drafter_config(d), "config.json", field)


@pytest.mark.parametrize("how", CORRUPT)
def test_corrupt_target_safetensors(w, capsys, tmp_path, how):
    t = str(tmp_path / "target")
    shutil.copytree(w["q3"], t)
    CORRUPT[how](os.path.join(t, "model.safetensors"))
    one_error(capsys, ev.main, ["--target", t], "cannot load target", t, "deserializing")  # the library's line
    sharded = str(tmp_path / "sharded")
    build_qwen3().save_pretrained(sharded, max_shard_size="100KB")
    for name in ("model-00002-of-00002.safetensors", "model.safetensors.index.json"):
        shutil.copy(os.path.join(sharded, name), str(tmp_path / "good"))
        CORRUPT[how](os.path.join(sharded, name))
        one_error(capsys, ev.main, ["--target", sharded], "cannot load target", sharded, "deserializing" if
                  name.endswith(".safetensors") else "Expecting" if how == "truncated" else "can't decode")
        shutil.copy(str(tmp_path / "good"), os.path.join(sharded, name))


def test_corrupt_jsonl_lines(w, capsys, tmp_path):
    good = json.dumps({"input_ids": [1, 2, 3, 4]})
    truncated = write_lines(tmp_path / "trunc.jsonl", [good, good[:9]])
    one_error(capsys, dflash.main, with_data(w, truncated, tmp_path), "trunc.jsonl:2", "not valid JSON")
    one_error(capsys, ev.main, ["--target", w["q3"], "--prompts", truncated], "trunc.jsonl:2", "not valid JSON")
    garbled = tmp_path / "garbage.jsonl"
    garbled.write_bytes((good + "\n").encode() + b"\xff\xfe\x00\x93garbage\n")
    one_error(capsys, dflash.main, with_data(w, str(garbled), tmp_path), "garbage.jsonl:2", "not UTF-8")
    one_error(capsys, ev.main, ["--target", w["q3"], "--prompts", str(garbled)], "garbage.jsonl:2", "not UTF-8")


# -----------------------------------------------------------------------------
# --resume from a corrupt checkpoint names the previous complete one (checked before the target is loaded)

def resume_argv(w, out, tmp_path):
    argv = list(w["base"])
    argv[argv.index("--target") + 1] = str(tmp_path / "no_target")  # proves the check runs before any loading
    return argv + ["--out", out, "--resume"]


@pytest.mark.parametrize("how", CORRUPT)
def test_resume_from_corrupt_latest_names_the_previous_checkpoint(w, trained, capsys, tmp_path, how):
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    step1, step2, latest = (os.path.join(out, n) for n in ("step_1", "step_2", "latest"))
    assert dflash.complete_checkpoints(out) == [step2, step1]
    CORRUPT[how](os.path.join(step2, "train_state.pt"))
    one_error(capsys, dflash.main, resume_argv(w, out, tmp_path), step2, "train_state.pt", "corrupt",
              f"{step1} is complete: write step_1 into latest")
    assert dflash.complete_checkpoints(out) == [step1]
    shutil.copy(os.path.join(trained, "step_2", "train_state.pt"), os.path.join(step2, "train_state.pt"))
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(step2, name), os.path.join(tmp_path, name))
        CORRUPT[how](os.path.join(step2, name))
        one_error(capsys, dflash.main, resume_argv(w, out, tmp_path), step2, name, "write step_1 into latest")
        shutil.copy(os.path.join(tmp_path, name), os.path.join(step2, name))
    CORRUPT[how](latest)  # latest itself garbage
    one_error(capsys, dflash.main, resume_argv(w, out, tmp_path), latest, "corrupt", "write step_2 into latest")
    CORRUPT[how](os.path.join(step1, "train_state.pt"))
    CORRUPT[how](os.path.join(step2, "train_state.pt"))
    one_error(capsys, dflash.main, resume_argv(w, out, tmp_path), latest, "no complete checkpoint is left")


def test_resume_from_a_state_that_is_no_training_state(w, trained, capsys, tmp_path):
    """A train_state.pt that is a complete torch file but not a training state fails where it is read."""
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    torch.save({"something": torch.zeros(2)}, os.path.join(out, "step_2", "train_state.pt"))
    one_error(capsys, dflash.main, w["base"] + ["--out", out, "--resume"], "train_state.pt", "not a training state",
              "write step_1 into latest")


# -----------------------------------------------------------------------------
# Token ids against the target's vocabulary, wherever they enter

def test_token_ids_outside_the_vocabulary(w, capsys, tmp_path):
    good = json.dumps({"input_ids": [1, 2, 3, 4]})
    for bad_id in (VOCAB, -1, 10**12):
        path = write_lines(tmp_path / "ids.jsonl", [good, json.dumps({"input_ids": [5, bad_id, 6, 7]})])
        one_error(capsys, dflash.main, with_data(w, path, tmp_path), "ids.jsonl:2", f"token id {bad_id}",
                  f"[0, {VOCAB})")
        raises_one_line(lambda: ev.load_prompts(path, None, vocab_size=VOCAB), "ids.jsonl:2", f"token id {bad_id}")
        one_error(capsys, ev.main, ["--target", w["q3"], "--prompts", path], "ids.jsonl:2", f"token id {bad_id}")
    for junk in ([1, "2"], [1.0], [True], "12", []):
        raises_one_line(lambda: ev.encode_prompt({"input_ids": junk}, None, "p.jsonl:1", vocab_size=VOCAB),
                        "p.jsonl:1", "input_ids")
    assert ev.encode_prompt({"input_ids": [0, VOCAB - 1]}, None, "p", vocab_size=VOCAB) == [0, VOCAB - 1]


# -----------------------------------------------------------------------------
# Paths that are not there, data with nothing to learn

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


# -----------------------------------------------------------------------------
# Drafter geometry that does not fit the target, and drafters made for another one

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
    # fine-tuning from a drafter directory (ours or z-lab's) keeps its geometry and trains on; a geometry flag that
    # differs from it is refused, not ignored
    tuned = str(tmp_path / "tuned")
    fails_with(capsys, replace(w["base"], "--block_size", "3") + ["--out", tuned, "--init_from", drafter],
               "--block_size 3", "--init_from")
    dflash.main(w["base"] + ["--out", tuned, "--init_from", drafter])
    assert dflash.read_drafter_config(os.path.join(tuned, "step_2")) == dflash.read_drafter_config(drafter)
    before, after = dflash.load_drafter(drafter), dflash.load_drafter(os.path.join(tuned, "step_2"))
    assert not torch.equal(before.fc.weight, after.fc.weight)
    # resuming with another drafter geometry is refused, naming the field
    fails_with(capsys, replace(w["base"], "--block_size", "3") + ["--out", out, "--resume"], "block_size", "cannot resume")


# -----------------------------------------------------------------------------
# The one line is all a user sees, and numerical faults never reach the weights

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


# -----------------------------------------------------------------------------
# Faults of a long run: outputs that cannot be written, a used --out, lost ranks and torchrun restarts, resume across
# a change of ranks, --zero or data, a full disk during a checkpoint, repeated signals, input files of the wrong kind

def latest_name(out):
    with open(os.path.join(out, "latest")) as f:
        return f.read().strip()


def test_every_output_is_proven_before_the_target_loads(w, capsys, tmp_path, monkeypatch):
    """--out (checkpoint directories, latest, metrics.jsonl), eval.py --json and the demo's outputs: each location is
    created and a temp file (and, for --out, a directory) made and removed in it before any weights load. A path below
    a regular file cannot be created even as root; a refused mkstemp/mkdtemp stands for a read-only directory."""
    from dflash_tools import demo
    nowhere = str(tmp_path / "no_target")  # no target there: the error must come before it is loaded
    a_file = write_lines(tmp_path / "a_file", ["x"])
    train = ["--target", nowhere, "--data", w["data"]]
    one_error(capsys, dflash.main, train + ["--out", os.path.join(a_file, "run", "deep")], "--out", "cannot be written",
              "Not a directory")
    one_error(capsys, ev.main, ["--target", nowhere, "--json", os.path.join(a_file, "new", "r.json")], "--json",
              "cannot be written", "Not a directory")
    one_error(capsys, demo.main, ["--out", os.path.join(a_file, "demo")], "--out", "cannot be written")
    monkeypatch.setattr(demo, "CACHE", os.path.join(a_file, ".cache"))  # the demo's cache cannot be created
    one_error(capsys, demo.main, ["--out", str(tmp_path / "demo_out")], "demo's cache", "cannot be written")
    monkeypatch.undo()
    # a location that can be created is created (with its parents) and left empty
    fresh_out, fresh_json = tmp_path / "a" / "b" / "run", tmp_path / "c" / "d" / "r.json"
    one_error(capsys, dflash.main, train + ["--out", str(fresh_out)], "no_target")
    one_error(capsys, ev.main, ["--target", nowhere, "--json", str(fresh_json)], "no_target")
    assert os.listdir(fresh_out) == [] and os.listdir(fresh_json.parent) == []
    # a directory that refuses files, or refuses directories (a checkpoint), fails by the operation that is refused
    for name in ("mkstemp", "mkdtemp"):
        def refused(*a, **k):
            raise PermissionError(13, "Permission denied", k.get("dir"))
        monkeypatch.setattr(dflash.tempfile, name, refused)
        one_error(capsys, dflash.main, train + ["--out", str(fresh_out)], "--out", "cannot be written",
                  "Permission denied", str(fresh_out))
        if name == "mkstemp":
            one_error(capsys, ev.main, ["--target", nowhere, "--json", str(fresh_json)], "--json",
                      "cannot be written", "Permission denied")
        monkeypatch.undo()
    # metrics.jsonl is appended to: a metrics.jsonl that cannot be opened for appending is refused up front
    real_open, metrics = open, str(write_lines(fresh_out / "metrics.jsonl", []))

    def read_only(f, mode="r", *a, **k):
        if f == metrics and mode == "a":
            raise PermissionError(13, "Permission denied", f)
        return real_open(f, mode, *a, **k)
    monkeypatch.setattr("builtins.open", read_only)
    one_error(capsys, dflash.main, train + ["--out", str(fresh_out)], "metrics.jsonl", "cannot be appended")


def test_a_used_out_is_never_clobbered(w, trained, capsys, tmp_path, monkeypatch):
    """Without --resume, an --out holding a run is refused in one line (its latest step, --resume, a new --out) and
    nothing in it changes; --resume auto continues it, and so does a worker torchrun restarted."""
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    before = tree_bytes(out)
    argv = replace(w["base"], "--target", str(tmp_path / "no_target")) + ["--out", out]
    one_error(capsys, dflash.main, argv, "already holds a run", "step 2", "--resume", "new --out")
    only_metrics = tmp_path / "only_metrics"  # a run stopped before its first checkpoint is a run too
    os.makedirs(only_metrics)
    shutil.copy(os.path.join(out, "metrics.jsonl"), only_metrics)
    one_error(capsys, dflash.main, argv[:-1] + [str(only_metrics)], "already holds a run", "without a complete")
    assert tree_bytes(out) == before
    # --resume auto: continues from latest (one more step), and starts afresh where there is none
    dflash.main(w["base"] + ["--out", out, "--resume", "auto", "--max_steps", "3"])
    assert "resumed from" in capsys.readouterr().out and latest_name(out) == "step_3"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2, 3]  # no step logged twice
    fresh = str(tmp_path / "fresh")
    dflash.main(w["base"] + ["--out", fresh, "--resume", "auto"])
    assert "resumed" not in capsys.readouterr().out and latest_name(fresh) == "step_2"
    # a restarted torchrun worker (TORCHELASTIC_RESTART_COUNT > 0) resumes without being told; the first start does not
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    one_error(capsys, dflash.main, argv, "already holds a run")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    dflash.main(w["base"] + ["--out", out, "--max_steps", "4"])
    assert f"resumed from {os.path.join(out, 'step_3')} at step 3" in capsys.readouterr().out
    assert latest_name(out) == "step_4"


def test_resume_refuses_changed_data_and_order_flags(w, trained, capsys, tmp_path):
    """The checkpoint records the data file's size and sha256: edited since, the resume is refused in one line naming
    --allow_data_change (before the target loads), and with it the run continues; a changed --seed or global batch
    is refused too (the data order depends on both)."""
    out, data = str(tmp_path / "run"), str(tmp_path / "data.jsonl")
    shutil.copytree(trained, out)
    shutil.copy(w["data"], data)  # the same bytes as the run was trained on: it resumes
    assert torch.load(os.path.join(out, "step_2", "train_state.pt"), weights_only=True)["data"] == \
        dflash.path_digest(data)
    with open(data, "a") as f:
        f.write(json.dumps({"input_ids": [1, 2, 3, 4, 5]}) + "\n")
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:  # logged after the last checkpoint (then killed)
        f.write(json.dumps({"step": 3, "loss": 1.0}) + "\n")
    before = tree_bytes(out)  # a refused resume leaves all of it, the log too
    resume = replace(replace(w["base"], "--data", data), "--target", str(tmp_path / "no_target")) + \
        ["--out", out, "--resume"]
    one_error(capsys, dflash.main, resume, "cannot resume", "step_2", data, "changed", "--allow_data_change")
    one_error(capsys, dflash.main, replace(w["base"], "--target", str(tmp_path / "no_target")) +
              ["--out", out, "--resume", "--seed", "7"], "cannot resume", "--seed 0", "--seed 7")
    fails_with(capsys, replace(w["base"], "--batch_size", "4") + ["--out", out, "--resume"], "cannot resume",
               "global batch was 2, now 4", "batch_size x grad_accum x ranks")  # another global batch: refused
    assert tree_bytes(out) == before
    dflash.main(replace(w["base"], "--data", data) + ["--out", out, "--resume", "--allow_data_change",
                                                      "--max_steps", "3"])
    assert latest_name(out) == "step_3"


@pytest.mark.parametrize("writer", ["safetensors", "torch.save"])
def test_disk_full_during_a_checkpoint(w, capsys, tmp_path, monkeypatch, writer):
    """ENOSPC while the second checkpoint is written: one line naming it and the last complete one, latest unchanged,
    nothing partial left (no step_2, no step_2.tmp<pid>), and step_1 resumes."""
    import safetensors.torch
    module, name = (safetensors.torch, "save_file") if writer == "safetensors" else (torch, "save")
    real, calls = getattr(module, name), []

    def full_disk(obj, path, *a, **k):
        calls.append(path)
        if len(calls) == 2:
            with open(path, "wb") as f:  # half a file, then the disk is full
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(obj, path, *a, **k)
    monkeypatch.setattr(module, name, full_disk)
    out = str(tmp_path / "run")
    fails_with(capsys, w["base"] + ["--out", out, "--save_every", "1", "--max_steps", "3"], "cannot write checkpoint",
               os.path.join(out, "step_2"), "No space left",
               f"the last complete checkpoint is {os.path.join(out, 'step_1')}")
    monkeypatch.undo()
    assert latest_name(out) == "step_1"
    assert sorted(os.listdir(out)) == ["latest", "metrics.jsonl", "step_1"]
    assert dflash.checkpoint_problem(os.path.join(out, "step_1")) is None


def test_disk_full_writing_the_json_report(tmp_path, monkeypatch):
    """eval.py's report (after the work, so proven writable first): a full disk is still one line, no partial file."""
    path = str(tmp_path / "r.json")

    def full_disk(fd):  # the bytes are written, the disk cannot take them
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "fsync", full_disk)
    raises_one_line(lambda: ev.write_json({"results": []}, path), "cannot write", path, "No space left")
    assert os.listdir(tmp_path) == []


def test_a_second_signal_still_saves_a_third_abandons(w, capsys, tmp_path, monkeypatch):
    """Two signals during a step: it finishes and its checkpoint is written (the console says so). A third, during
    that save: the save is abandoned (nothing partial left), latest keeps the last complete checkpoint, named."""
    import safetensors.torch
    real_step, real_save = dflash.train_step, safetensors.torch.save_file
    plan = {}

    def step(*a, **k):  # the signals arrive in the middle of step 2
        plan["n"] = plan.get("n", 0) + 1
        if plan["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*a, **k)

    def save(*a, **k):
        if plan.get("third") and plan["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real_save(*a, **k)
    monkeypatch.setattr(dflash, "train_step", step)
    monkeypatch.setattr(safetensors.torch, "save_file", save)
    out = str(tmp_path / "two")
    with pytest.raises(SystemExit) as e:  # interrupted: not done, 128 + the first signal, after the checkpoint
        dflash.main(w["base"] + ["--out", out, "--max_steps", "5", "--save_every", "1"])
    assert e.value.code == 128 + signal.SIGINT
    text = capsys.readouterr().out
    assert "SIGINT: finishing this step, then saving" in text
    assert "second signal (SIGTERM): still saving after this step; a third abandons it" in text
    assert f"interrupted after step 2: saved {os.path.join(out, 'step_2')}" in text
    assert latest_name(out) == "step_2" and dflash.checkpoint_problem(os.path.join(out, "step_2")) is None
    plan.clear()
    plan["third"] = True
    out = str(tmp_path / "three")
    with pytest.raises(SystemExit) as e:
        dflash.main(w["base"] + ["--out", out, "--max_steps", "5", "--save_every", "1"])
    assert e.value.code == 128 + signal.SIGINT
    text = capsys.readouterr().out
    assert f"third signal (SIGINT): abandoning the checkpoint; the last complete checkpoint is " \
           f"{os.path.join(out, 'step_1')}" in text
    assert latest_name(out) == "step_1" and sorted(os.listdir(out)) == ["latest", "metrics.jsonl", "step_1"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are given back


def test_the_demo_reruns_in_its_own_out_and_refuses_another_used_out(w, capsys, tmp_path, monkeypatch):
    """The demo's own out/demo starts over on a rerun (saying so); an --out given to it obeys the rule of dflash.py.
    The tiny target and its data are stood in for by the test's (the demo's flow, not its numbers, is checked)."""
    from dflash_tools import demo, tiny_target
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tiny_target, "build_tiny_target", lambda *a, **k: w["q3"])
    monkeypatch.setattr(tiny_target, "make_regenerated_data", lambda *a, **k: w["data"])
    monkeypatch.setattr(tiny_target, "heldout_prompts", lambda *a, **k: [[5, 6, 7, 8]])
    monkeypatch.setattr(demo, "check_walked_tau", lambda *a: None)
    quick = ["--demo", "--max_steps", "2", "--batch_size", "2", "--mask_token_id", str(VOCAB - 1),
             "--target_layer_ids", "1,2", "--eval_fraction", "0", "--eval_walk_prompts", "0"]
    demo.main(quick)
    first = tree_bytes(demo.DEMO_OUT)
    assert "demo_eval.json" in first and latest_name(demo.DEMO_OUT) == "step_2"
    demo.main(quick)
    assert f"removing the previous demo run in {demo.DEMO_OUT}" in capsys.readouterr().out
    assert sorted(tree_bytes(demo.DEMO_OUT)) == sorted(first)
    kept = str(tmp_path / "kept")
    shutil.copytree(demo.DEMO_OUT, kept)
    one_error(capsys, demo.main, quick + ["--out", kept], "already holds a run", "--resume")


def test_gzip_and_binary_input_files(w, capsys, tmp_path):
    """Where JSONL is read (--data, --prompts, --bench NAME=FILE): gzip is read transparently, anything else binary
    is one line naming the file."""
    import gzip

    from dflash_tools import benchmarks
    rows = [{"prompt": "def add(a, b):\n", "task_id": "HumanEval/0"}, {"prompt": "def sub(a, b):\n"}]
    plain = write_lines(tmp_path / "HumanEval.jsonl", [json.dumps(r) for r in rows])
    packed = str(tmp_path / "HumanEval.jsonl.gz")
    with open(plain, "rb") as f, gzip.open(packed, "wb") as g:
        g.write(f.read())
    assert benchmarks.read_local(packed) == benchmarks.read_local(plain) == rows
    assert ev.load_bench(f"humaneval={packed}", None, None) == ev.load_bench(f"humaneval={plain}", None, None)
    binary, bad_gz = tmp_path / "bin.jsonl", tmp_path / "bad.jsonl.gz"
    binary.write_bytes(b"\x93\xff\x00\x01" * 64)
    bad_gz.write_bytes(open(packed, "rb").read()[:30] + b"\x00garbage" * 8)
    for path in (binary, bad_gz):
        one_error(capsys, ev.main, ["--target", str(tmp_path / "no_target"), "--bench", f"humaneval={path}"],
                  str(path), "not a JSONL/JSON text file")
    prompts = str(tmp_path / "prompts.jsonl.gz")
    with gzip.open(prompts, "wt") as g:
        g.write(json.dumps({"input_ids": [1, 2, 3]}) + "\n" + json.dumps({"input_ids": [4, 5]}) + "\n")
    assert ev.load_prompts(prompts, None, vocab_size=VOCAB) == [[1, 2, 3], [4, 5]]
    one_error(capsys, ev.main, ["--target", w["q3"], "--prompts", str(bad_gz)], "bad.jsonl.gz", "cannot read")
    one_error(capsys, ev.main, ["--target", w["q3"], "--prompts", str(binary)], "bin.jsonl:1", "not UTF-8")
    gz_data = str(tmp_path / "data.jsonl.gz")
    with open(w["data"], "rb") as f, gzip.open(gz_data, "wb") as g:
        g.write(f.read())
    fails_with(capsys, replace(w["base"], "--data", str(bad_gz)) + ["--out", str(tmp_path / "o")], "bad.jsonl.gz")
    dflash.main(replace(w["base"], "--data", gz_data) + ["--out", str(tmp_path / "gz")])
    assert latest_name(str(tmp_path / "gz")) == "step_2"


# torchrun on 2 gloo ranks: a rank lost and restarted, a resume onto other ranks with --zero, SIGTERM

def torchrun(argv, *launcher):
    port = str(29500 + random.randrange(1000))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", port, *launcher,
           os.path.join(ROOT, "dflash.py"), *argv]
    return subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(p, timeout=180):
    """torchrun's (stdout, stderr) once it exits; a hang is killed and fails the test with what it printed."""
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        stdout, stderr = p.communicate()
        pytest.fail(f"torchrun still running after {timeout} s\n--- stdout\n{stdout[-3000:]}\n--- stderr\n"
                    f"{stderr[-6000:]}")


def logged_steps(out):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(x)["step"] for x in f if '"loss"' in x]
    except (OSError, ValueError):  # not there yet, or a line being written
        return []


def wait_for(cond, what, timeout=300):
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def workers(p):
    """{RANK: pid} of the worker processes torchrun (process p) started."""
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        pids = [int(c) for c in f.read().split()]
    ranks = {}
    for pid in pids:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        ranks[int(env[b"RANK"])] = pid
    return ranks


def same_weights(a, b):
    wa, wb = (load_file(os.path.join(d, latest_name(d), "model.safetensors")) for d in (a, b))
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def reference(w):
    """An uninterrupted run of 8 steps on one process, global batch 4 (2 x grad_accum 2), a checkpoint every 2."""
    out = str(w["dir"] / "reference")
    dflash.main(replace(replace(w["base"], "--max_steps", "8"), "--grad_accum", "2") + ["--out", out,
                                                                                           "--save_every", "2"])
    return out


TWO_RANKS = ["--max_steps", "8", "--batch_size", "2", "--grad_accum", "1", "--zero"]  # global batch 4 again


def test_torchrun_restart_after_a_lost_rank_resumes_by_itself(w, reference, tmp_path):
    """torchrun --max_restarts=1: rank 1 SIGKILLed after a checkpoint; torchrun restarts both workers, which resume
    from latest by themselves (TORCHELASTIC_RESTART_COUNT); the job finishes with the uninterrupted run's weights."""
    out = str(tmp_path / "elastic")
    # one restart allowed, in torchrun's default (static) rendezvous, whose store outlives the killed workers:
    # without keys of its own (setup_distributed) the restart failed or hung in gloo's connect in 6 of 6 tries
    p = torchrun(w["base"] + TWO_RANKS + ["--out", out, "--save_every", "2"], "--max_restarts=1")
    wait_for(lambda: os.path.exists(os.path.join(out, "latest")), "the first checkpoint")
    reached = max(logged_steps(out), default=0)
    os.kill(workers(p)[1], signal.SIGKILL)
    stdout, stderr = finish(p)
    assert p.returncode == 0, stderr[-3000:]
    resumed = re.search(r"resumed from \S+step_(\d+) at step", stdout)
    assert resumed and reached - int(resumed[1]) <= 2, (reached, stdout[-2000:])  # at most one --save_every lost
    assert latest_name(out) == "step_8" and logged_steps(out) == list(range(1, 9))
    assert same_weights(out, reference) <= 1e-6


def test_resume_onto_other_ranks_with_zero_then_sigterm(w, reference, tmp_path):
    """The same global batch on other ranks, --zero toggled, resumes exactly: the one-process checkpoint continues on
    2 ranks with --zero, SIGTERM stops them cleanly (the last line says what was saved), and
    that checkpoint continues on one process without --zero to the uninterrupted run's weights. The workers exit
    143 (interrupted, not done), so torchrun reports them failed."""
    out = str(tmp_path / "moved")
    shutil.copytree(os.path.join(reference, "step_2"), os.path.join(out, "step_2"))
    dflash.write_atomic(os.path.join(out, "latest"), "step_2\n")
    p = torchrun(w["base"] + TWO_RANKS + ["--out", out, "--resume"])
    wait_for(lambda: logged_steps(out), "a step on 2 ranks")
    for pid in workers(p).values():  # as a cluster scheduler does: every worker gets SIGTERM
        os.kill(pid, signal.SIGTERM)
    stdout, stderr = finish(p)
    assert p.returncode != 0 and not re.search(r'File ".*dflash\.py"', stderr), stderr[-3000:]
    stopped = step_of_latest = int(latest_name(out).split("_")[1])
    assert 3 <= stopped < 8, "the interruption should land mid-run"
    assert stdout.strip().splitlines()[-1] == f"interrupted after step {step_of_latest}: saved " \
        f"{os.path.join(out, f'step_{stopped}')}; resume with the same command plus --resume"
    dflash.main(replace(w["base"], "--max_steps", "8") + ["--out", out, "--resume", "--batch_size", "4"])
    assert same_weights(out, reference) <= 1e-6
