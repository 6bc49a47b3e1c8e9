"""The training loop: a kill during a save, learning, config derivation, checkpoints (DDP equivalence: test_shard;
SIGTERM and --resume: test_standalone)."""
import json
import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import dflash
import eval as ev
from conftest import ROOT, SMALL, tiny_qwen3, tiny_qwen35, torch_threads, write_data


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    return {"dir": d, "q3": tiny_qwen3(d / "q3"), "data": write_data(d / "data.jsonl", 32)}


def losses(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def final_weights(out):
    with open(os.path.join(out, "latest")) as f:
        return load_file(os.path.join(out, f.read().strip(), "model.safetensors"))


def run_cli(args):
    """dflash.py's command line in this process, on 1 thread (like the OMP_NUM_THREADS=1 subprocesses: the same
    numbers, without another interpreter start-up). Two ranks: tests/test_shard.py, tests/test_standalone.py."""
    with torch_threads(1):
        dflash.main(args)


def test_killed_during_save_keeps_latest_complete(workdir, tmp_path):
    """SIGKILL while writing a checkpoint: latest still names the previous complete checkpoint, which resumes."""
    out = tmp_path / "killed"
    script = f"""
import os, signal, sys, torch
sys.path.insert(0, {ROOT!r})
import dflash
real_save, calls = torch.save, []
def dying_save(obj, f, *a, **k):
    calls.append(f)
    if len(calls) == 2:  # the second checkpoint: die halfway through writing it
        with open(f, "wb") as fh:
            fh.write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *a, **k)
torch.save = dying_save
dflash.main({["--target", workdir["q3"], "--data", workdir["data"], "--max_steps", "6", "--batch_size", "4",
              *SMALL[:-4], "--save_every", "2", "--eval_fraction", "0", "--out", str(out)]!r})
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    with open(out / "latest") as f:
        assert f.read().strip() == "step_2"
    assert not (out / "step_4").exists()
    state = torch.load(out / "step_2" / "train_state.pt", weights_only=True)
    assert state["step"] == 2
    dflash.load_drafter(str(out / "step_2"))
    run_cli(["--target", workdir["q3"], "--data", workdir["data"], "--max_steps", "6", "--batch_size", "4",
             *SMALL, "--out", str(out), "--resume"])
    with open(out / "latest") as f:
        assert f.read().strip() == "step_6"


def test_twenty_steps_on_hybrid_target_learn(tmp_path):
    """Twenty steps on a tiny Qwen3.5 hybrid target lower the held-out loss and raise the tau estimate."""
    # initializer_range 0.2: a larger lm_head scale, so confident logits are reachable
    target = tiny_qwen35(tmp_path / "q35", initializer_range=0.2)
    data = write_data(tmp_path / "d.jsonl", 96, seed=1)
    out = tmp_path / "out"
    args = dflash.get_parser().parse_args(
        ["--target", target, "--data", data, "--out", str(out), "--max_steps", "20", "--batch_size", "4",
         "--grad_accum", "1", "--labels", "data", *SMALL[:-6], "--eval_every", "0", "--save_every", "0",
         "--eval_fraction", "0.25", "--lr", "1e-2", "--eval_walk_prompts", "6", "--eval_walk_tokens", "16"])
    drafter, _, tgt = dflash.train(args)
    with open(out / "metrics.jsonl") as f:
        evals = [r for r in map(json.loads, f) if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 20
    assert last["eval_loss"] < first["eval_loss"] - 1.0, evals  # measured here: 5.61 -> 1.59
    assert last["eval_tau"] > first["eval_tau"] + 0.5, evals    # measured here: 1.00 -> 2.29
    assert all(r["eval_walk_tau"] >= 1 for r in evals), evals  # (--labels data: the drafter learns the data, not
    # the random target's own continuations, so the walked tau need not rise here)
    # the walked tau of the last eval == eval.py's pooled tau of the final checkpoint on the same prompts (the
    # tokens before the first loss token of the first 6 held-out samples) and the same continuation length
    samples = dflash.load_samples(data, tgt.tokenizer, args.max_len, say=lambda *a: None)
    held_out = dflash.split_eval(samples, 0.25, args.seed)[1][:6]
    prompts = [ids[:mask.index(1)] for ids, mask in held_out]
    final = dflash.load_drafter(str(out / "step_20"))
    report = ev.evaluate_drafters(tgt, {"final": final.eval()}, prompts, 16, progress=False)
    assert report["results"][0]["tau"] == pytest.approx(last["eval_walk_tau"], abs=1e-6), (report, evals)
    # measured alike, and so recorded: the same settings and prompts; the same acceptance by block offset
    assert last["measured"] == report["measured"] and last["measured"]["max_new_tokens"] == 16
    assert last["eval_walk_acceptance"] == pytest.approx(report["results"][0]["per_offset_acceptance"], abs=1e-6)
    state = torch.load(out / "step_20" / "train_state.pt", weights_only=True)  # safe-loadable training state
    assert state["step"] == 20 and state["args"]["max_steps"] == 20


def test_default_config_matches_zlab_qwen36_27b():
    """A 64-layer, 5120-wide target with intermediate 17408 and rope_theta 1e7 yields z-lab's geometry."""
    from transformers import Qwen3_5TextConfig
    tc = Qwen3_5TextConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, vocab_size=248320,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                           rms_norm_eps=1e-6, max_position_embeddings=262144)
    fake = dflash.Target(model=SimpleNamespace(config=tc), backbone=SimpleNamespace(layers=[None] * 64), embed=None,
                         lm_head=torch.nn.Linear(5120, 248320, bias=False, device="meta"), tokenizer=None, name="fake")
    args = dflash.get_parser().parse_args(["--mask_token_id", "248070", "--num_heads", "32", "--num_kv_heads", "8",
                                           "--head_dim", "128"])  # z-lab's geometry, not the target's (24 x 256)
    cfg = dflash.new_drafter_config(fake, **{k: getattr(args, k) for k in dflash.DRAFTER_FLAGS})
    assert cfg == dflash.DFlashConfig()  # the dataclass defaults are z-lab's published drafter
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (5120, 5, 32, 8, 128, 17408)
    assert cfg.target_layer_ids == [1, 16, 31, 46, 61] and cfg.num_target_layers == 64
    assert cfg.layer_types == ["sliding_attention"] * 4 + ["full_attention"] and cfg.sliding_window == 2048
    assert [cfg.layer_kind(i)[0] for i in range(5)] == [True] * 4 + [False]
    assert cfg.rope_theta == 1e7 and cfg.rope_scaling is None and cfg.rms_norm_eps == 1e-6
    assert (cfg.block_size, cfg.mask_token_id, cfg.vocab_size) == (16, 248070, 248320)
    assert dflash.expected_shapes(cfg)["fc.weight"] == (5120, 25600)
    n = sum(torch.Size(s).numel() for s in dflash.expected_shapes(cfg).values())
    assert 1.70e9 < n < 1.76e9
    j = dflash.config_to_json(cfg)
    assert j["architectures"] == ["DFlashDraftModel"] and j["block_size"] == 16 and j["num_target_layers"] == 64
    assert j["dflash_config"]["mask_token_id"] == 248070 and j["dflash_config"]["target_layer_ids"] == [1, 16, 31, 46, 61]
    assert "partial_rotary_factor" not in json.dumps(j)  # the target's 0.25 never reaches the drafter's config
    assert j["layer_types"] == cfg.layer_types and j["sliding_window"] == 2048


