"""No plug-in and no cluster fault costs a run. A run never starts over on top of checkpoints it cannot read (its
variant untrusted or moved, a file the OS refuses, a value a safe load refuses), in --resume auto and a torchrun
restart too; a variant named by a relative path, a symlink or a module name resumes from anywhere; a stage's state,
a plug-in's flag values and a variant's config keys are checked when saved; a plug-in raising mid-step, a scheduler's
warning signal and a full disk each end the run in one line with the last checkpoint intact. The plug-ins are written
here, outside the repository."""
import builtins
import errno
import io
import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch

from conftest import (ROOT, SMALL, fails_with, one_error, refused, signalling_step, tiny_cfg, tiny_qwen3, tree_bytes,
                      write_data)

import dflash
import eval as ev

pytestmark = pytest.mark.usefixtures("one_thread_module")

# a toy variant: a learned bias added to the final hidden state, its own field and flag; configure reads its flag
# whatever cfg it gets (as a forker's would); RAISE_AT: a training forward of that number raises (0: never)
TOY = '''
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

import dflash

RAISE_AT, CALLS = 0, [0]


@dataclass
class Config(dflash.DFlashConfig):
    toy_bias: float = 0.0
    architecture: ClassVar[str] = "ToyFaultModel"

    def dflash_config_keys(self):
        return KEYS(self)


KEYS = lambda c: {"toy_bias": c.toy_bias}  # noqa: E731


class Layer(dflash.DecoderLayer):
    def forward(self, *a):
        CALLS[0] += torch.is_grad_enabled()
        if torch.is_grad_enabled() and CALLS[0] == RAISE_AT:
            raise ValueError("the toy layer broke")
        return super().forward(*a)


class Drafter(dflash.DFlashDrafter):
    Layer = Layer


Config.Drafter = Drafter


def add_flags(g):
    dflash.flag(g, "--toy_bias", 0.25, "the toy's bias", float)


def configure(cfg, args):
    bias = args.toy_bias  # (a traceback here when --init_from's variant came without its flags)
    return cfg if isinstance(cfg, Config) else Config(**{f.name: getattr(cfg, f.name)
                                                        for f in fields(dflash.DFlashConfig)}, toy_bias=bias)
'''


def write_toy(d, name="toy.py", **subs):
    d.mkdir(parents=True, exist_ok=True)
    text = TOY
    for k, v in subs.items():
        text = text.replace(k, v)
    (d / name).write_text(text)
    return str(d / name)


@pytest.fixture(scope="module")
def f(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    q3, data = tiny_qwen3(d / "q3"), write_data(d / "data.jsonl", 8)
    base = ["--target", q3, "--data", data, "--batch_size", "2", "--grad_accum", "1", *SMALL,
            "--eval_walk_prompts", "0", "--max_steps", "2", "--save_every", "1"]
    return {"dir": d, "q3": q3, "data": data, "base": base}


def steps(out):
    return sorted(n for n in os.listdir(out) if n.startswith("step_"))


def latest(out):
    return open(os.path.join(out, "latest")).read().strip()


# -----------------------------------------------------------------------------
# A variant named by a relative path, a symlink or a module name resumes, from another directory, on a restart

@pytest.mark.parametrize("how", ["relative", "symlink", "module"])
def test_a_variant_named_any_way_resumes_from_anywhere(f, tmp_path, monkeypatch, capsys, how):
    assert not str(tmp_path).startswith(ROOT)
    toy = write_toy(tmp_path / "plugins")
    (tmp_path / "a" / "b").mkdir(parents=True)
    out = str(tmp_path / "run")
    if how == "relative":  # as given from a/, then from a/b/
        monkeypatch.chdir(tmp_path / "a")
        first, then = "../plugins/toy.py", "../../plugins/toy.py"
    elif how == "symlink":
        os.symlink(toy, tmp_path / "link.py")
        first, then = str(tmp_path / "link.py"), toy
    else:  # a module name is recorded as such: importable from anywhere on sys.path
        monkeypatch.syspath_prepend(str(tmp_path / "plugins"))
        first, then = "toy", "toy"
    dflash.main(f["base"] + ["--out", out, "--variant", first, "--max_steps", "1"])
    recorded = json.load(open(os.path.join(out, "step_1", "config.json")))["dflash_module"]
    assert recorded == ("toy" if how == "module" else os.path.realpath(toy))
    monkeypatch.chdir(tmp_path / "a" / "b")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a torchrun restart: --resume auto, unasked
    dflash.main(f["base"] + ["--out", out, "--variant", then])
    assert f"resumed from {os.path.join(out, 'step_1')} at step 1" in capsys.readouterr().out
    assert latest(out) == "step_2"


def test_a_moved_or_untrusted_variant_stops_the_resume_and_is_told_where_it_lives(f, tmp_path, monkeypatch, capsys):
    """Its checkpoint was read as corrupt and --resume auto started over, overwriting the run. Now every resume stops
    in one line naming the flag; --variant NEWPATH (the same architecture) resumes, --init_from's and eval.py's too."""
    old = write_toy(tmp_path / "old")
    out = str(tmp_path / "run")
    dflash.main(f["base"] + ["--out", out, "--variant", old, "--max_steps", "1"])
    before = tree_bytes(out)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    fails_with(capsys, f["base"] + ["--out", out], "config.json (ToyFaultModel) is code from", old,
               "--trust_variant_code")
    new = str(tmp_path / "new" / "toy.py")
    os.renames(old, new)
    fails_with(capsys, f["base"] + ["--out", out, "--trust_variant_code"], old, "no file", "give --variant its path")
    fails_with(capsys, f["base"] + ["--out", out, "--resume", "--trust_variant_code"], old, "no file")
    assert tree_bytes(out) == before  # nothing started over
    dflash.main(f["base"] + ["--out", out, "--resume", "--variant", new])
    assert "resumed from" in capsys.readouterr().out and latest(out) == "step_2"
    assert json.load(open(os.path.join(out, "step_2", "config.json")))["dflash_module"] == os.path.realpath(new)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 5, 9, 11, 2, 40]}) + "\n")
    report = tmp_path / "tau.json"
    step1 = os.path.join(out, "step_1")  # still naming the old path
    ev.main(["--target", f["q3"], "--drafter", step1, "--prompts", str(prompts), "--max_new_tokens", "8",
             "--no_prompt_lookup", "--variant", new, "--json", str(report)])
    assert json.loads(report.read_text())["results"][0]["tau"] >= 1
    dflash.main(f["base"] + ["--out", str(tmp_path / "ft"), "--init_from", step1, "--variant", new,
                             "--max_steps", "1"])
    assert latest(str(tmp_path / "ft")) == "step_1"


