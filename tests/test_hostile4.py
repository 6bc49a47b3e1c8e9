"""Round four of hostile use (issue 41), one or more tests per class of fault, each fast:
silently wrong results (exit 0 on a guess), data lost or mixed, tracebacks instead of one line, errors that mislead,
and what a newcomer meets at the start. Every refusal is one `error:` line, exit 2, nothing written; a value that is
ambiguous is read exactly or refused by name, never guessed."""
import json
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch

import dflash
import eval as ev
from conftest import (ROOT, VOCAB, ZL, fails_with, one_error, refused, replace, signalling_step, tiny_cfg, tiny_qwen35,
                      tiny_tokenizer, tree_bytes, write_data, write_lines, write_zlab_dir, zlab_config, zlab_tensors)
from dflash import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread_module")

EOS = [4]  # <|end|> of conftest's tiny tokenizer
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good day"}]


def copy_run(trained, tmp_path, name="run"):
    import shutil
    out = str(tmp_path / name)
    shutil.copytree(trained, out)
    return out


# -----------------------------------------------------------------------------
# Silently wrong results (exit 0 on a guess)

@pytest.mark.parametrize("mask", [["0", "0", "1", "1"], ["no", "no", "yes", "yes"], [0, 0, 2, 1], [0, 0, None, 1],
                                  [0.0, 0.5, 1.0, 1.0]])
def test_loss_mask_values_are_read_exactly_or_refused(mask):
    """A loss_mask of strings used to train on every token (bool("0") is True). Only 0 and 1 (ints, bools, or the
    exact numbers 0.0/1.0 a Parquet float column holds) are read; anything else is refused by name."""
    rec = {"input_ids": [5, 6, 7, 8], "loss_mask": mask}
    try:
        ids, got = dflash.encode_sample(rec, None, where="f:1")
    except DFlashError as e:
        assert "loss_mask" in str(e) and "f:1" in str(e) and "\n" not in str(e), str(e)
        return
    assert mask in (["0", "0", "1", "1"],) and got == [0, 0, 1, 1], (mask, got)


def test_loss_mask_of_bools_and_exact_floats_is_read():
    assert dflash.encode_sample({"input_ids": [5, 6, 7], "loss_mask": [False, True, True]}, None)[1] == [0, 1, 1]
    assert dflash.encode_sample({"input_ids": [5, 6, 7], "loss_mask": [0.0, 1.0, 1.0]}, None)[1] == [0, 1, 1]


