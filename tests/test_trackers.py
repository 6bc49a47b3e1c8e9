"""--report_to tensorboard,wandb: every metrics.jsonl record reaches the trackers under the same names at the same
steps, read back through TensorBoard's own reader and W&B's local (offline) run files; a resumed run continues the
same curves with no step missing or twice; a missing package is one error line before any weights load."""
import glob
import json
import os
import struct
import sys

import pytest
import torch

import dflash
from dflash_tools import trackers
from conftest import SMALL, tiny_qwen3, torch_threads, write_data

# a tiny run with held-out evaluations (the walked tau included) every 2 steps
FLAGS = [*SMALL[:-6], "--eval_every", "2", "--save_every", "0", "--eval_fraction", "0.2", "--eval_walk_prompts", "4",
         "--eval_walk_tokens", "8", "--eval_walk_tree_budget", "4", "--batch_size", "4", "--grad_accum", "1"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trackers")
    return {"q3": tiny_qwen3(d / "q3"), "data": write_data(d / "data.jsonl", 40)}


def train(workdir, out, *flags):
    with torch_threads(1):
        dflash.main(["--target", workdir["q3"], "--data", workdir["data"], *FLAGS, "--out", str(out), *flags])


def metrics(out):
    """{name: {step: value}} of metrics.jsonl, under the names the trackers get (lists as name/k)."""
    curves = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for r in map(json.loads, f):
            for k, v in trackers.scalars(r).items():
                assert r["step"] not in curves.setdefault(k, {}), (k, r["step"])  # metrics.jsonl: each step once
                curves[k][r["step"]] = v
    return curves


def tensorboard_curves(out):
    """{tag: [(step, value)]} through TensorBoard's own reader (purged events dropped as TensorBoard drops them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The records of a W&B run file (run-<id>.wandb): W&B's LevelDB-style log of 32 KiB blocks, each record a
    7-byte header (crc32, length, kind: full | first | middle | last) and a piece of a serialized Record proto."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        data = f.read()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0)
    pos, piece, out = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        piece = data[pos + 7:pos + 7 + n] if kind in (1, 2) else piece + data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(piece)
            out.append(r)
    return out


def wandb_runs(out):
    """[(run id, config, {name: {step: value}})] of each offline W&B run directory under out, oldest first."""
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))):
        run_id, config, curves = None, {}, {}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
            elif kind == "history":  # one row per step: its values under their names (_step, _runtime: W&B's)
                row = {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                for k, v in row.items():
                    if not k.startswith("_"):
                        assert r.history.step.num not in curves.setdefault(k, {})
                        curves[k][r.history.step.num] = v
        runs.append((run_id, config, curves))
    return runs


def test_tensorboard_and_wandb_get_every_record_and_resume_continues(workdir, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")  # in requirements.txt's optional extras: CI has both
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(workdir, out, "--max_steps", "4", "--report_to", "tensorboard,wandb")
    train(workdir, out, "--max_steps", "8", "--report_to", "tensorboard", "--report_to", "wandb", "--resume")
    want = metrics(out)
    assert set(want["loss"]) == set(range(1, 9)) and set(want["eval_walk_tau"]) == {0, 2, 4, 6, 8}
    assert {"tau", "lr", "tokens_per_s", "peak_mb", "acc/1", "acc/3", "eval_loss", "eval_tau", "eval_acc/1",
            "eval_walk_tree_tau", "eval_walk_acceptance/3"} <= set(want)

    tb = tensorboard_curves(out)
    assert set(tb) == set(want)
    for k, curve in want.items():  # each step once, in order, with the value metrics.jsonl has
        assert [s for s, _ in tb[k]] == sorted(curve), k
        assert [v for _, v in tb[k]] == pytest.approx([curve[s] for s in sorted(curve)], rel=1e-6), k

    runs = wandb_runs(out)
    state = torch.load(out / "step_8" / "train_state.pt", weights_only=True)
    assert len(runs) == 2 and {r[0] for r in runs} == {state["wandb_id"]}  # the resumed run continues the same run
    first, second = runs[0][2], runs[1][2]
    assert max(first["loss"]) == 4 and min(second["loss"]) == 5
    for k, curve in want.items():
        logged = {**first.get(k, {}), **second.get(k, {})}
        assert not set(first.get(k, {})) & set(second.get(k, {})), k  # no step logged twice
        assert logged == pytest.approx(curve), k
    config = runs[0][1]
    saved = dflash.read_drafter_config(str(out / "step_8"))  # the run's config: its flags and drafter config
    assert config["args"]["max_steps"] == 4 and config["args"]["report_to"] == [["tensorboard", "wandb"]]
    assert config["drafter"]["target_layer_ids"] == saved.target_layer_ids
    assert config["drafter"]["block_size"] == saved.block_size == 4


def test_tensorboard_resume_after_a_crash_logs_each_step_once(workdir, tmp_path):
    """Killed after its step-2 checkpoint, a run had logged steps 3 and 4 already; the resumed run logs them again,
    and TensorBoard keeps only the new ones."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "crashed"
    train(workdir, out, "--max_steps", "4", "--save_every", "2", "--report_to", "tensorboard")
    dflash.shutil.rmtree(out / "step_4")  # as if killed before the final checkpoint
    (out / "latest").write_text("step_2\n")
    train(workdir, out, "--max_steps", "5", "--save_every", "2", "--report_to", "tensorboard", "--resume")
    want, tb = metrics(out), tensorboard_curves(out)
    assert set(want["loss"]) == set(range(1, 6))
    for k, curve in want.items():
        assert [s for s, _ in tb[k]] == sorted(curve), k
        assert [v for _, v in tb[k]] == pytest.approx([curve[s] for s in sorted(curve)], rel=1e-6), k


def test_missing_tracker_package_is_one_line_before_any_weights_load(workdir, tmp_path, monkeypatch, capsys):
    def no_loading(*a, **k):
        raise AssertionError("a target was loaded")
    monkeypatch.setattr(dflash, "load_target", no_loading)
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    for name in ("wandb", "tensorboard"):
        with pytest.raises(SystemExit):
            train(workdir, tmp_path / name, "--max_steps", "1", "--report_to", f"none,{name}")
        assert capsys.readouterr().err == f"error: --report_to {name} needs the {name} package: pip install {name}\n"
    with pytest.raises(SystemExit):
        train(workdir, tmp_path / "x", "--report_to", "mlflow")
    assert "expected none, tensorboard or wandb" in capsys.readouterr().err