def test_init_from_a_variant_without_its_flag_gives_configure_the_defaults(f, tmp_path):
    toy = write_toy(tmp_path / "plugins")
    dflash.main(f["base"] + ["--out", str(tmp_path / "run"), "--variant", toy, "--max_steps", "1"])
    ft = str(tmp_path / "ft")
    dflash.main(f["base"] + ["--out", ft, "--init_from", str(tmp_path / "run" / "step_1"), "--trust_variant_code",
                             "--max_steps", "1"])
    assert json.load(open(os.path.join(ft, "step_1", "config.json")))["architectures"] == ["ToyFaultModel"]


# -----------------------------------------------------------------------------
# Checkpoints that cannot be read stop every resume: never read as corrupt, never started over

def simulate_no_permission(monkeypatch, out):  # step dirs without r/x (root ignores chmod): EACCES on what is in them
    def refusing(real):
        def call(p, *a, **k):
            if isinstance(p, (str, os.PathLike)) and os.path.abspath(p).startswith(os.path.join(out, "step_")) and \
                    os.path.dirname(os.path.abspath(p)) != out:
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real(p, *a, **k)
        return call
    for module, name in ((os, "stat"), (io, "open"), (builtins, "open")):
        monkeypatch.setattr(module, name, refusing(getattr(module, name)))


def break_all(out, how):
    for s in steps(out):
        path = os.path.join(out, s, "train_state.pt")
        if how == "train_state.pt a directory":
            os.remove(path), os.mkdir(path)
        elif how == "a numpy scalar in the state":  # as an unchecked stage's state was saved
            state = torch.load(path, weights_only=True)
            torch.save({**state, "stage_state": {"n": np.float64(1.0)}}, path)
        elif how == "chmod 000":
            os.chmod(os.path.join(out, s), 0)


UNREADABLE = {"train_state.pt a directory": ("train_state.pt", "Is a directory"),
              "a numpy scalar in the state": ("train_state.pt", "numpy", "weights_only"),
              "no permission (simulated)": ("config.json", "Permission denied"),
              "chmod 000": ("config.json", "Permission denied")}