def test_content_parts_are_read_as_their_text_or_refused():
    """OpenAI-style content parts ([{"type": "text", "text": ...}]) used to be rendered as the Python repr of the
    list. A single text part reads exactly as its text; anything else is refused naming the content."""
    tok = tiny_tokenizer()
    plain = dflash.encode_sample({"messages": CHAT}, tok, eos_ids=EOS)
    parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in CHAT]
    try:
        assert dflash.encode_sample({"messages": parts}, tok, eos_ids=EOS) == plain
    except DFlashError as e:
        assert "content" in str(e), str(e)
    image = [CHAT[0], {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    refused(lambda: dflash.encode_sample({"messages": image}, tok, eos_ids=EOS, where="f:3"), "f:3", "content")
    refused(lambda: dflash.encode_sample({"messages": [CHAT[0], {"role": "assistant", "content": 7}]}, tok,
                                         eos_ids=EOS, where="f:4"), "f:4", "content")


def test_a_null_field_is_an_absent_field():
    """A mixed dataset's "input_ids": null beside messages is the messages record it is (as Parquet rows are)."""
    tok = tiny_tokenizer()
    assert dflash.encode_sample({"input_ids": None, "loss_mask": None, "messages": CHAT}, tok, eos_ids=EOS) == \
        dflash.encode_sample({"messages": CHAT}, tok, eos_ids=EOS)


def nan_drafter(path):
    d = dflash.DFlashDrafter(tiny_cfg(vocab_size=VOCAB, mask_token_id=VOCAB - 1, num_target_layers=4,
                                      target_layer_ids=[1, 2]))
    with torch.no_grad():
        next(d.parameters()).fill_(float("nan"))
    return dflash.save_drafter(d, str(path), dtype=torch.float32)


def test_a_drafter_with_nan_weights_is_refused(tmp_path):
    """A NaN drafter measured tau 1.000 without a word (eval.py) and --init_from one ended naming a 'last good
    checkpoint' that does not exist: it is refused where it is loaded, naming the tensor."""
    path = nan_drafter(tmp_path / "nan")
    msg = refused(lambda: dflash.load_drafter(path), path)
    assert "nan" in msg.lower() or "finite" in msg.lower(), msg


def test_init_from_a_nan_drafter_says_so(w, capsys, tmp_path):
    path = nan_drafter(tmp_path / "nan")
    msg = fails_with(capsys, w["base"] + ["--out", str(tmp_path / "o"), "--init_from", path], path)
    assert ("nan" in msg.lower() or "finite" in msg.lower()) and "last good" not in msg, msg
    assert not os.path.exists(tmp_path / "o" / "step_1")


@pytest.mark.parametrize("flag,value", [("--num_draft_layers", "3"), ("--block_size", "8")])
def test_init_from_refuses_geometry_flags_it_would_ignore(w, trained, capsys, tmp_path, flag, value):
    """--init_from trains the checkpoint's geometry: a geometry flag beside it is refused by name, not ignored."""
    argv = w["base"] + ["--out", str(tmp_path / "o"), "--init_from", os.path.join(trained, "step_2"), flag, value]
    fails_with(capsys, argv, flag, "--init_from")
    assert not os.path.exists(tmp_path / "o" / "latest")


def test_eval_data_that_is_the_training_data_is_refused(w, capsys, tmp_path):
    """--eval_data equal to --data reported "held-out" metrics on training data."""
    link = str(tmp_path / "same.jsonl")
    os.symlink(w["data"], link)
    for other in (w["data"], link):
        fails_with(capsys, w["base"] + ["--out", str(tmp_path / "o"), "--eval_data", other], "--eval_data", "--data")


def test_eval_fraction_beside_eval_data_is_refused(w, capsys, tmp_path):
    held = write_data(tmp_path / "held.jsonl", 4, seed=5)
    argv = replace(w["base"], "--eval_fraction", "0.2") + ["--out", str(tmp_path / "o"), "--eval_data", held]
    fails_with(capsys, argv, "--eval_fraction", "--eval_data")


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"RANK": "1"}, {"WORLD_SIZE": "2", "RANK": "1"},
                                 {"LOCAL_RANK": "1"}, {"WORLD_SIZE": "two"}, {"RANK": "-1", "WORLD_SIZE": "2"}])
