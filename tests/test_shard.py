"""--shard_target: the frozen target's decoder layers split over 2 gloo ranks (FSDP2) give the unsharded run's
features, labels, walk, losses, metrics and weights, also resumed, with an eval set and walk prompts that do not
split evenly over the ranks and greedy continuations that end (eos) at different lengths: nothing hangs.

And plain DDP: 2 ranks equal one process with the same global batch (rows per rank, or gradient accumulation).

One torchrun launch runs every case in sequence (a Python and torch start-up costs more than a tiny run)."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import dflash
from conftest import ROOT, SMALL, tiny_qwen3, tiny_qwen35, torch_threads, write_data

DFLASH2 = ["--dflash2", "--conv_group_size", "4", "--selector_rank", "8", "--selector_top_k", "6",
           "--selector_ramp_ratio", "0.5"]
EVAL_FRACTION, WALK_PROMPTS, WALK_TOKENS = 0.2, 3, 12  # 25 samples: 5 held out (3 + 2 per rank), 3 prompts (2 + 1)

# Run under torchrun: each case in turn in one process group (train() would end it: kept for the next case)
WORKER = r"""
import contextlib, io, json, os, shutil, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import dflash
compile_ = torch.compile  # --compile on: dynamo's eager backend (the CPU cannot afford inductor here)
torch.compile = lambda m, **k: compile_(m, backend="eager")
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
dist.destroy_process_group = lambda *a, **k: None
for case in json.loads(sys.argv[2]):
    kind, out, argv = case["kind"], case["out"], case.get("argv")
    if kind == "resume" and rank == 0:  # a copy of a run as it was after its step-3 checkpoint
        shutil.copytree(case["from"], out, ignore=shutil.ignore_patterns("step_6"))
        with open(os.path.join(out, "latest"), "w") as f:
            f.write("step_3")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            kept = [line for line in f if json.loads(line)["step"] <= 3]
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.writelines(kept)
    dist.barrier()
    if kind == "features":  # the same tensors from a whole and a sharded target, on every rank
        whole, shard = dflash.load_target(case["target"]), dflash.load_target(case["target"], shard=True)
        ids = torch.randint(0, 90, (2, 9 + 3 * rank), generator=torch.Generator().manual_seed(rank))
        (cw, fw), (cs, fs) = (dflash.target_features(t, ids, [1, 3]) for t in (whole, shard))
        _, held = dflash.split_eval(dflash.load_samples(case["data"], None, 3072, say=lambda *a: None), *case["split"])
        walks = [dflash.held_out_walk(t, held, *case["walk"], rank, 2)[1] for t in (whole, shard)]
        res = {"context": torch.equal(cw, cs), "final": torch.equal(fw, fs),
               "labels": torch.equal(dflash.greedy_labels(fw, whole.lm_head), dflash.greedy_labels(fs, shard.lm_head)),
               "walk_whole": walks[0], "walk_shard": walks[1][:len(walks[0])], "extra": walks[1][len(walks[0]):],
               "sharded": type(shard.layers[0].mlp.up_proj.weight).__name__,
               "embed_whole": type(shard.embed.weight).__name__, "tied": shard.embed.weight is shard.lm_head.weight}
        shared = dflash.load_target(case["target"])  # a layer sharing a weight with another cannot be sharded alone
        shared.layers[1].mlp.up_proj.weight = shared.layers[0].mlp.up_proj.weight
        try:
            dflash.import_tool("shard", "test").shard_target(shared, torch.device("cpu"))
        except dflash.DFlashError as e:
            res["shared"] = str(e)
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(res, f)
        continue
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            dflash.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    with open(f"{out}.{rank}.log", "w") as f:
        f.write(f"{code}\n{err.getvalue()}")