@pytest.mark.parametrize("how", list(UNREADABLE))
@pytest.mark.parametrize("resume", ["auto", "a torchrun restart", "must"])
def test_unreadable_checkpoints_stop_every_resume(f, tmp_path, monkeypatch, capsys, how, resume):
    if how == "chmod 000" and os.geteuid() == 0:
        pytest.skip("root reads a directory whatever its mode (the simulated case stands for it)")
    out = str(tmp_path / "run")
    dflash.main(f["base"] + ["--out", out])
    capsys.readouterr()
    break_all(out, how)
    before = tree_bytes(out)
    if how == "no permission (simulated)":
        simulate_no_permission(monkeypatch, out)
    argv = f["base"] + ["--out", out, "--max_steps", "3"]
    if resume == "a torchrun restart":
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    else:
        argv += ["--resume", resume]
    try:
        err = fails_with(capsys, argv, os.path.join(out, "step_2"), *UNREADABLE[how])
    finally:
        for s in steps(out) if how == "chmod 000" else ():
            os.chmod(os.path.join(out, s), 0o755)
    assert "no config.json" not in err and "starting anew" not in capsys.readouterr().out
    monkeypatch.undo()
    assert tree_bytes(out) == before  # nothing written over them


# -----------------------------------------------------------------------------
# What a checkpoint holds is checked when it is saved

def tiny_checkpoint_parts():
    torch.manual_seed(0)
    d = dflash.DFlashDrafter(tiny_cfg())
    opt = torch.optim.AdamW(d.parameters())
    for p in d.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # AdamW's two moments: twice the weights again
    return d, opt


@pytest.mark.parametrize("bad, says", [(np.float64(1.0), "numpy.float64"), (lambda: 0, "function"),
                                       ({np.int64(3): 1}, "a key of"), ([1, {"x": object()}], "object")])
def test_a_state_a_safe_load_refuses_fails_at_its_save(tmp_path, bad, says):
    drafter, opt = tiny_checkpoint_parts()
    out = str(tmp_path / "run")
    state = {"args": {}, "global_batch": 1, "bad_steps": 0, "stage_state": {"count": 2, "n": bad}}
    refused(lambda: dflash.save_checkpoint(out, 1, drafter, opt, torch.float32, state, say=lambda *a: None),
            "step_1", "train_state['stage_state']['n']", says, "None, bool, int, float, str, tensors")
    assert not os.path.exists(os.path.join(out, "step_1"))
    good = {"count": 2, "n": [1.5, (True, None)], "t": torch.ones(2), "d": {"a": "b", 3: -1}}
    dflash.save_checkpoint(out, 1, drafter, opt, torch.float32, {**state, "stage_state": good}, say=lambda *a: None)
    back = dflash.read_train_state(os.path.join(out, "step_1"))["stage_state"]
    assert back["n"] == [1.5, (True, None)] and torch.equal(back["t"], torch.ones(2)) and back["d"] == good["d"]


NUMPY_LOSS = '''
import numpy
import dflash

LOSSES = {"np": lambda args: dflash.CE()}


def add_flags(g):
    dflash.flag(g, "--np_scale", numpy.float64(1.0), "a scale of a type torch.load will not read back",
                type=numpy.float64)
'''


def test_a_plugin_flag_value_a_safe_load_refuses_fails_at_the_first_save(f, tmp_path, capsys):
    """It saved, then every checkpoint read back "corrupt" (and --resume auto started over)."""
    (tmp_path / "np_loss.py").write_text(NUMPY_LOSS)
    out = str(tmp_path / "run")
    fails_with(capsys, f["base"] + ["--out", out, "--loss", f"{tmp_path / 'np_loss.py'}:np"], "step_1",
               "train_state['args']['np_scale']", "numpy.float64")
    assert steps(out) == []


@pytest.mark.parametrize("keys, says", [('{"bias": c.toy_bias}', "returns 'bias'"),
                                        ("{}", "leaves out toy_bias")])
def test_dflash_config_keys_under_another_name_or_left_out(f, tmp_path, capsys, keys, says):
    toy = write_toy(tmp_path / "plugins", **{'{"toy_bias": c.toy_bias}': keys})
    fails_with(capsys, f["base"] + ["--out", str(tmp_path / "o"), "--variant", toy], "dflash_config_keys()", says)
    assert not os.path.exists(tmp_path / "o" / "step_1")


# -----------------------------------------------------------------------------
# A plug-in raising mid-step: its traceback, then one line naming it, the step and its error; the last save intact

RAISING_LOSS = '''
import torch
import dflash


class Broken(dflash.CE):
    def token_loss(self, logits, labels):
        if torch.is_grad_enabled():
            raise KeyError("no such label")
        return super().token_loss(logits, labels)


LOSSES = {"broken": lambda args: Broken()}
'''