def test_lr_schedule():
    lrs = [dflash.lr_at(s, 100, 1.0, 0.04) for s in range(100)]
    assert lrs[0] == pytest.approx(0.25) and lrs[3] == pytest.approx(1.0)  # 4 warmup steps
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # monotone cosine decay
    assert lrs[-1] < 1e-3 and lrs[51] == pytest.approx(0.5, abs=0.02)


def test_attention_plain_trains_as_dense(workdir, tmp_path, monkeypatch):
    """--attention plain runs Part I's plain attention and plain CE in training and in the held-out walk (a learner
    stepping through a run stays in Part I), and trains as the dense path does: the same losses, eval figures and
    weights within 1e-4 (different kernels: not bitwise)."""
    calls = {"attention": 0, "ce": 0}
    real_attention, real_ce = dflash.plain_attention, dflash.plain_ce

    def counted(name, fn):
        def wrapped(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(dflash, "plain_attention", counted("attention", real_attention))
    monkeypatch.setattr(dflash, "plain_ce", counted("ce", real_ce))
    runs = {}
    for path in ("plain", "dense"):
        out = tmp_path / path
        run_cli(["--target", workdir["q3"], "--data", workdir["data"], "--max_steps", "4", "--batch_size", "2",
                 *SMALL[:-2], "--eval_fraction", "0.5", "--eval_walk_prompts", "2", "--eval_walk_tokens", "6",
                 "--attention", path, "--out", str(out)])
        with open(out / "metrics.jsonl") as f:
            runs[path] = list(map(json.loads, f)), final_weights(out)
        if path == "plain":
            assert calls["attention"] > 0 and calls["ce"] > 4, calls  # 4 steps, and the held-out evaluations
            walk_calls, calls["attention"], calls["ce"] = calls["attention"], 0, 0
    assert calls == {"attention": 0, "ce": 0}, "the dense path ran Part I's plain forms"
    (plain, w_plain), (dense, w_dense) = runs["plain"], runs["dense"]
    assert walk_calls and len(plain) == len(dense) and any("eval_walk_tau" in r for r in plain)
    for a, b in zip(plain, dense):
        for k in ("loss", "tau", "eval_loss", "eval_tau", "eval_walk_tau"):
            assert (k in a) == (k in b) and a.get(k, 0) == pytest.approx(b.get(k, 0), rel=1e-4, abs=1e-4), (k, a, b)
    assert [r["step"] for r in plain if "loss" in r] == [1, 2, 3, 4]
    for k, v in w_plain.items():
        torch.testing.assert_close(v, w_dense[k], atol=1e-4, rtol=1e-4)
