"""Three plug-ins a forker writes from dflash.py's contract ("Plug-ins: the contract") alone, each one file in a
directory outside the repository, the repository unedited: a training stage annealing the loss weights' gamma over
the run that trains from captured --features (it never runs the target), a forward-KL loss (the target's distribution
from a --store_final capture), and an on-policy divergence (Jensen-Shannon, through onpolicy.py's registry) with the
on-policy stage composed with that --loss. Each trains a few steps, resumes from a mid-run checkpoint to the same
weights bitwise, and eval.py measures its checkpoint's tau."""
import json
import os
import shutil

import pytest
import torch

from conftest import ROOT, SMALL, one_error, tiny_qwen3, torch_threads, write_data

import dflash
import eval as ev
from dflash_tools import features

ANNEALED = '''
import dflash


class Stage(dflash.SFT):
    """SFT with the loss weights' gamma annealed linearly from --gamma_start at the first step to --gamma at the last."""
    runs_target = False  # it reads only features and labels: it trains from --features

    def __init__(self, args, state):
        self.start, self.end = args.gamma_start, args.gamma

    def plan(self, inp, micro_batches):
        step, total = inp.loss_kw["progress"]
        gamma = self.start + (self.end - self.start) * step / max(1, total - 1)
        return super().plan(inp._replace(gamma=gamma), micro_batches)


def add_flags(g):
    dflash.flag(g, "--gamma_start", 1.0, "gamma at the first step, annealed to --gamma", float, open_lo=True)
'''

FORWARD_KL = '''
import dflash


class ForwardKL(dflash.CE):
    target_logits = True  # token_loss also gets the target's logits at its rows

    def token_loss(self, logits, labels, target_logits):
        logp = target_logits.log_softmax(-1)
        return (logp.exp() * (logp - logits.log_softmax(-1))).sum(-1)


LOSSES = {"fkl": lambda args: ForwardKL()}
'''

JSD = '''
import math

import torch


def jsd(logq, logp):
    """Jensen-Shannon divergence of q and p over a distribution's tokens: (T, K) log-probabilities each -> (T,)."""
    m = torch.logaddexp(logq, logp) - math.log(2)
    return 0.5 * ((logq.exp() * (logq - m)).sum(-1) + (logp.exp() * (logp - m)).sum(-1))


DIVERGENCES = {"jsd": jsd}
'''

STEPS, CUT = 3, 1  # each run: STEPS straight, and resumed from the checkpoint of step CUT
BLOCK = 4  # SMALL's --block_size


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    """The plug-ins written outside the repository, a tiny target, its data, and one fp32 capture with f stored."""
    d = tmp_path_factory.mktemp("outside")
    mine = d / "my_plugins"
    mine.mkdir()
    for name, text in (("annealed.py", ANNEALED), ("kl.py", FORWARD_KL), ("jsd.py", JSD)):
        (mine / name).write_text(text)
    q3, data = tiny_qwen3(d / "q3"), write_data(d / "data.jsonl", 16)
    with torch_threads(1):
        features.main(["capture", "--target", q3, "--data", data, "--out", str(d / "feats"), "--target_layer_ids",
                       "1,2", "--features_dtype", "fp32", "--store_final", "--eval_walk_prompts", "0"])
    base = ["--target", q3, "--data", data, "--batch_size", "2", "--grad_accum", "2", *SMALL,
            "--eval_walk_prompts", "0", "--no_progress", "--max_steps", str(STEPS)]
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": json.loads(line)["input_ids"][:6]}) + "\n"
                               for line in open(data).readlines()[:3]))
    return {"dir": d, "mine": mine, "q3": q3, "feats": str(d / "feats"), "base": base, "prompts": str(prompts)}


def weights(out, step):
    return dflash.read_safetensors(os.path.join(out, f"step_{step}"))


def train_and_resume(forker, name, argv):
    """STEPS steps straight (a checkpoint each step), then a new --out given that run's step CUT checkpoint resumed to
    STEPS: the same weights bitwise (same shapes, same order of operations). Returns the checkpoint of the last step."""
    d = forker["dir"]
    straight, resumed = str(d / f"{name}_straight"), d / f"{name}_resumed"
    with torch_threads(1):
        dflash.main([*forker["base"], *argv, "--save_every", "1", "--out", straight])
        os.makedirs(resumed)
        shutil.copytree(os.path.join(straight, f"step_{CUT}"), resumed / f"step_{CUT}")
        (resumed / "latest").write_text(f"step_{CUT}\n")
        dflash.main([*forker["base"], *argv, "--save_every", "1", "--out", str(resumed), "--resume"])
    a, b = weights(straight, STEPS), weights(str(resumed), STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], v) for k, v in weights(straight, CUT).items())  # the steps after CUT trained
    return os.path.join(straight, f"step_{STEPS}")


