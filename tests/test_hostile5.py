"""Rounds four and five of hostile use (issue 48): a race that lost a run, a resume that mixed two runs, and what
long runs meet (damaged checkpoint files, signals at start-up, during the final save and SIGHUP, the files of killed
writes). Every refusal is one `error:` line, exit 2, naming the problem and the fix; a resume never mixes two runs."""
import json
import os
import shutil
import signal
import subprocess
import sys
import types

import pytest
import torch

import dflash
import eval as ev
from conftest import ROOT, fails_with, refused, tree_bytes, write_data, write_lines

pytestmark = pytest.mark.usefixtures("one_thread_module")


def copy_run(trained, tmp_path, name="run"):
    out = str(tmp_path / name)
    shutil.copytree(trained, out)
    return out


def metrics_steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x)["step"] for x in f if x.strip()]


def dead_pid():
    """The pid of a process that has ended."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -----------------------------------------------------------------------------
# 1. Two runs on one new --out: the lock is held from the first check that writes, whether or not --out existed

SECOND = r"""
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
import dflash
print("ready", flush=True)
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            dflash.main(json.loads(line))
            code = 0
        except SystemExit as e:
            code = e.code
    print(json.dumps({"code": code, "err": err.getvalue()}), flush=True)
"""


def test_a_second_run_on_one_new_out_is_refused_whenever_it_arrives(w, tmp_path, monkeypatch):
    """A second process starting the same run while the first checks a new --out (it did not exist: no lock was
    taken until after the checks, so both trained and wrote over each other), while the first trains, and after it
    ended: refused every time, the first run's files its own."""
    out = str(tmp_path / "new" / "o")
    argv = w["base"] + ["--out", out]
    second = subprocess.Popen([sys.executable, "-c", SECOND, ROOT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    seen = []

    def arrive(*_):  # the second process runs the same command now, to its end
        second.stdin.write(json.dumps(argv) + "\n")
        second.stdin.flush()
        seen.append(json.loads(second.stdout.readline()))

    real_check, real_step = dflash.check_out_dir, dflash.train_step
    monkeypatch.setattr(dflash, "check_out_dir", lambda *a: (arrive(), real_check(*a))[1])
    monkeypatch.setattr(dflash, "train_step", lambda *a, **k: (len(seen) < 2 and arrive(), real_step(*a, **k))[1])
    try:
        assert second.stdout.readline().strip() == "ready"
        assert not os.path.exists(out)
        dflash.main(argv)
        arrive()
    finally:
        second.stdin.close()
        second.wait(timeout=60)
    assert [r["code"] for r in seen] == [2, 2, 2], seen
    for r in seen[:2]:
        assert r["err"].count("error:") == 1 and "locked by another run" in r["err"], r["err"]
    assert "already holds a run" in seen[2]["err"], seen[2]["err"]
    assert metrics_steps(out) == [1, 2]
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"


# -----------------------------------------------------------------------------
# 2. A record whose response --max_len cuts away entirely: the note says so, and by how much

def test_skip_note_names_max_len_and_the_excess(tmp_path):
    long = write_data(tmp_path / "long.jsonl", 2, prompt=10, response=6)  # 16 tokens, the response from 10
    short = write_lines(tmp_path / "short.jsonl", [json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]})])
    mixed = write_lines(tmp_path / "mixed.jsonl", open(long).read().splitlines() + open(short).read().splitlines() +
                        [json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]})])
    said = []
    assert len(dflash.load_samples(mixed, None, 8, say=said.append)) == 1
    assert len(said) == 1 and "skipped 3" in said[0], said
    assert "2 whose response --max_len 8 cut away (up to 8 tokens over it" in said[0], said
    assert "1 with fewer than 2 response tokens" in said[0], said
    msg = refused(lambda: dflash.load_samples(long, None, 8), "no usable samples", "--max_len 8", "8 tokens over it")
    assert "fewer than 2" not in msg, msg
    msg = refused(lambda: dflash.load_samples(short, None, 8), "1 with fewer than 2 response tokens")
    assert "--max_len" not in msg, msg


# -----------------------------------------------------------------------------
# 3. --out inside a save_to_disk data directory: its checkpoints would change the data's digest

