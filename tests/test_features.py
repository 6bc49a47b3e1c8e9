"""Captured features (dflash_tools/features.py): the capture's files and manifest, training from them equal to online
training (DFlash, DFlash2, D-PACE; noise, held-out loss and walked tau, resume, 2 ranks), the hybrid run, the memory
without the target's layers, and every bad input refused in one line."""
import errno
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, SMALL, fails_with, replace, tiny_qwen3, torch_threads, write_data

import dflash
from dflash_tools import features

LAYERS = "0,1,2"  # captured; the drafters below read 0,2 (a subset) or all three
WALK = ["--eval_walk_prompts", "4", "--eval_walk_tokens", "12", "--eval_fraction", "0.4"]
# captures pass the target 2 rows of 24 tokens at a time, as training (RUN's --batch_size 2) and its held-out eval do:
# a run from them repeats online training's computation, so it is compared bitwise; a pass of another shape (a row
# alone, other padding) is equal in exact arithmetic, not in the last bit on every CPU, and compared within NEAR
SAME_SHAPES = ["--batch_size", "2"]
NEAR = dict(rtol=1e-5, atol=1e-6)
RUN = [*replace(replace(SMALL, "--eval_fraction", "0.4"), "--target_layer_ids", "0,2"), "--eval_walk_prompts", "4",
       "--eval_walk_tokens", "12", "--eval_every", "2", "--max_steps", "4", "--batch_size", "2", "--grad_accum", "2",
       "--no_progress"]
DFLASH2 = ["--dflash2", "--selector_rank", "4", "--selector_top_k", "4", "--conv_group_size", "8"]


def capture(target, data, out, *extra, layers=LAYERS):
    with torch_threads(1):
        features.main(["capture", "--target", target, "--data", data, "--out", str(out), "--target_layer_ids", layers,
                       *WALK, *SAME_SHAPES, *extra])
    return str(out)


def records(out):
    """metrics.jsonl without the wall-clock and memory figures."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "peak_mb")} for line in f]


def weights(out):
    with open(os.path.join(out, "latest")) as f:
        return dflash.read_safetensors(os.path.join(out, f.read().strip()))


def train(out, *argv):
    with torch_threads(1):
        dflash.main([*argv, "--out", str(out)])
    return str(out)


@pytest.fixture(scope="module")
def cap(tmp_path_factory):
    d = tmp_path_factory.mktemp("features")
    q3 = tiny_qwen3(d / "q3")
    data = write_data(d / "data.jsonl", 40)
    return {"dir": d, "q3": q3, "data": data, "fp32": capture(q3, data, d / "fp32", "--features_dtype", "fp32"),
            "base": ["--target", q3, "--data", data, *RUN]}


def test_capture_holds_the_targets_features_labels_and_walk(cap):
    """Each sample file: the tokens, mask, the target's h[t] of the captured layers (hidden_states[t + 1]) and its
    greedy labels, equal to a direct pass; the walk files: the target's greedy continuation of each held-out prompt
    and its features; the manifest states the target record, layers, convention, counts and the data's digest."""
    m = json.load(open(os.path.join(cap["fp32"], "manifest.json")))
    samples = dflash.load_samples(cap["data"], None, 3072, say=lambda *a: None)
    assert m["complete"] and m["num_samples"] == 40 and m["num_tokens"] == sum(len(i) for i, _ in samples)
    assert m["target_layer_ids"] == [0, 1, 2] and "after decoder layer t" in m["layer_convention"]
    assert m["data"] == dflash.path_digest(cap["data"]) and m["dtype"] == "fp32" and m["walk"]["prompts"] == 4
    target = dflash.load_target(cap["q3"])
    assert m["target"] == dflash.target_record(target)
    store = features.Features(cap["fp32"])
    assert len(store) == 40
    for i in (0, 17, 39):
        s, (ids, mask) = store.sample(i), samples[i]
        x = torch.tensor([ids])
        out = target.model(x, output_hidden_states=True)
        want = torch.cat([out.hidden_states[t + 1][0] for t in (0, 1, 2)], -1)
        assert s["input_ids"].tolist() == ids and s["loss_mask"].tolist() == [bool(v) for v in mask]
        torch.testing.assert_close(s["features"], want, **NEAR)  # a row alone: another shape than the capture's
        assert s["labels"][0] == -1 and torch.equal(s["labels"][1:], out.logits[0, :-1].argmax(-1))
    assert len(store.prompts) == 4
    for p in store.prompts.values():
        w = store.read(p)
        n = int(w["prompt_len"])
        cont = dflash.greedy_continuation(target, w["input_ids"][:n].tolist(), 12, target.eos_ids())
        assert w["input_ids"][n:].tolist() == cont