def test_partial_or_malformed_distributed_environment(w, capsys, tmp_path, monkeypatch, env):
    """RANK/WORLD_SIZE/LOCAL_RANK set without torchrun (or malformed) used to run a rank that logs nothing, raise a
    ValueError, or wait forever in the rendezvous: one line naming the variables, before anything starts."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
              "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    msg = fails_with(capsys, w["base"] + ["--out", str(tmp_path / "o")])
    assert any(k in msg for k in env), msg
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")


def test_a_rank_beyond_the_world_never_waits_for_the_rendezvous(w, tmp_path):
    """RANK 5 of WORLD_SIZE 2 (a typo in a launch script) waited silently forever in the rendezvous for ranks that
    never come: one line at once (a subprocess, so a hang ends at its timeout, not the suite's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WORLD_SIZE="2", RANK="5", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    try:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "dflash.py"), *w["base"], "--out", str(tmp_path / "o")],
                           capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("waited in the rendezvous")
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(err) == 1 and "RANK" in err[0], r.stderr[-2000:]


# -----------------------------------------------------------------------------
# Data lost or mixed

def test_resume_auto_never_starts_over_beside_complete_checkpoints(w, trained, capsys, tmp_path):
    """latest missing (lost, or deleted by hand) but step_1 and step_2 complete: --resume auto used to start at step 0
    and overwrite them. It continues from the newest complete one or refuses; the checkpoints stay as they were."""
    out = copy_run(trained, tmp_path)
    os.remove(os.path.join(out, "latest"))
    before = {k: v for k, v in tree_bytes(out).items() if k.startswith("step_")}
    try:
        dflash.main(w["base"] + ["--out", out, "--resume", "auto"])
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err
        assert "step_2" in err and "latest" in err, err
    else:
        assert "resumed from" in capsys.readouterr().out
    after = tree_bytes(out)
    assert all(after.get(k) == v for k, v in before.items())


def test_one_out_has_one_writer(w, capsys, tmp_path):
    """Two trainings on one --out interleaved metrics.jsonl and checkpoints: the second is refused while the first
    holds the lock (an flock on the --out directory itself, as regenerate's on OUT.lock: a killed run leaves no
    stale lock, and nothing is written for it)."""
    import fcntl
    out = tmp_path / "o"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fails_with(capsys, w["base"] + ["--out", str(out)], str(out), "another run")
    finally:
        os.close(fd)
    assert os.listdir(out) == []
    dflash.main(w["base"] + ["--out", str(out), "--max_steps", "1"])  # the lock released: the run takes it
    dflash.main(w["base"] + ["--out", str(out), "--max_steps", "2", "--resume"])  # and a later one in this process


def test_plot_reads_a_run_whose_last_line_was_torn(tmp_path):
    """A killed run's torn last line made the plot tool refuse the whole run: it is dropped (what keep_metrics does
    on resume); a torn line before the last is still corruption."""
    from dflash_tools import plot
    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2)]
    path.write_text("\n".join(good) + "\n" + '{"step": 3, "lo')
    assert [r["step"] for r in plot.read_metrics(str(tmp_path))] == [1, 2]
    path.write_text(good[0] + "\n" + '{"step": 3, "lo' + "\n" + good[1] + "\n")
    refused(lambda: plot.read_metrics(str(tmp_path)), "metrics.jsonl:2")


def test_checkpoint_files_share_one_mode(tmp_path):
    """model.safetensors was written 0600 beside 0644 siblings: another user serving the drafter could not read it."""
    d = dflash.DFlashDrafter(tiny_cfg())
    opt = torch.optim.AdamW(d.parameters())
    dflash.save_checkpoint(str(tmp_path), 1, d, opt, torch.bfloat16,
                           {"args": {}, "global_batch": 1, "bad_steps": 0}, say=lambda *a: None,
                           record={"target": "t", "fingerprint": "0"})
    modes = {f: stat.S_IMODE(os.stat(tmp_path / "step_1" / f).st_mode) for f in os.listdir(tmp_path / "step_1")}
    assert len(set(modes.values())) == 1, modes
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


# -----------------------------------------------------------------------------
# Tracebacks instead of one line

FSIZE = r"""
import json, os, resource, signal, sys
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, os.path.join(sys.argv[1], "tests"))
import torch, dflash
from conftest import tiny_cfg
out, limit = sys.argv[2], int(sys.argv[3])
torch.manual_seed(0)
d = dflash.DFlashDrafter(tiny_cfg())
opt = torch.optim.AdamW(d.parameters())
d(torch.zeros(1, 4, 64), torch.zeros(1, 1, 4, 32), torch.zeros(1, 1, dtype=torch.long),
  torch.ones(1, 1, dtype=torch.bool)).sum().backward()
opt.step()
state = {"args": {}, "global_batch": 1, "bad_steps": 0}
dflash.save_checkpoint(out, 1, d, opt, torch.float32, state, say=lambda *a: None)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file-size limit (or a full disk): the write fails, EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    dflash.save_checkpoint(out, 2, d, opt, torch.float32, state, say=lambda *a: None)
    print(json.dumps({"ok": True}))
except dflash.DFlashError as e:
    print(json.dumps({"error": str(e)}))
"""