def measured_tau(forker, drafter):
    """eval.py's tau of a checkpoint on three prompts of the data: one verification step commits 1 to B tokens."""
    out = drafter + ".tau.json"
    ev.main(["--target", forker["q3"], "--drafter", drafter, "--prompts", forker["prompts"], "--max_new_tokens", "12",
             "--no_progress", "--no_prompt_lookup", "--json", out])
    tau = json.load(open(out))["results"][0]["tau"]
    assert 1 <= tau <= BLOCK
    return tau


def test_annealed_gamma_stage_trains_from_features(forker, capsys):
    assert not str(forker["mine"]).startswith(ROOT)  # outside the repository
    stage = ["--features", forker["feats"], "--stage", str(forker["mine"] / "annealed.py"), "--gamma_start", "0.5"]
    last = train_and_resume(forker, "annealed", stage)
    with torch_threads(1):  # the method's SFT on the same features: the annealed gamma changed the weights
        dflash.main([*forker["base"], "--features", forker["feats"], "--out", str(forker["dir"] / "sft")])
    sft = weights(str(forker["dir"] / "sft"), STEPS)
    assert not all(torch.equal(sft[k], v) for k, v in weights(os.path.dirname(last), STEPS).items())
    measured_tau(forker, last)
    # a stage that runs the target (it leaves runs_target unset) is refused beside --features, in one line
    (forker["mine"] / "rolls.py").write_text(ANNEALED.replace("    runs_target = False", "    pass"))
    one_error(capsys, dflash.main, [*forker["base"], "--features", forker["feats"], "--stage",
                                    str(forker["mine"] / "rolls.py"), "--out", str(forker["dir"] / "refused")],
              "rolls.py runs the target", "--features")


def test_forward_kl_loss_trains_from_a_store_final_capture(forker):
    last = train_and_resume(forker, "fkl", ["--features", forker["feats"], "--loss",
                                            f"{forker['mine'] / 'kl.py'}:fkl"])
    records = [json.loads(line) for line in open(os.path.join(os.path.dirname(last), "metrics.jsonl"))]
    assert [r["loss_type"] for r in records if "loss" in r] == [f"{forker['mine'] / 'kl.py'}:fkl"] * STEPS
    measured_tau(forker, last)


def test_an_onpolicy_divergence_is_one_file(forker, capsys):
    """--onpolicy_rejected jsd.py:jsd, the on-policy stage composed with the forward-KL --loss on its committed tokens
    (--onpolicy_accepted ce), from an SFT checkpoint; the divergence and the loss each move the weights (against no
    rejected term, and against the method's CE); a name the file does not hold is one line."""
    with torch_threads(1):
        dflash.main([*forker["base"], "--out", str(forker["dir"] / "init")])
    stage = ["--stage", "onpolicy", "--init_from", str(forker["dir"] / "init" / f"step_{STEPS}"), "--onpolicy_tokens",
             "8", "--onpolicy_accepted", "ce", "--loss", f"{forker['mine'] / 'kl.py'}:fkl"]
    last = train_and_resume(forker, "jsd", [*stage, "--onpolicy_rejected", f"{forker['mine'] / 'jsd.py'}:jsd"])
    records = [json.loads(line) for line in open(os.path.join(os.path.dirname(last), "onpolicy.jsonl"))]
    assert len(records) == STEPS and all(r["onpolicy_loss"] > 0 for r in records)
    with torch_threads(1):
        dflash.main([*forker["base"], *stage, "--onpolicy_rejected", "none", "--out", str(forker["dir"] / "none")])
        dflash.main([*forker["base"], *stage[:-2], "--onpolicy_rejected", f"{forker['mine'] / 'jsd.py'}:jsd", "--out",
                     str(forker["dir"] / "ce")])
    ours = weights(os.path.dirname(last), STEPS)
    for other in ("none", "ce"):
        theirs = weights(str(forker["dir"] / other), STEPS)
        assert not all(torch.equal(theirs[k], v) for k, v in ours.items()), other
    measured_tau(forker, last)
    one_error(capsys, dflash.main, [*forker["base"], *stage, "--onpolicy_rejected", f"{forker['mine'] / 'jsd.py'}:js",
                                    "--out", str(forker["dir"] / "refused")], "jsd.py:js", "no such divergence")