def test_bytes_per_token_and_disk_line(cap, capsys, tmp_path):
    """Printed before the capture: bytes a token (the formula m x D x 2 in bf16 plus 9), the total and free space;
    the files hold that much (plus a header each)."""
    out = capture(cap["q3"], cap["data"], tmp_path / "bf16")
    said = capsys.readouterr().out
    assert f"{features.bytes_per_token(3, 32, 'bf16'):,} bytes/token" in said and "free" in said
    assert features.bytes_per_token(3, 32, "bf16") == 3 * 32 * 2 + 9
    m = json.load(open(os.path.join(out, "manifest.json")))
    size = sum(os.path.getsize(os.path.join(out, "rank000", n)) for n in os.listdir(os.path.join(out, "rank000"))
               if n.startswith("s"))
    tensors = m["num_tokens"] * features.bytes_per_token(3, 32, "bf16")
    assert tensors < size < tensors + 40 * features.FILE_OVERHEAD


@pytest.mark.parametrize("flags", [[], DFLASH2, ["--loss", "dpace"]], ids=["dflash", "dflash2", "dpace"])
def test_training_from_fp32_features_equals_online(cap, tmp_path, flags):
    """Same seed and steps, context noise on, held-out loss and walked tau at steps 0, 2, 4: fp32 features give the
    same metrics and the same weights as online training, bitwise (a dense target, passed the same shapes: the same
    computation)."""
    online = train(tmp_path / "online", *cap["base"], *flags)
    feats = train(tmp_path / "feats", *cap["base"], *flags, "--features", cap["fp32"])
    a, b = records(online), records(feats)
    assert a == b and [r["step"] for r in a if "eval_walk_tau" in r] == [0, 2, 4]
    assert all(r["eval_walk_tau"] is not None for r in a if "eval_loss" in r)
    assert a[1]["loss"] != a[-2]["loss"]  # it trained
    wa, wb = weights(online), weights(feats)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_data_of_the_targets_own_continuations(cap, tmp_path):
    """Data regenerated by the target (the paper's recipe): a held-out sample is then token for token a walk file's
    prompt + continuation; its labels still come from its sample file, and training equals online training."""
    target = dflash.load_target(cap["q3"])
    g = torch.Generator().manual_seed(3)
    with open(tmp_path / "regen.jsonl", "w") as f:
        for _ in range(60):
            p = torch.randint(3, 90, (6,), generator=g).tolist()
            c = dflash.greedy_continuation(target, p, 12, target.eos_ids())
            if 95 not in c:  # (the mask token)
                    f.write(json.dumps({"input_ids": p + c, "loss_mask": [0] * 6 + [1] * len(c)}) + "\n")
    data = str(tmp_path / "regen.jsonl")
    feats = capture(cap["q3"], data, tmp_path / "f", "--features_dtype", "fp32")
    base = replace(cap["base"], "--data", data)
    online, feats = records(train(tmp_path / "online", *base)), records(train(tmp_path / "feats", *base, "--features",
                                                                               feats))
    assert near(online, feats)  # rows cut at eos: other padding in the capture's batches than in training's