@pytest.mark.parametrize("flag", ["--data", "--eval_data"])
def test_out_inside_a_data_directory_is_refused_before_it_is_made(w, capsys, tmp_path, flag):
    import datasets
    ds = str(tmp_path / "ds")
    rows = [json.loads(x) for x in open(write_data(tmp_path / "d.jsonl", 40, seed=3))]
    datasets.Dataset.from_list(rows).save_to_disk(ds)
    before = tree_bytes(ds)
    argv = w["base"] + ["--out", os.path.join(ds, "run"), flag, ds]
    fails_with(capsys, argv, f"--out {os.path.join(ds, 'run')} is inside {flag} {ds}", "outside it")
    assert tree_bytes(ds) == before and not os.path.exists(os.path.join(ds, "run"))


# -----------------------------------------------------------------------------
# 4. A tracker's directory that cannot be written: one line before any weights load (each tracker)

def no_weights(monkeypatch):
    real = dflash.load_target
    monkeypatch.setattr(dflash, "load_target", lambda name, device="cpu", *a, **k: (
        pytest.fail("weights loaded") if device != "meta" else real(name, device, *a, **k)))


def test_tensorboard_directory_that_cannot_be_written(w, capsys, tmp_path, monkeypatch):
    """OUT/tensorboard unwritable (a link into /proc: unwritable even for root) ended in 'Exception in thread' from
    TensorBoard's writer thread, a traceback: refused before the writer starts."""
    from torch.utils import tensorboard
    monkeypatch.setattr(tensorboard, "SummaryWriter", lambda *a, **k: pytest.fail("the writer started"))
    out = tmp_path / "o"
    out.mkdir()
    os.symlink("/proc/1", out / "tensorboard")
    no_weights(monkeypatch)
    fails_with(capsys, w["base"] + ["--out", str(out), "--report_to", "tensorboard"],
               f"--report_to tensorboard: {out / 'tensorboard'} cannot be written", "give another --out")


def test_wandb_directory_that_cannot_be_written(w, capsys, tmp_path, monkeypatch):
    """The same for W&B's OUT/wandb (the package stood in for: wandb.init must not even be reached)."""
    fake = types.ModuleType("wandb")
    fake.init = lambda **k: pytest.fail("wandb.init reached")
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "o"
    out.mkdir()
    os.symlink("/proc/1", out / "wandb")
    no_weights(monkeypatch)
    fails_with(capsys, w["base"] + ["--out", str(out), "--report_to", "wandb"],
               f"--report_to wandb: {out / 'wandb'} cannot be written")


# -----------------------------------------------------------------------------
# 5, 6. latest naming a deleted or corrupt step, or a checkpoint outside --out

def break_step_2(out, how):
    step2 = os.path.join(out, "step_2")
    if how == "deleted":
        shutil.rmtree(step2)
    elif how == "config":
        open(os.path.join(step2, "config.json"), "w").write("{")
    else:
        open(os.path.join(step2, "model.safetensors"), "wb").write(b"\0" * 10)


@pytest.mark.parametrize("how", ["deleted", "config", "weights"])
def test_latest_naming_a_lost_step_continues_the_newest_complete_one(w, trained, capsys, tmp_path, how):
    """--resume auto refused ("write the name of a complete step_N directory") without naming one: it continues the
    newest complete step_N and says so; plain --resume refuses naming it."""
    out = copy_run(trained, tmp_path)
    break_step_2(out, how)
    step1 = os.path.join(out, "step_1")
    fails_with(capsys, w["base"] + ["--out", out, "--resume"], os.path.join(out, "step_2"),
               f"{step1} is complete: write step_1 into latest", "--resume auto")
    dflash.main(w["base"] + ["--out", out, "--resume", "auto"])
    said = capsys.readouterr().out
    assert f"continuing {step1}, the newest complete one" in said, said
    assert f"resumed from {step1} at step 1" in said, said
    assert metrics_steps(out) == [1, 2] and open(os.path.join(out, "latest")).read().strip() == "step_2"


