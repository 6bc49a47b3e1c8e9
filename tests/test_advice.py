"""Advice a user can follow: for each refusal of dflash.py here, the command its error line suggests, run as given,
gets past that refusal (no advice that loops: "drop --resume" answered by "pass --resume"). regenerate's
refusals are followed so in tests/test_regenerate_hostile.py."""

import json
import os
import shutil

import pytest

import dflash
from conftest import fails_with, replace

pytestmark = pytest.mark.usefixtures("one_thread_module")


def runs(argv, capsys):
    """dflash.main(argv) gets past every refusal: it trains to the end."""
    dflash.main(argv)
    out = argv[argv.index("--out") + 1]
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"
    return capsys.readouterr()


def run_without_checkpoints(trained, tmp_path):  # noqa: F811
    """An --out whose checkpoints were all deleted: latest and metrics.jsonl are left."""
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    for name in os.listdir(out):
        if name.startswith("step_"):
            shutil.rmtree(os.path.join(out, name))
    return out


def test_resume_over_deleted_checkpoints_advises_what_works(w, trained, capsys, tmp_path):  # noqa: F811
    out = run_without_checkpoints(trained, tmp_path)
    base = w["base"] + ["--out", out]
    err = fails_with(capsys, base + ["--resume"], "no complete checkpoint is left", "--resume auto starts anew")
    assert "drop --resume" not in err
    err = fails_with(capsys, base, "already holds a run", "pass --resume auto to start anew")
    printed = runs(base + ["--resume", "auto"], capsys).out  # as advised, both times
    assert "holds no complete checkpoint" in printed and "starting anew" in printed
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if "loss" in r] == [1, 2]  # the old log is not continued


def test_resume_over_a_run_that_never_checkpointed(w, trained, capsys, tmp_path):  # noqa: F811
    out = tmp_path / "only_metrics"
    out.mkdir()
    shutil.copy(os.path.join(trained, "metrics.jsonl"), out)
    base = w["base"] + ["--out", str(out)]
    fails_with(capsys, base + ["--resume"], "no checkpoint in", "--resume auto starts anew")
    fails_with(capsys, base, "already holds a run", "--resume auto")
    runs(base + ["--resume", "auto"], capsys)


def test_a_used_out_advises_resume_which_resumes(w, trained, capsys, tmp_path):  # noqa: F811
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    fails_with(capsys, w["base"] + ["--out", out, "--max_steps", "3"], "already holds a run", "pass --resume")
    dflash.main(w["base"] + ["--out", out, "--max_steps", "3", "--resume"])
    assert "resumed from" in capsys.readouterr().out


def test_a_corrupt_latest_with_no_complete_checkpoint_resumes_auto(w, trained, capsys, tmp_path):  # noqa: F811
    """Every checkpoint corrupt: --resume says so and offers --resume auto, which starts anew; with one complete
    checkpoint left --resume refuses naming it, and --resume auto continues it (saying so)."""
    out = str(tmp_path / "run")
    shutil.copytree(trained, out)
    for step in ("step_1", "step_2"):
        with open(os.path.join(out, step, "train_state.pt"), "wb") as f:
            f.write(b"garbage")
    base = w["base"] + ["--out", out]
    fails_with(capsys, base + ["--resume"], "corrupt", "--resume auto starts anew")
    runs(base + ["--resume", "auto"], capsys)
    shutil.copytree(trained, str(tmp_path / "one_left"))
    with open(os.path.join(tmp_path, "one_left", "step_2", "train_state.pt"), "wb") as f:
        f.write(b"garbage")
    base = w["base"] + ["--out", str(tmp_path / "one_left")]
    fails_with(capsys, base + ["--resume"], "corrupt", "step_1 is complete: write step_1 into latest")
    said = runs(base + ["--resume", "auto"], capsys).out
    step1 = os.path.join(tmp_path, "one_left", "step_1")
    assert f"continuing {step1}, the newest complete one" in said and f"resumed from {step1}" in said, said


def test_data_naming_a_directory(w, capsys, tmp_path):
    argv = replace(w["base"], "--data", str(tmp_path)) + ["--out", str(tmp_path / "o")]
    err = fails_with(capsys, argv, "--data", "is a directory", "pass --data with a JSONL")
    assert "does not exist" not in err
    runs(replace(argv, "--data", w["data"]), capsys)


def test_tree_budget_without_the_walk(w, capsys, tmp_path):
    argv = w["base"] + ["--out", str(tmp_path / "o"), "--eval_walk_tree_budget", "4", "--eval_walk_prompts", "0"]
    fails_with(capsys, argv, "--eval_walk_tree_budget 4", "--eval_walk_prompts 0", "drop --eval_walk_prompts 0")
    runs(argv[:-2], capsys)  # --eval_walk_prompts 0 dropped, as advised