def near(a, b):
    """Records equal but for fp32 rounding in their numbers (NEAR), the rest exactly."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(near(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(near, a, b))
    return b == pytest.approx(a, rel=NEAR["rtol"], abs=NEAR["atol"]) if isinstance(a, float) else a == b


def test_resume_from_an_online_checkpoint_with_features(cap, tmp_path):
    """An online run's step-2 checkpoint, continued with --features --resume, reaches the online run's step 4."""
    online = train(tmp_path / "online", *cap["base"], "--save_every", "2")
    out = tmp_path / "resumed"
    os.makedirs(out)
    shutil.copytree(os.path.join(online, "step_2"), out / "step_2")
    shutil.copy(os.path.join(online, "metrics.jsonl"), out / "metrics.jsonl")
    (out / "latest").write_text("step_2\n")
    train(out, *cap["base"], "--save_every", "2", "--features", cap["fp32"], "--resume")
    assert records(out) == records(online)
    wa, wb = weights(online), weights(str(out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


WORKER = r"""
import json, sys
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import dflash
from dflash_tools import features
dist.init_process_group("gloo")
dist.destroy_process_group = lambda *a, **k: None  # several commands in one process group
for kind, argv in json.loads(sys.argv[2]):
    (features.main if kind == "capture" else dflash.main)(argv)