@pytest.mark.parametrize("name", ["../other/step_2", "ABS", "step_2/../../other/step_2", "./step_2", "step_2/"])
def test_latest_naming_a_checkpoint_outside_out_is_never_followed(w, trained, capsys, tmp_path, name):
    """latest naming another run's checkpoint (relative or absolute) was followed: that run's weights, optimizer and
    step continued in this --out. Only a bare step_N of this --out is read; auto continues this --out's own."""
    other = copy_run(trained, tmp_path, "other")
    before = tree_bytes(other)
    out = copy_run(trained, tmp_path)
    shutil.rmtree(os.path.join(out, "step_2"))
    with open(os.path.join(out, "latest"), "w") as f:
        f.write((os.path.join(other, "step_2") if name == "ABS" else name) + "\n")
    step1 = os.path.join(out, "step_1")
    fails_with(capsys, w["base"] + ["--out", out, "--resume"], os.path.join(out, "latest"), "no step_N directory",
               f"{step1} is complete")
    dflash.main(w["base"] + ["--out", out, "--resume", "auto"])
    assert f"resumed from {step1} at step 1" in capsys.readouterr().out
    assert tree_bytes(other) == before


# -----------------------------------------------------------------------------
# 7. A damaged train_state.pt: one line naming the checkpoint, where it is read