@pytest.mark.parametrize("limit", [3000, 120_000], ids=["model.safetensors", "train_state.pt"])
def test_a_real_file_size_limit_while_a_checkpoint_is_written(tmp_path, limit):
    """A real write failure (RLIMIT_FSIZE: EFBIG, as ENOSPC would be), in model.safetensors (safetensors' own error
    type, not OSError) or in train_state.pt (torch's): one line naming the checkpoint and the last complete one;
    latest and step_1 as they were, nothing partial left."""
    out = str(tmp_path / "run")
    r = subprocess.run([sys.executable, "-c", FSIZE, ROOT, out, str(limit)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    msg = json.loads(r.stdout.strip().splitlines()[-1]).get("error")
    assert msg and "\n" not in msg and os.path.join(out, "step_2") in msg and "step_1" in msg, msg
    assert open(os.path.join(out, "latest")).read().strip() == "step_1"
    assert sorted(os.listdir(out)) == ["latest", "step_1"], os.listdir(out)
    assert dflash.checkpoint_problem(os.path.join(out, "step_1")) is None


def test_text_the_tokenizer_cannot_encode():
    """A lone surrogate (valid JSON, "\\ud800") made the tokenizer raise a TypeError."""
    tok = tiny_tokenizer()
    refused(lambda: dflash.encode_sample({"text": "hi \ud800 there"}, tok, where="f:2"), "f:2")
    refused(lambda: dflash.encode_sample({"messages": [CHAT[0], {"role": "assistant", "content": "ok \udfff"}]},
                                         tok, eos_ids=EOS, where="f:3"), "f:3")


def test_json_at_the_edges_of_the_parser(tmp_path):
    """Nesting deeper than the parser's recursion (a RecursionError), in a JSONL line and in a JSON array file."""
    deep = "[" * 100_000 + "]" * 100_000
    jsonl = write_lines(tmp_path / "d.jsonl", [json.dumps({"input_ids": [1, 2]}), deep])
    refused(lambda: list(dflash.read_records(jsonl, "data")), "d.jsonl:2")
    array = tmp_path / "a.json"
    array.write_text("[" + deep + "]")
    refused(lambda: list(dflash.read_records(str(array), "data")), "a.json")
    huge = write_lines(tmp_path / "h.jsonl", ['{"input_ids": [1' + "0" * 5000 + "]}"])
    refused(lambda: list(dflash.read_records(huge, "data")), "h.jsonl:1")


@pytest.mark.parametrize("flags", [["--seed", str(2 ** 64)], ["--seed", str(10 ** 30)]])
def test_numbers_at_the_edges_of_a_flags_type(w, capsys, tmp_path, flags):
    """A value its flag's rule accepts but the computation it feeds cannot hold (a seed beyond 64 bits)."""
    out = tmp_path / "o"
    try:
        dflash.main(w["base"] + ["--out", str(out), "--max_steps", "1"] + flags)
    except SystemExit as e:
        assert e.code == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(err) == 1 and flags[0] in err[0], err


@pytest.mark.parametrize("flags", [["--dtype", "fp16"], ["--dtype", "bf16"], ["--attention", "flex"]])
def test_dtype_and_attention_the_cpu_cannot_train_with(w, capsys, tmp_path, flags):
    """Choices that end in a traceback on the CPU: they train, or one line naming the flag, before any weights."""
    try:
        dflash.main(w["base"] + ["--out", str(tmp_path / "o"), "--max_steps", "1"] + flags)
    except SystemExit as e:
        assert e.code == 2
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert len(err) == 1 and flags[0] in err[0], err


def test_tracker_directory_that_cannot_be_written(w, capsys, tmp_path, monkeypatch):
    """TensorBoard's log directory in the way (a file where <out>/tensorboard goes): one line, not a traceback.
    The package is stood in for (as the real SummaryWriter, it creates its directory)."""
    import types
    fake = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, logdir, **kw):
            os.makedirs(logdir, exist_ok=True)

        def add_text(self, *a, **k):
            pass
    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    out = tmp_path / "o"
    out.mkdir()
    (out / "tensorboard").write_text("in the way")
    fails_with(capsys, w["base"] + ["--out", str(out), "--report_to", "tensorboard"], "tensorboard")


@pytest.mark.parametrize("name,content", [("target.json", "[1, 2]"), ("target.json", '"x"'),
                                          ("target.json", '{"fingerprint": 7}'), ("config.json", "[]"),
                                          ("config.json", "3")])
def test_checkpoint_side_files_of_the_wrong_json_type(w, trained, capsys, tmp_path, name, content):
    out = copy_run(trained, tmp_path)
    with open(os.path.join(out, "step_2", name), "w") as f:
        f.write(content)
    fails_with(capsys, w["base"] + ["--out", str(tmp_path / "o"), "--init_from", os.path.join(out, "step_2")],
               name)


# -----------------------------------------------------------------------------
# Errors that mislead

def test_target_and_drafter_swapped(w, trained, capsys, tmp_path):
    """A drafter where the target goes, or the target where a drafter goes: said as such, not as layer ids."""
    drafter = os.path.join(trained, "step_2")
    msg = fails_with(capsys, replace(w["base"], "--target", drafter) + ["--out", str(tmp_path / "a")], drafter)
    assert "drafter" in msg and "--target" in msg, msg
    msg = fails_with(capsys, w["base"] + ["--out", str(tmp_path / "b"), "--init_from", w["q3"]], w["q3"])
    assert "not a drafter" in msg or "target" in msg and "drafter" in msg, msg
    assert "layer" not in msg, msg
    prompts = write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7]})])
    msg = one_error(capsys, ev.main, ["--target", drafter, "--drafter", w["q3"], "--prompts", prompts])
    assert "drafter" in msg and "--target" in msg and "layer" not in msg, msg