"""


def pick_eos(target, data):
    """An eos token that ends the walk prompts' greedy continuations at different lengths (rank 0 walks prompts 0
    and 2, rank 1 prompt 1), so generation stops at different steps on the two ranks."""
    t = dflash.load_target(target)
    _, held_out = dflash.split_eval(dflash.load_samples(data, None, 3072, say=lambda *a: None), EVAL_FRACTION, 0)
    runs = [dflash.greedy_continuation(t, p, WALK_TOKENS, set()) for p in dflash.walk_prompts(held_out, WALK_PROMPTS)]
    for tok in runs[0][1:]:
        ends = [r.index(tok) if tok in r else len(r) for r in runs]
        if ends[0] < WALK_TOKENS - 1 and ends[1] != ends[0]:
            return tok, ends
    raise AssertionError(f"no eos candidate ends the walk at different lengths: {runs}")


def with_eos(path, eos):
    from transformers import GenerationConfig
    g = GenerationConfig.from_pretrained(path)
    g.eos_token_id = eos
    g.save_pretrained(path)
    return path


def final_weights(out):
    with open(os.path.join(out, "latest")) as f:
        return load_file(os.path.join(out, f.read().strip(), "model.safetensors"))


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "peak_mb")} for r in map(json.loads, f)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("shard")
    data = write_data(d / "data.jsonl", 25)
    targets = {"dense": tiny_qwen3(d / "q3"), "hybrid": tiny_qwen35(d / "q35"),
               "tied": tiny_qwen3(d / "q3tied", tie_word_embeddings=True)}
    with torch_threads(1):
        eos = {k: pick_eos(targets[k], data) for k in ("dense", "hybrid")}
    for k, (tok, _) in eos.items():
        with_eos(targets[k], tok)
    common = ["--data", data, "--max_steps", "6", "--batch_size", "1", "--grad_accum", "2", *SMALL[:-6],
              "--eval_every", "3", "--save_every", "3", "--eval_fraction", str(EVAL_FRACTION),
              "--eval_walk_prompts", str(WALK_PROMPTS), "--eval_walk_tokens", str(WALK_TOKENS)]
    cases, split, walk = [], [EVAL_FRACTION, 0], [WALK_PROMPTS, WALK_TOKENS]
    for k in ("dense", "hybrid", "tied"):
        cases.append({"kind": "features", "out": str(d / f"{k}_features"), "target": targets[k], "data": data,
                      "split": split, "walk": walk})
    for k in ("dense", "hybrid"):
        argv = ["--target", targets[k], *common]
        for name, extra in (("plain", []), ("shard", ["--shard_target"]), ("resumed", ["--shard_target", "--resume"])):
            cases.append({"kind": "resume" if name == "resumed" else "train", "out": str(d / f"{k}_{name}"),
                          "argv": argv + ["--out", str(d / f"{k}_{name}"), *extra], "from": str(d / f"{k}_plain")})
    cases.append({"kind": "train", "out": str(d / "dense_compiled"),  # compile(DDP(drafter)), as on CUDA
                  "argv": ["--target", targets["dense"], *common, "--compile", "on", "--out",
                           str(d / "dense_compiled")]})
    cases.append({"kind": "train", "out": str(d / "dense_rows"),  # 2 rows per rank, no accumulation
                  "argv": ["--target", targets["dense"], *common, "--batch_size", "2", "--grad_accum", "1", "--out",
                           str(d / "dense_rows")]})
    v2 = ["--target", targets["dense"], *common, *DFLASH2, "--zero"]  # DFlash2 under DDP + ZeRO, and sharded
    for name, extra in (("v2_ddp", []), ("v2_shard", ["--shard_target"])):
        cases.append({"kind": "train", "out": str(d / name), "argv": v2 + ["--out", str(d / name), *extra]})
    cases.append({"kind": "train", "out": str(d / "dense_dpace"),  # D-PACE: 1 row x grad_accum 2 per rank
                  "argv": ["--target", targets["dense"], *common, "--loss", "dpace", "--out", str(d / "dense_dpace")]})
    cases.append({"kind": "train", "out": str(d / "no_decoder"),
                  "argv": ["--target", gpt2(d / "gpt2"), "--shard_target", *common, "--out", str(d / "no_decoder")]})
    (d / "worker.py").write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
           str(29500 + random.randrange(1000)), str(d / "worker.py"), ROOT, json.dumps(cases)]
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return d, eos, common


def gpt2(path):
    """A target whose decoder stack find_decoder cannot find (GPT-2 keeps its blocks in `h`, not `layers`)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", ["dense", "hybrid", "tied"])
