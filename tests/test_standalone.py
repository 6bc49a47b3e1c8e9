"""dflash.py stands alone: copied into an empty directory, with nothing of the project beside it, it trains a drafter
(held-out loss, tau estimate and walked tau logged; z-lab-layout checkpoints), and SIGTERM then --resume reaches the
uninterrupted run's weights, as one process and under torchrun (with --zero). The optional extras say in one line that they need
dflash_tools/. And the README's first command, `python dflash.py` (the demo), runs end to end at a reduced size."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

import dflash
from conftest import ROOT, SMALL, tiny_qwen3, torch_threads, write_data


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    d = tmp_path_factory.mktemp("alone")
    os.makedirs(d / "copy")
    shutil.copy(os.path.join(ROOT, "dflash.py"), d / "copy" / "dflash.py")
    return {"dir": d, "script": str(d / "copy" / "dflash.py"), "q3": tiny_qwen3(d / "q3"),
            "data": write_data(d / "data.jsonl", 24)}


def env():
    """No path to the repository: only what the copy's own directory and site-packages hold."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def final_weights(out):
    with open(os.path.join(out, "latest")) as f:
        return load_file(os.path.join(out, f.read().strip(), "model.safetensors"))


def interrupt_then_resume(cmd, out, cwd, kill):
    """Start cmd, SIGTERM it (kill(p) sends the signal) once two steps are logged, check it saved and exited
    non-zero (128 + SIGTERM: interrupted, not done; torchrun reports its workers so), then rerun cmd with --resume
    to the end."""
    p = subprocess.Popen(cmd + ["--out", out], cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (os.path.exists(os.path.join(out, "metrics.jsonl"))
                                          and sum("loss" in r for r in records(out)) >= 2):
        time.sleep(0.05)
    kill(p)
    stdout, stderr = p.communicate(timeout=240)
    assert p.returncode == 128 + signal.SIGTERM or "torch.distributed.run" in cmd and p.returncode, stderr[-3000:]
    assert "--resume" in stdout + stderr
    with open(os.path.join(out, "latest")) as f:
        assert 2 <= int(f.read().strip().split("_")[1]) < 8, "the interruption should land mid-run"
    p = subprocess.run(cmd + ["--out", out, "--resume"], cwd=cwd, env=env(), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]


def test_dflash_py_alone_trains_and_resumes(alone, tmp_path):
    d, copy_dir = alone["dir"], os.path.dirname(alone["script"])
    common = ["--target", alone["q3"], "--data", alone["data"], "--max_steps", "8", "--grad_accum", "1", *SMALL,
              "--eval_fraction", "0.2", "--eval_every", "4", "--eval_walk_prompts", "3", "--eval_walk_tokens", "8"]
    with torch_threads(1):  # the uninterrupted run, in this process (the same numbers as a 1-thread subprocess)
        dflash.main(common + ["--batch_size", "4", "--out", str(d / "full")])
    full = final_weights(d / "full")

    out = str(tmp_path / "one")
    interrupt_then_resume([sys.executable, alone["script"], *common, "--batch_size", "4", "--grad_checkpoint"], out,
                          copy_dir, lambda p: p.send_signal(signal.SIGTERM))  # (recomputing layers changes no number)
    evals = [r for r in records(out) if "eval_loss" in r]
    assert evals and all(r["eval_walk_tau"] >= 1 and r["eval_tau"] >= 1 for r in evals)
    step = os.path.join(out, "step_8")
    with open(os.path.join(step, "config.json")) as f:
        assert json.load(f)["architectures"] == ["DFlashDraftModel"]
    dflash.load_drafter(step)  # the z-lab layout, loaded strictly
    mine = final_weights(out)
    assert max((mine[k] - full[k]).abs().max().item() for k in full) <= 1e-6
    assert [r["loss"] for r in records(out) if "loss" in r] == \
        pytest.approx([r["loss"] for r in records(d / "full") if "loss" in r], abs=1e-6)  # the log continues too

    # two ranks of 2 rows (the same global batch of 4) with --zero: AdamW's state sharded over the ranks, gathered
    # whole into the checkpoint on SIGTERM and split again on --resume
    out = str(tmp_path / "two")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(29500 + random.randrange(1000)), alone["script"], *common, "--batch_size", "2", "--zero"]

    def sigterm_workers(p):  # as a cluster scheduler does: every worker gets SIGTERM
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            for pid in f.read().split():
                os.kill(int(pid), signal.SIGTERM)
    interrupt_then_resume(torchrun, out, copy_dir, sigterm_workers)
    mine = final_weights(out)
    assert max((mine[k] - full[k]).abs().max().item() for k in full) <= 1e-5


def test_optional_extras_say_what_is_missing(alone):
    def train(*flags):  # the runs start at once: an --out each (one writer per --out)
        return ["--target", alone["q3"], "--data", alone["data"], "--out", f"o{flags[-1]}", *SMALL, *flags]
    cases = (([], "the demo"), (["--target", alone["q3"], "--plan"], "--plan"), (train("--dflash2"), "--variant dflash2"),
             (train("--loss", "dpace"), "--loss dpace"), (train("--report_to", "tensorboard"), "--report_to"),
             (train("--eval_walk_tree_budget", "4"), "--eval_walk_tree_budget"),
             (train("--show_data", "2"), "--show_data"))
    procs = [subprocess.Popen([sys.executable, alone["script"], *argv], cwd=os.path.dirname(alone["script"]), env=env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for argv, _ in cases]
    for p, (_, needle) in zip(procs, cases):  # (both at once: an interpreter start-up is most of the time)
        err = p.communicate(timeout=120)[1].strip().splitlines()
        assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), err
        assert needle in err[0] and "dflash_tools" in err[0], err[0]


def test_import_leaves_the_compiler_alone(alone):
    """Importing dflash.py loads neither torch's compiler nor inductor (seconds at every start, and in every torchrun
    worker): flex is compiled when a flex drafter is built, which a CPU run never does."""
    probe = "import sys, dflash; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", probe], cwd=os.path.dirname(alone["script"]), env=env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr[-2000:])


def test_demo_path_at_reduced_size(tmp_path, small_demo, capsys):
    """`python dflash.py` as main() runs it: build the tiny target, regenerate its data, train, measure tau and
    write the report, at a size of seconds (small_demo: its target and data built once a session)."""
    out = tmp_path / "demo"
    small_demo(out)
    text = capsys.readouterr().out
    assert "demo done" in text and "wrote" in text
    report = json.load(open(out / "demo_eval.json"))
    assert {r["drafter"] for r in report["results"]} == {"trained", "untrained", "prompt-lookup"}
    assert all(r["tau"] >= 1 and r["steps"] > 0 for r in report["results"])
    assert [r["step"] for r in records(out) if "loss" in r] == [3]  # it trained: three steps, the last one logged