DAMAGE = {
    "step a string": lambda s: s.update(step="1"), "step a float": lambda s: s.update(step=1.5),
    "step negative": lambda s: s.update(step=-1), "optimizer empty": lambda s: s.update(optimizer={}),
    "optimizer no groups": lambda s: s.update(optimizer={"state": {}, "param_groups": []}),
    "optimizer a list": lambda s: s.update(optimizer=[]), "global_batch 0": lambda s: s.update(global_batch=0),
    "bad_steps None": lambda s: s.update(bad_steps=None), "args a list": lambda s: s.update(args=[]),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_training_state_is_refused_where_it_is_read(trained, tmp_path, how):
    d = os.path.join(copy_run(trained, tmp_path), "step_2")
    path = os.path.join(d, "train_state.pt")
    state = torch.load(path, weights_only=True)
    DAMAGE[how](state)
    torch.save(state, path)
    refused(lambda: dflash.read_train_state(d), path, how.split()[0], "corrupt")
    assert "train_state.pt" in dflash.checkpoint_problem(d)


def test_an_optimizer_state_that_does_not_fit_the_drafter(w, trained, capsys, tmp_path):
    """Well-formed, but for other parameters (one too few; a moment of another shape): load_state_dict's ValueError,
    or a traceback from the loop's first step; now one line naming the checkpoint."""
    out = copy_run(trained, tmp_path)
    path = os.path.join(out, "step_2", "train_state.pt")
    good = torch.load(path, weights_only=True)
    for damage in ("fewer", "shape"):
        state = torch.load(path, weights_only=True)
        opt = state["optimizer"]
        if damage == "fewer":
            opt["param_groups"][0]["params"] = opt["param_groups"][0]["params"][1:]
        else:
            opt["state"][0]["exp_avg"] = torch.zeros(3)
        torch.save(state, path)
        fails_with(capsys, w["base"] + ["--out", out, "--resume", "must", "--max_steps", "3"],
                   os.path.join(out, "step_2"), "optimizer state does not fit")
        torch.save(good, path)


# -----------------------------------------------------------------------------
# 8 and the signals: Ctrl-C at start-up, SIGHUP, a signal during the final save

def test_ctrl_c_during_start_up_is_one_line(w, capsys, tmp_path, monkeypatch):
    """Ctrl-C during the held-out walk before step 1 ended in a KeyboardInterrupt traceback."""
    def walk(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        pytest.fail("the signal did not interrupt")
    monkeypatch.setattr(dflash, "held_out_walk", walk)
    with pytest.raises(SystemExit) as e:
        dflash.main(w["base"] + ["--out", str(tmp_path / "o")])
    assert e.value.code == 128 + signal.SIGINT
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert err == ["interrupted (SIGINT)"], err
    assert not os.path.exists(tmp_path / "o" / "latest")


def test_ctrl_c_in_eval_is_one_line(w, capsys, tmp_path, monkeypatch):
    """eval.py's neighbour: Ctrl-C during a measurement, one line."""
    prompts = write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7, 8]})])
    monkeypatch.setattr(dflash, "load_target", lambda *a, **k: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(SystemExit) as e:
        ev.main(["--target", w["q3"], "--prompts", prompts, "--no_progress"])
    assert e.value.code == 128 + signal.SIGINT
    assert [x for x in capsys.readouterr().err.splitlines() if x.strip()] == ["interrupted (SIGINT)"]


def signal_at(monkeypatch, name, sig, when):
    """Send sig to this process when dflash.<name> is called the when-th time (1-based)."""
    real, calls = getattr(dflash, name), []

    def hooked(*a, **k):
        calls.append(1)
        if len(calls) == when:
            os.kill(os.getpid(), sig)
        return real(*a, **k)
    monkeypatch.setattr(dflash, name, hooked)


def test_sighup_saves_and_exits_as_sigterm_does(w, capsys, tmp_path, monkeypatch):
    """A closed terminal's SIGHUP killed the run with the work since the last save: it stops as SIGTERM does."""
    out = str(tmp_path / "o")
    signal_at(monkeypatch, "train_step", signal.SIGHUP, 2)
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as in a terminal (not under nohup)
    try:
        with pytest.raises(SystemExit) as e:
            dflash.main(w["base"] + ["--out", out, "--max_steps", "6"])
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert e.value.code == 128 + signal.SIGHUP
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"


def test_sighup_ignored_under_nohup_stays_ignored(w, tmp_path, monkeypatch):
    out = str(tmp_path / "o")
    signal_at(monkeypatch, "train_step", signal.SIGHUP, 1)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        dflash.main(w["base"] + ["--out", out])
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"


def test_a_signal_during_the_final_save_keeps_it(w, capsys, tmp_path, monkeypatch):
    """Ctrl-C during the final held-out evaluation or save ended the run without its final checkpoint."""
    out = str(tmp_path / "o")
    signal_at(monkeypatch, "save_checkpoint", signal.SIGINT, 1)  # --save_every 0: the first save is the final one
    dflash.main(w["base"] + ["--out", out])
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"
    assert dflash.checkpoint_problem(os.path.join(out, "step_2")) is None


# -----------------------------------------------------------------------------
# What killed writes leave: removed once their process is gone, never a live one's

def test_files_of_killed_writes_are_removed_when_their_process_is_gone(trained, tmp_path):
    out = copy_run(trained, tmp_path)
    dead, alive = dead_pid(), os.getppid()
    made = {f"step_3.tmp{dead}": "dir", f"step_3.tmp{alive}": "dir", f"step_1.old{dead}": "dir",
            f"step_4.tmp{dead}": "dir", f"step_4.old{dead}": "dir", f"latest.tmp{dead}": "file",
            f"latest.tmp{alive}": "file", f"metrics.jsonl.tmp{dead}": "file", f"notes.tmp{dead}": "file"}
    for name, kind in made.items():
        os.mkdir(os.path.join(out, name)) if kind == "dir" else open(os.path.join(out, name), "w").close()
    dflash.lock_out(out)
    try:
        # a dead process's step_3.tmp goes, and step_1.old (step_1 is back); a live one's stays, as does step_4's
        # pair (a save killed between its renames: both complete copies) and what is not ours
        ours, gone = {"step_1", "step_2", "latest", "metrics.jsonl"}, {f"step_3.tmp{dead}", f"step_1.old{dead}"}
        assert set(os.listdir(out)) - ours == set(made) - gone
        dflash.write_atomic(os.path.join(out, "latest"), "step_2\n")  # each atomic write clears its own name's
        dflash.keep_metrics(out, 1)
        gone |= {f"latest.tmp{dead}", f"metrics.jsonl.tmp{dead}"}
        assert set(os.listdir(out)) - ours == set(made) - gone
    finally:
        os.close(dflash.OUT_LOCKS.pop(os.path.realpath(out)))
    report = tmp_path / "r"  # eval.py's report (write_atomic): its own leftovers only
    report.mkdir()
    (report / f"tau.json.tmp{dead}").write_text("{")
    (report / f"other.json.tmp{dead}").write_text("{")
    dflash.write_atomic(str(report / "tau.json"), "{}")
    assert sorted(os.listdir(report)) == ["other.json.tmp" + str(dead), "tau.json"]