def test_data_paths_that_mislead(w, capsys, tmp_path):
    """An empty directory, a directory of a datasets save without data, /dev/null, a fifo: said for what they are."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "nosplits").mkdir()
    (tmp_path / "nosplits" / "dataset_dict.json").write_text('{"splits": []}')
    (tmp_path / "nodata").mkdir()
    (tmp_path / "nodata" / "state.json").write_text('{"_data_files": []}')
    os.mkfifo(tmp_path / "fifo")
    for path in (str(empty), str(tmp_path / "nosplits"), str(tmp_path / "nodata"), "/dev/null",
                 str(tmp_path / "fifo")):
        msg = refused(lambda: list(dflash.read_records(path, "data")), path)
        assert "does not exist" not in msg and "index" not in msg, msg
        msg = fails_with(capsys, replace(w["base"], "--data", path) + ["--out", str(tmp_path / "o")], path)
        assert "does not exist" not in msg and "index" not in msg, msg


def test_responses_cut_away_by_max_len_name_it(tmp_path):
    data = write_data(tmp_path / "d.jsonl", 3, prompt=10, response=6)
    refused(lambda: dflash.load_samples(data, None, 8, say=lambda *a: None), "--max_len")


def test_resume_after_adding_dflash2_names_the_flag(w, trained, capsys, tmp_path):
    out = copy_run(trained, tmp_path)
    before = tree_bytes(out)
    msg = fails_with(capsys, w["base"] + ["--out", out, "--resume", "must", "--dflash2"], "drop --variant")
    assert "conv_kernel_size" not in msg, msg
    assert tree_bytes(out) == before


def test_eval_does_not_advise_flags_it_lacks(w, capsys, tmp_path):
    """eval.py advised --mask_token_id (a training flag) for a drafter whose mask token lies outside the vocabulary."""
    z = dict(ZL, V=VOCAB, M=VOCAB + 5, L=4, T=[1, 2])
    path = write_zlab_dir(str(tmp_path / "z"), zlab_config(z), zlab_tensors(z))
    prompts = write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7]})])
    msg = one_error(capsys, ev.main, ["--target", w["q3"], "--drafter", path, "--prompts", prompts], "mask_token_id")
    assert "--mask_token_id" not in msg, msg


def test_fingerprint_does_not_depend_on_the_load_dtype(w, trained, capsys, tmp_path):
    """eval.py --dtype fp16 refused the drafter as trained for another target, naming the same path: fp16-only GPUs
    would meet this on every run."""
    prompts = write_lines(tmp_path / "p.jsonl", [json.dumps({"input_ids": [5, 6, 7, 8]})])
    drafter = os.path.join(trained, "step_2")
    for dtype in ("fp16", "bf16"):
        try:
            ev.main(["--target", w["q3"], "--drafter", drafter, "--prompts", prompts, "--max_new_tokens", "4",
                     "--no_progress", "--dtype", dtype])
        except SystemExit:
            pass
        err = capsys.readouterr().err
        assert "was trained against" not in err, err


def test_config_torch_dtype_another_trainer_wrote(tmp_path):
    """One trainer exports "torch_dtype": "None" (others: null, "auto", a dtype transformers does not know): the
    field is informational to us; the drafter loads."""
    for i, value in enumerate(("None", None, "auto", "float8_e4m3fn", "fp16")):
        path = write_zlab_dir(str(tmp_path / f"z{i}"), zlab_config(torch_dtype=value), zlab_tensors())
        assert dflash.load_drafter(path).cfg.hidden_size == ZL["D"]


# -----------------------------------------------------------------------------
# The newcomer's start

def test_held_out_continuations_are_announced(w, capsys, tmp_path):
    """~100 s of silence at every start while the held-out continuations were generated: a line says what and how
    many, before."""
    argv = replace(w["base"], "--eval_fraction", "0.5") + ["--out", str(tmp_path / "o"), "--max_steps", "1",
                                                            "--eval_walk_prompts", "2", "--eval_walk_tokens", "4"]
    dflash.main(argv)
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if "generating" in x), None)
    assert line and "continuations of 2 held-out prompts" in line, out
    assert out.index(line) < out.index("step 0:"), out


def test_pretraining_lines_have_a_total_and_an_eta():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from dflash_tools import tiny_target
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    lines = []
    tiny_target.pretrain(model, torch.randint(0, VOCAB, (400,)), 3, batch_size=2, seq_len=16, log=lines.append)
    assert lines and all("/3" in x and "ETA" in x for x in lines), lines


def test_kernel_warnings_only_when_true_and_actionable(tmp_path, capfd):
    """On the CPU the linear-attention kernels cannot run anyway (triton is GPU-only): no note, however many loads."""
    path = tiny_qwen35(tmp_path / "h")
    capfd.readouterr()
    for _ in range(2):
        dflash.load_target(path)
    err = capfd.readouterr().err
    assert "flash-linear-attention" not in err and "fast path" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupted_run_exits_non_zero_and_is_resumable(w, capsys, tmp_path, sig):
    """Ctrl-C or SIGTERM ended with exit 0 (a scheduler reads that as done): 128 + signal, after the checkpoint."""
    step = signalling_step(sig)
    out = str(tmp_path / "o")
    mp = pytest.MonkeyPatch()
    mp.setattr(dflash, "train_step", step)
    try:
        with pytest.raises(SystemExit) as e:
            dflash.main(w["base"] + ["--out", out, "--max_steps", "6"])
    finally:
        mp.undo()
    assert e.value.code == 128 + sig
    assert open(os.path.join(out, "latest")).read().strip() == "step_2"
    dflash.main(w["base"] + ["--out", out, "--max_steps", "6", "--resume", "must"])
    assert "resumed from" in capsys.readouterr().out


def test_help_shows_defaults_that_are_zero():
    for parser in (dflash.get_parser(), ev.get_parser()):
        for a in parser._actions:
            if a.option_strings and type(a.default) in (int, float) and a.default == 0 and a.help:
                assert "default" in parser._get_formatter()._get_help_string(a), a.option_strings