def test_sharded_target_gives_the_same_features_labels_and_walk(runs, kind):
    """On each rank: the captured context features, the final hidden state f, the greedy labels and the walk's
    greedy continuations (synced_gpus: one rank stops at eos before the other) equal the whole target's, bitwise.
    The decoder weights are sharded (DTensor); the embedding and lm_head are whole (and still tied if they were)."""
    d, eos, _ = runs
    for rank in (0, 1):
        with open(d / f"{kind}_features.{rank}.json") as f:
            r = json.load(f)
        assert r["context"] and r["final"] and r["labels"], r
        assert r["walk_shard"] == r["walk_whole"] and len(r["walk_whole"]) == 2 - rank
        assert [len(c) for c in r["extra"]] == [1] * rank  # rank 1's extra prompt (rank 0 has 2): no walk step
        assert r["sharded"] == "DTensor" and r["embed_whole"] == "Parameter"
        assert r["tied"] == (kind == "tied")
        assert "--shard_target: cannot shard the Qwen3" in r["shared"] and "shared" in r["shared"]


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_sharded_training_equals_unsharded(runs, kind):
    """6 steps (grad_accum 2) with evals at steps 0, 3, 6 (5 held-out samples, 3 walk prompts: uneven over 2
    ranks; eos ends the walk at different lengths): metrics.jsonl (loss, tau estimate, walked tau) and the final
    weights equal the unsharded run's; the unsharded run's step-3 checkpoint resumed with --shard_target (the flag
    toggled on resume) reaches the same weights and metrics."""
    d, eos, _ = runs
    assert eos[kind][1][0] != eos[kind][1][1]  # the premise: generation stops at different steps on the two ranks
    plain, shard, resumed = (d / f"{kind}_{x}" for x in ("plain", "shard", "resumed"))
    for out in (plain, shard, resumed):
        for rank in (0, 1):
            assert (d / f"{out.name}.{rank}.log").read_text().startswith("0\n")
    rp, rs = records(plain), records(shard)
    assert rp == rs
    evals = [r for r in rp if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and all(r["eval_walk_tau"] is not None for r in evals)
    assert len([r for r in rp if "loss" in r]) == 6 and rp[1]["loss"] != rp[-2]["loss"]  # it trained
    wp, ws, wr = final_weights(plain), final_weights(shard), final_weights(resumed)
    assert all(torch.equal(wp[k], ws[k]) for k in wp)
    assert all(torch.equal(wp[k], wr[k]) for k in wp)
    assert records(resumed) == rs  # steps 4-6 and the final eval appended to the step-3 records


@pytest.mark.parametrize("loss", ["ce", "dpace"])
def test_two_ranks_equal_one_process(runs, tmp_path, loss):
    """DDP over 2 gloo ranks, global batch 4: 1 row x grad_accum 2 per rank (no gradient all-reduce on the first
    micro-step; also with --compile on, compiled around DDP), or 2 rows per rank, equal one process with 2 rows x
    grad_accum 2: the same training losses, held-out figures and final weights. With --loss dpace too (normalised
    by the global batch's number of sequences, all-reduced before backward: the split over ranks and micro-steps
    changes nothing)."""
    d, _, common = runs
    one = tmp_path / "one"
    with torch_threads(1):
        dflash.main(["--target", str(d / "q3"), *common, "--batch_size", "2", "--grad_accum", "2", "--loss", loss,
                     "--out", str(one)])
    mine = records(one)
    assert len([r for r in mine if "loss" in r]) == 6 and mine[1]["loss"] != mine[-2]["loss"]  # it trained
    assert {r["loss_type"] for r in mine} == {loss}
    for ddp in (d / "dense_plain", d / "dense_compiled", d / "dense_rows") if loss == "ce" else (d / "dense_dpace",):
        theirs = records(ddp)
        assert [sorted(r) for r in theirs] == [sorted(r) for r in mine]
        for a, b in zip(theirs, mine):
            for k in ("loss", "eval_loss", "tau", "eval_tau", "eval_walk_tau"):
                if k in a:
                    assert a[k] == pytest.approx(b[k], abs=1e-5), (ddp.name, a["step"], k)
            if "grad_norm" in a:  # the gradient's scale too (AdamW's update hardly sees it): the same normaliser
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (ddp.name, a["step"])
        w, wo = final_weights(ddp), final_weights(one)
        assert max((w[k] - wo[k]).abs().max().item() for k in w) < 1e-5


def test_dflash2_on_two_ranks_with_zero_and_sharded_target_equals_one_process(runs, tmp_path):
    """DFlash2 (its selector trained outside the DDP forward, its term ramped) on 2 ranks with --zero equals one
    process with the same global batch; with --shard_target as well it equals the DDP run exactly."""
    d, _, common = runs
    one = tmp_path / "one"
    with torch_threads(1):
        dflash.main(["--target", str(d / "q3"), *common, *DFLASH2, "--batch_size", "2", "--grad_accum", "2", "--out",
                     str(one)])
    mine, ddp, shard = records(one), records(d / "v2_ddp"), records(d / "v2_shard")
    assert ddp == shard and [sorted(r) for r in ddp] == [sorted(r) for r in mine]
    assert [r["selector_alpha"] for r in mine if "loss" in r] == [1 / 3, 2 / 3, 1, 1, 1, 1]
    for a, b in zip(ddp, mine):
        for k in ("loss", "selector_loss", "eval_loss", "tau", "eval_tau", "eval_walk_tau", "eval_topk_recall"):
            if k in a:
                assert a[k] == pytest.approx(b[k], abs=1e-5), (a["step"], k)
    w, wo, ws = final_weights(d / "v2_ddp"), final_weights(one), final_weights(d / "v2_shard")
    assert "candidate_selector.successor_codebook" in w and w["candidate_selector.successor_codebook"].any()
    assert max((w[k] - wo[k]).abs().max().item() for k in w) < 1e-5
    assert all(torch.equal(w[k], ws[k]) for k in w)


def test_shard_target_bad_input(runs, tmp_path, capsys):
    """A target whose decoder layers cannot be found: one error line on each rank, no hang. One process: a note,
    and the run goes on with the whole target."""
    d, _, _ = runs
    for rank in (0, 1):
        code, *err = (d / f"no_decoder.{rank}.log").read_text().splitlines()
        assert code == "2" and len([x for x in err if x.strip()]) == 1, err
        assert err[0].startswith("error: target family gpt2 is not supported"), err
    with torch_threads(1):
        dflash.main(["--target", str(d / "q3"), "--data", str(d / "data.jsonl"), *SMALL, "--max_steps", "1",
                     "--batch_size", "4", "--shard_target", "--out", str(tmp_path / "one")])
    assert "--shard_target: one process, nothing to shard over" in capsys.readouterr().out
    assert (tmp_path / "one" / "step_1").is_dir()