def test_a_plugin_raising_mid_step_is_named_with_the_step(f, tmp_path, capsys):
    toy = write_toy(tmp_path / "plugins", **{"RAISE_AT, CALLS = 0": "RAISE_AT, CALLS = 5"})  # 2 layers: step 3
    out = str(tmp_path / "run")
    with pytest.raises(SystemExit) as e:
        dflash.main(f["base"] + ["--out", out, "--variant", toy, "--max_steps", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and "Traceback" in err[0] and "the toy layer broke" in err[-2]
    assert err[-1].startswith(f"error: plug-in {toy} raised ValueError in step 3: the toy layer broke"), err[-1]
    assert os.path.join(out, "step_2") in err[-1] and latest(out) == "step_2"
    assert dflash.checkpoint_problem(os.path.join(out, "step_2")) is None
    (tmp_path / "broken.py").write_text(RAISING_LOSS)
    with pytest.raises(SystemExit):
        dflash.main(f["base"] + ["--out", str(tmp_path / "o2"), "--loss", f"{tmp_path / 'broken.py'}:broken"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"error: plug-in {tmp_path / 'broken.py'} raised KeyError in step 1"), last
    assert "no complete checkpoint" in last


# -----------------------------------------------------------------------------
# A scheduler's warning before its time limit saves and stops like SIGTERM

@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2])
def test_a_time_limit_warning_saves_and_stops(f, tmp_path, monkeypatch, capsys, sig):
    """Slurm's --signal=USR1@90 (Lightning's requeue), submitit's USR2: killed by the default action, unsaved."""
    step = signalling_step(sig)
    monkeypatch.setattr(dflash, "train_step", step)
    out = str(tmp_path / "o")
    with pytest.raises(SystemExit) as e:
        dflash.main(f["base"] + ["--out", out, "--max_steps", "6", "--save_every", "0"])
    assert e.value.code == 128 + sig and latest(out) == "step_2"
    assert signal.getsignal(sig) == signal.SIG_DFL
    monkeypatch.undo()
    dflash.main(f["base"] + ["--out", out, "--max_steps", "3", "--resume"])
    assert "resumed from" in capsys.readouterr().out and latest(out) == "step_3"


# -----------------------------------------------------------------------------
# A full disk says so: the path and the bytes a checkpoint needs; the last checkpoint and latest as they were

@pytest.mark.parametrize("how", ["torch's error", "ENOSPC"])
def test_a_full_disk_says_so(tmp_path, monkeypatch, how):
    drafter, opt = tiny_checkpoint_parts()
    out, state, quiet = str(tmp_path / "run"), {"args": {}, "global_batch": 1, "bad_steps": 0}, lambda *a: None
    dflash.save_checkpoint(out, 1, drafter, opt, torch.float32, state, say=quiet)
    before = tree_bytes(out)
    if how == "ENOSPC":  # safetensors' write, the weights
        import safetensors.torch

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(safetensors.torch, "save_file", full)
    else:  # torch.save's, the training state: no errno
        def full(*a, **k):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 832 vs 768")
        monkeypatch.setattr(torch, "save", full)
    usage = shutil.disk_usage(out)  # what a full disk reports
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))
    msg = refused(lambda: dflash.save_checkpoint(out, 2, drafter, opt, torch.float32, state, say=quiet),
                  "disk full", os.path.join(out, "step_2"), "bytes", os.path.join(out, "step_1"))
    weights = sum(t.numel() * 4 for t in drafter.state_dict().values())
    assert "enforce fail" not in msg and int(msg.split("needs about ")[1].split()[0].replace(",", "")) >= 3 * weights
    monkeypatch.undo()
    assert tree_bytes(out) == before and latest(out) == "step_1"


def test_another_write_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    drafter, opt = tiny_checkpoint_parts()
    out, state = str(tmp_path / "run"), {"args": {}, "global_batch": 1, "bad_steps": 0}

    def quota(*a, **k):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(torch, "save", quota)
    msg = refused(lambda: dflash.save_checkpoint(out, 1, drafter, opt, torch.float32, state, say=lambda *a: None),
                  "Disk quota exceeded", "step_1")
    assert "disk full" not in msg


# -----------------------------------------------------------------------------
# A plug-in's flag without its plug-in says which flag brings it; --help beside --variant X lists X's flags

def test_a_plugin_flag_without_its_plugin_and_help_beside_it(f, tmp_path, capsys):
    toy = write_toy(tmp_path / "plugins")
    argv = f["base"] + ["--out", str(tmp_path / "o")]
    one_error(capsys, dflash.main, argv + ["--toy_bias", "1"], "unknown flag --toy_bias",
              "plug-in flags need their --variant/--loss/--stage")
    with pytest.raises(SystemExit) as e:
        dflash.main(["--help", "--variant", toy])
    assert e.value.code == 0
    assert "--toy_bias" in capsys.readouterr().out
    dflash.main(argv + ["--variant", toy, "--toy_bias", "0.5", "--max_steps", "1"])
    assert json.load(open(tmp_path / "o" / "step_1" / "config.json"))["dflash_config"]["toy_bias"] == 0.5