"""


def test_two_ranks_capture_and_train_like_two_ranks_online(cap, tmp_path):
    """One torchrun --nproc_per_node=2 (gloo): a capture split over the ranks (each rank's files in its own folder)
    holds the one-process capture's tensors; training from it on 2 ranks, and a hybrid run capturing as it goes on
    2 ranks, equal online training on 2 ranks."""
    two = str(tmp_path / "two")
    cmds = [("capture", ["capture", "--target", cap["q3"], "--data", cap["data"], "--out", two, "--target_layer_ids",
                         LAYERS, "--features_dtype", "fp32", *WALK, *SAME_SHAPES])]
    outs = {name: str(tmp_path / name) for name in ("online", "feats", "hybrid")}
    cmds += [("train", [*cap["base"], "--grad_accum", "1", *extra, "--out", outs[name]]) for name, extra in (
        ("online", []), ("feats", ["--features", two]), ("hybrid", ["--features", str(tmp_path / "h"),
                                                                     "--capture_missing"]))]
    (tmp_path / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(29500 + random.randrange(2000)), str(tmp_path / "worker.py"), ROOT, json.dumps(cmds)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = features.Features(two), features.Features(cap["fp32"])
    assert sorted(os.listdir(two)) == ["manifest.json", "rank000", "rank001"] and a.manifest["complete"]
    assert sum(n.startswith("s") for n in os.listdir(os.path.join(two, "rank001"))) == 20
    assert len(a) == 40 and all(torch.equal(a.sample(i)["features"], b.sample(i)["features"]) for i in range(40))
    assert records(outs["online"]) == records(outs["feats"]) == records(outs["hybrid"])
    wa, wb, wh = weights(outs["online"]), weights(outs["feats"]), weights(outs["hybrid"])
    assert all(torch.equal(wa[k], wb[k]) and torch.equal(wa[k], wh[k]) for k in wa)
    assert sorted(os.listdir(tmp_path / "h")) == ["manifest.json", "rank000", "rank001"]


def test_hybrid_captures_in_the_first_epoch_then_reads(cap, tmp_path, capsys):
    """--capture_missing from an empty directory, two epochs: the run captures each sample as a batch first meets it
    (and the walk), reads it in the second epoch, with the losses of online training; the capture command then
    finds nothing left but to mark it complete, and a --features run reads it alone with the same losses again."""
    feats, base = str(tmp_path / "hybrid"), replace(cap["base"], "--max_steps", "12")  # 6 steps an epoch
    online = train(tmp_path / "online", *base)
    hybrid = train(tmp_path / "h", *base, "--features", feats, "--capture_missing")
    assert records(hybrid) == records(online)
    with torch_threads(1):  # the capture command finds nothing left to do and marks it complete
        features.main(["capture", "--target", cap["q3"], "--data", cap["data"], "--out", feats, "--target_layer_ids",
                       "0,2", "--features_dtype", "fp32", *WALK])
    assert json.load(open(os.path.join(feats, "manifest.json")))["complete"]
    assert "captured 0 tokens" in capsys.readouterr().out
    after = train(tmp_path / "after", *base, "--features", feats)
    assert records(after) == records(online)


def test_rerun_continues_and_disk_full_leaves_no_partial_file(cap, tmp_path, monkeypatch, capsys):
    """A full disk at the 5th file: one error line, no partial or temporary file; the rerun writes only what is
    missing and the capture equals an uninterrupted one."""
    out = tmp_path / "enospc"
    real, calls = os.fsync, []

    def full(fd):
        calls.append(fd)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)
    monkeypatch.setattr(features.os, "fsync", full)
    with pytest.raises(SystemExit):
        capture(cap["q3"], cap["data"], out, "--features_dtype", "fp32")
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and "disk is full" in err and "rerun" in err
    files = os.listdir(out / "rank000")
    assert 0 < sum(n.endswith(".safetensors") for n in files) < 5 and not [n for n in files if ".tmp" in n]
    assert all(len(features.Features(str(out)).read(os.path.join(out, "rank000", n))["input_ids"])
               for n in files if n.endswith(".safetensors"))
    monkeypatch.setattr(features.os, "fsync", real)
    capture(cap["q3"], cap["data"], out, "--features_dtype", "fp32")
    a, b = features.Features(str(out)), features.Features(cap["fp32"])
    total = a.manifest["num_tokens"] + sum(len(a.read(p)["input_ids"]) for p in a.prompts.values())
    done = int(capsys.readouterr().out.split("captured ")[1].split(" tokens")[0].replace(",", ""))
    assert 0 < done < total  # the rerun wrote only the missing files
    assert len(a) == 40 and all(torch.equal(a.sample(i)["features"], b.sample(i)["features"]) for i in range(40))


def test_bf16_and_int8_features_are_near_fp32(cap, tmp_path):
    """bf16 and int8 (a scale per token and layer) features round h[t] by at most 2^-8 and 1/254 of its largest
    entry; a run from them trains to nearly the fp32 run's losses."""
    fp32 = features.Features(cap["fp32"])
    for dtype, tol in (("bf16", 2 ** -8), ("int8", 1 / 254 + 1e-6)):
        d = features.Features(capture(cap["q3"], cap["data"], tmp_path / dtype, "--features_dtype", dtype))
        for i in (0, 5):
            x, y = fp32.sample(i)["features"], d.sample(i)["features"]
            scale = x.unflatten(-1, (3, -1)).abs().amax(-1, keepdim=True) if dtype == "int8" else x.abs()
            assert ((x - y).unflatten(-1, (3, -1)).abs() <= tol * scale.unflatten(-1, (3, -1)) + 1e-7
                    if dtype == "bf16" else (x - y).unflatten(-1, (3, -1)).abs() <= tol * scale + 1e-7).all()
            assert torch.equal(d.sample(i)["labels"], fp32.sample(i)["labels"])


# -----------------------------------------------------------------------------
# Bad input: one line naming the mismatch and its fix

def test_features_of_another_target_refused(cap, capsys, tmp_path):
    other = tiny_qwen3(tmp_path / "other", initializer_range=0.05)
    fails_with(capsys, [*replace(cap["base"], "--target", other), "--features", cap["fp32"], "--out",
                        str(tmp_path / "o")], "captured from target", "recapture")


def test_layers_not_captured_refused(cap, capsys, tmp_path):
    d = capture(cap["q3"], cap["data"], tmp_path / "f", layers="0,2")
    fails_with(capsys, [*replace(cap["base"], "--target_layer_ids", "1,2"), "--features", d, "--out",
                        str(tmp_path / "o")], "no layer 1", "--target_layer_ids")


@pytest.mark.parametrize("field,needle", [("chat_template", "another chat template"),
                                          ("tokenizer", "another tokenizer")])
def test_other_template_or_tokenizer_refused(cap, capsys, tmp_path, field, needle):
    d = str(tmp_path / "copy")
    shutil.copytree(cap["fp32"], d)
    m = json.load(open(os.path.join(d, "manifest.json")))
    m[field] = "0123456789abcdef"
    json.dump(m, open(os.path.join(d, "manifest.json"), "w"))
    fails_with(capsys, [*cap["base"], "--features", d, "--out", str(tmp_path / "o")], needle, "recapture")


def test_other_data_refused(cap, capsys, tmp_path):
    data = write_data(tmp_path / "other.jsonl", 40, seed=5)
    fails_with(capsys, [*replace(cap["base"], "--data", data), "--features", cap["fp32"], "--out",
                        str(tmp_path / "o")], "other data than --data", "recapture")


def test_truncated_sample_file_named(cap, capsys, tmp_path):
    d = str(tmp_path / "copy")
    shutil.copytree(cap["fp32"], d)
    victim = os.path.join(d, "rank000", "s00000003.safetensors")
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    fails_with(capsys, [*cap["base"], "--features", d, "--out", str(tmp_path / "o"), "--epochs", "1",
                        "--max_steps", "0"], "s00000003.safetensors", "unreadable", "rerun the capture")


def test_sample_whose_tokens_disagree_refused(cap, capsys, tmp_path):
    """A file whose tokens are not the ones its index names (edited, or a collision) is refused when read."""
    d = str(tmp_path / "copy")
    shutil.copytree(cap["fp32"], d)
    from safetensors.torch import load_file, save_file
    victim = os.path.join(d, "rank000", "s00000003.safetensors")
    t = load_file(victim)
    t["input_ids"] = t["input_ids"].flip(0).contiguous()
    save_file(t, victim)
    fails_with(capsys, [*cap["base"], "--features", d, "--out", str(tmp_path / "o"), "--epochs", "1",
                        "--max_steps", "0"], "s00000003.safetensors", "tokens disagree")


def test_incomplete_capture_refused_unless_hybrid(cap, capsys, tmp_path):
    d = str(tmp_path / "copy")
    shutil.copytree(cap["fp32"], d)
    m = json.load(open(os.path.join(d, "manifest.json")))
    m["complete"] = False
    json.dump(m, open(os.path.join(d, "manifest.json"), "w"))
    fails_with(capsys, [*cap["base"], "--features", d, "--out", str(tmp_path / "o")], "incomplete",
               "--capture_missing")


def test_capture_refuses_when_the_disk_cannot_hold_it(cap, capsys, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(features.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(SystemExit):
        capture(cap["q3"], cap["data"], tmp_path / "small")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "GB free" in err[0]
    assert not os.path.exists(tmp_path / "small" / "rank000")


# -----------------------------------------------------------------------------
# Memory: the target's layers never load

BIG = dict(intermediate_size=32768, num_hidden_layers=8)  # 8 x 3 x 32 x 32768 = 25M decoder params: 96 MiB in fp32


PEAK = """
import sys
sys.path.insert(0, sys.argv[1])
import dflash
dflash.main(sys.argv[2:])
print([line for line in open("/proc/self/status") if line.startswith("VmHWM")][0])
"""


def peak_mb(argv):
    """A training run in its own process: its peak resident memory in MiB (VmHWM: this process's own, where
    getrusage's maxrss keeps the forking parent's high-water mark across exec)."""
    p = subprocess.run([sys.executable, "-c", PEAK, ROOT, *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return int(p.stdout.split("VmHWM:")[1].split()[0]) / 1024


def test_features_run_peaks_near_the_drafter_alone(cap, tmp_path):
    """A target whose decoder layers (96 MiB) dwarf the drafter (0.02M params): training from its features peaks
    within a few MB of the same run over a 4-layer target of the same width (the drafter, embedding and lm_head
    alone), while online training peaks higher by about the layers' size. The plan says the same."""
    from dflash_tools import plan
    big = tiny_qwen3(tmp_path / "big", **BIG)
    layer_mb = 8 * 3 * 32 * 32768 * 4 / 2 ** 20
    flags = [*replace(RUN, "--eval_walk_prompts", "0"), "--max_steps", "2", "--intermediate_size", "64"]  # not 32768
    peaks = {}
    for name, target in (("big", big), ("small", cap["q3"])):
        f = capture(target, cap["data"], tmp_path / f"f_{name}", "--eval_walk_prompts", "0")
        peaks[name] = peak_mb(["--target", target, "--data", cap["data"], *flags, "--features", f, "--out",
                               str(tmp_path / f"run_{name}")])
    peaks["online"] = peak_mb(["--target", big, "--data", cap["data"], *flags, "--out", str(tmp_path / "online")])
    assert abs(peaks["big"] - peaks["small"]) < 0.05 * layer_mb, (peaks, layer_mb)
    assert peaks["online"] - peaks["big"] > layer_mb, (peaks, layer_mb)
    print(f"peak resident memory (MiB): features, big target {peaks['big']:.0f}; features, 4-layer target "
          f"{peaks['small']:.0f}; online, big target {peaks['online']:.0f}; its layers {layer_mb:.0f}")
    meta = dflash.load_target(big, "meta")
    t = plan.target_sizes(meta, 2)
    d = {"params": 20000, **{k: 32 for k in ("hidden_size", "intermediate_size")}, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "block_size": 4, "layer_kinds": [1, 0],
         "context_layers": 2}
    run = {"world": 1, "zero": False, "grad_checkpoint": False, "num_anchors": 6, "batch_size": 2, "max_len": 24,
           "attention": "dense", "target_bytes": 4, "act_bytes": 4}
    online, feats = (dict((n, v) for n, v, _ in plan.plan_rows(t, d, {**run, "features": f})) for f in (False, True))
    assert feats["target weights"] == t["io_params"] * 4 == 2 * 96 * 32 * 4
    assert online["peak per rank"] - feats["peak per rank"] >= t["decoder_params"] * 4


def test_capture_missing_without_features_refused(cap, capsys, tmp_path):
    fails_with(capsys, [*cap["base"], "--capture_missing", "--out", str(tmp_path / "o")],
               "unknown flag --capture_missing", "need their --variant/--loss/--stage/--features")


def test_another_trainers_dump_through_the_reader_interface(cap, tmp_path, monkeypatch, capsys):
    """A dump that is not ours goes through dflash_tools/dumps.py's open_dump(path, layer_ids, **dump_kw) ->
    .manifest, len(), .sample(i); rows are found by their tokens (any order): here a reader serving our capture's
    samples in reverse trains like online (no walk: it holds none, refused in one line unless --eval_walk_prompts 0)."""
    import types
    asked = []

    class Reader:
        def __init__(self, path, layer_ids, **kw):
            self.inner, self.manifest = features.Features(cap["fp32"], layer_ids), {"target_layer_ids": layer_ids}
            asked.append((path, layer_ids, kw))

        def __len__(self):
            return len(self.inner)

        def sample(self, i):
            t = self.inner.sample(len(self.inner) - 1 - i)
            return {k: t[k] for k in ("input_ids", "loss_mask", "features", "labels")}
    fake = types.SimpleNamespace(open_dump=Reader, add_flags=lambda g: None)
    monkeypatch.setitem(sys.modules, "dflash_tools.dumps", fake)
    monkeypatch.setattr(sys.modules["dflash_tools"], "dumps", fake, raising=False)  # (imported by an earlier test)
    os.makedirs(tmp_path / "dump")
    base = replace(cap["base"], "--eval_walk_prompts", "0")
    fails_with(capsys, [*cap["base"], "--features", str(tmp_path / "dump"), "--out", str(tmp_path / "x")],
               "no held-out walks", "--eval_walk_prompts 0")
    online = train(tmp_path / "online", *base)
    assert records(train(tmp_path / "dumped", *base, "--features", str(tmp_path / "dump"))) == records(online)
    assert asked[-1][1] == [0, 2]
    kw = asked[-1][2]  # what dumps.open_dump is given: the target's config, lm_head and final norm, the dump's flags
    assert kw["labels"] and kw["dump_layer_ids"] is None
    assert kw["target_config"].hidden_size == kw["norm"].weight.numel()


@pytest.mark.parametrize("kind", ["llama_tied", "qwen35_multimodal"])
def test_tied_and_multimodal_targets_from_features(cap, tmp_path, kind):
    """A tied target (Llama-3.2-like: no lm_head tensor in its safetensors; the embedding serves as both, the new
    drafter's norm starts off the mask row as online) trains equal to online training; Qwen3.5's multimodal checkpoint
    (its tensors under model.language_model.) too, to fp32 rounding (its Gated-DeltaNet scan rounds differently
    padded: ~4e-9)."""
    from conftest import tiny_family, tiny_qwen35_multimodal
    target = tiny_family(tmp_path / "t", kind) if kind == "llama_tied" else tiny_qwen35_multimodal(tmp_path / "t")
    feats = capture(target, cap["data"], tmp_path / "f", "--features_dtype", "fp32")
    base = replace(cap["base"], "--target", target)
    a, b = records(train(tmp_path / "online", *base)), records(train(tmp_path / "feats", *base, "--features", feats))
    if kind == "llama_tied":
        assert a == b
    assert [sorted(r) for r in a] == [sorted(r) for r in b]
    for x, y in zip(a, b):
        for k in ("loss", "eval_loss", "eval_walk_tau", "tau"):
            assert x.get(k) == pytest.approx(y.get(k), abs=1e-5), (x["step"], k)


def test_a_killed_capture_leaves_nothing_a_reader_trusts(cap, capsys, tmp_path):
    """What a kill leaves (a half-written .tmp file, a torn last index line, a file the index lacks) is ignored or
    indexed from its own header; a rerun clears the .tmp file; a rerun with other flags is refused in one line."""
    d = str(tmp_path / "copy")
    shutil.copytree(cap["fp32"], d)
    rank = os.path.join(d, "rank000")
    with open(os.path.join(rank, "s00000005.safetensors.tmp999"), "wb") as f:
        f.write(b"garbage")
    lines = open(os.path.join(rank, "index.jsonl")).read().splitlines()
    with open(os.path.join(rank, "index.jsonl"), "w") as f:  # sample 7's line lost, and a torn line at the end
        f.write("\n".join(x for x in lines if '"s00000007' not in x) + '\n{"name": "s000')
    store = features.Features(d)
    assert len(store) == 40 and torch.equal(store.sample(7)["features"], features.Features(cap["fp32"]).sample(7)[
        "features"])
    capture(cap["q3"], cap["data"], d, "--features_dtype", "fp32")
    assert not [n for n in os.listdir(rank) if ".tmp" in n]
    with pytest.raises(SystemExit):
        capture(cap["q3"], cap["data"], d)  # bf16 into an fp32 capture
    err = [x for x in capsys.readouterr().err.strip().splitlines() if x.startswith("error:")]
    assert len(err) == 1 and "another dtype" in err[0] and "new --out" in err[0]


KL_LOSS = '''import dflash


class ForwardKL(dflash.CE):
    target_logits = True

    def token_loss(self, logits, labels, target_logits):
        logp = target_logits.log_softmax(-1)
        return (logp.exp() * (logp - logits.log_softmax(-1))).sum(-1)


LOSSES = {"fkl": lambda args: ForwardKL()}
'''


def test_a_loss_on_the_targets_distribution_needs_the_stored_final_state(cap, tmp_path, capsys):
    """A --loss that asks for the target's logits reads f from the capture: refused in one line where it was not stored
    (it would read the labels in its place), and with --store_final equal to online training."""
    (tmp_path / "kl.py").write_text(KL_LOSS)
    base = [*cap["base"], "--loss", f"{tmp_path / 'kl.py'}:fkl"]
    fails_with(capsys, [*base, "--features", cap["fp32"], "--out", str(tmp_path / "x")], "needs the target's "
               "distribution", "--store_final")
    final = capture(cap["q3"], cap["data"], tmp_path / "final", "--features_dtype", "fp32", "--store_final")
    assert records(train(tmp_path / "feats", *base, "--features", final)) == records(train(tmp_path / "online", *base))
