"""The extension contract, as a forker meets it: a toy variant (its own draft rule and flag), a toy loss
(label-smoothed CE) and a toy stage (fc frozen for the first k steps, counted in its saved state), each one file written
here into a directory outside the repository, following only dflash.py's contract. They train, resume bitwise, walk
held-out tau, and eval.py measures the variant's tau; their flags are refused beside other plug-ins in one line; the
generic chunked lm_head gives the toy loss its exact gradient, and a toy forward KL against the target's logits
(asked for by the loss, chunked) the gradient of the direct computation."""
import json
import os
import subprocess
import sys

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, SMALL, VOCAB, one_error, tiny_cfg, tiny_qwen3, write_data

import dflash
import eval as ev

TOY_VARIANT = '''
from dataclasses import dataclass, fields
from typing import ClassVar

import dflash


@dataclass
class Config(dflash.DFlashConfig):
    anchor_bonus: float = 0.0  # added to the anchor token's logit at every drafted offset
    architecture: ClassVar[str] = "ToyDraftModel"

    def problems(self):
        return super().problems() + ([] if self.anchor_bonus >= 0 else ["anchor_bonus must be >= 0"])

    def dflash_config_keys(self):
        return {"anchor_bonus": self.anchor_bonus}


class Drafter(dflash.DFlashDrafter):
    def draft(self, logits, h, anchor_ids, truth=None, temperature=0.0):
        bonus = torch.zeros_like(logits).scatter_(-1, anchor_ids[:, None, None].expand(-1, logits.shape[1], 1),
                                                  self.cfg.anchor_bonus)
        return (logits + bonus).argmax(-1), {}


Config.Drafter = Drafter


def add_flags(g):
    dflash.flag(g, "--anchor_bonus", 0.0, "the toy's bonus on the anchor token", float)


def configure(cfg, args):
    base = {f.name: getattr(cfg, f.name) for f in fields(dflash.DFlashConfig)}
    return cfg if isinstance(cfg, Config) else Config(**base, anchor_bonus=args.anchor_bonus)
'''.replace("import dflash\n", "import dflash\nimport torch\n", 1)

TOY_LOSS = '''
import dflash


class Smoothed(dflash.CE):
    def __init__(self, eps):
        self.eps = eps

    def token_loss(self, logits, labels):
        logp = logits.log_softmax(-1)
        return -(1 - self.eps) * logp.gather(1, labels[:, None]).squeeze(1) - self.eps * logp.mean(-1)


LOSSES = {"smooth": lambda args: Smoothed(args.smoothing)}


def add_flags(g):
    dflash.flag(g, "--smoothing", 0.1, "label smoothing", float, hi=1)
'''

TOY_STAGE = '''
import dflash


class Stage(dflash.SFT):
    """SFT with fc frozen for the first --freeze_fc_steps steps; the steps seen live in the saved state."""

    def __init__(self, args, state):
        self.k, self.state = args.freeze_fc_steps, state

    def plan(self, inp, micro_batches):
        self.state["seen"] = self.state.get("seen", 0) + 1
        (inp.loss_kw.get("raw_model") or inp.model).fc.requires_grad_(self.state["seen"] > self.k)
        return super().plan(inp, micro_batches)


def add_flags(g):
    dflash.flag(g, "--freeze_fc_steps", 0, "steps with fc frozen", int)
'''

TOY_KL = '''
import dflash


class ForwardKL(dflash.CE):
    target_logits = True  # token_loss also gets the target's logits at the same rows

    def token_loss(self, logits, labels, target_logits):
        logp = target_logits.log_softmax(-1)
        return (logp.exp() * (logp - logits.log_softmax(-1))).sum(-1)


LOSSES = {"fkl": lambda args: ForwardKL()}
'''


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    d = tmp_path_factory.mktemp("forker")
    plugins = d / "my_plugins"
    plugins.mkdir()
    (plugins / "toy_variant.py").write_text(TOY_VARIANT)
    (plugins / "toy_loss.py").write_text(TOY_LOSS)
    (plugins / "toy_stage.py").write_text(TOY_STAGE)
    (plugins / "toy_kl.py").write_text(TOY_KL)
    q3 = tiny_qwen3(d / "q3")
    data = write_data(d / "data.jsonl", 24)
    base = ["--target", q3, "--data", data, "--batch_size", "2", "--grad_accum", "1", *SMALL[:-2],
            "--eval_fraction", "0.25", "--eval_walk_prompts", "3", "--eval_walk_tokens", "12",
            "--variant", str(plugins / "toy_variant.py"), "--anchor_bonus", "0.5",
            "--loss", f"{plugins / 'toy_loss.py'}:smooth", "--smoothing", "0.2",
            "--stage", str(plugins / "toy_stage.py"), "--freeze_fc_steps", "2"]
    return {"dir": d, "plugins": plugins, "q3": q3, "data": data, "base": base}


def weights(out, step):
    return load_file(os.path.join(out, f"step_{step}", "model.safetensors"))


def test_toy_variant_and_loss_train_resume_walk_and_eval(forker, capsys):
    assert not str(forker["plugins"]).startswith(ROOT)  # the plug-ins live outside the repository
    straight, split = str(forker["dir"] / "straight"), str(forker["dir"] / "split")
    dflash.main(forker["base"] + ["--out", straight, "--max_steps", "4"])
    printed = capsys.readouterr().out
    assert "smoothing 0.2" in printed and "walked tau" in printed
    cfg = json.load(open(os.path.join(straight, "step_4", "config.json")))
    assert cfg["architectures"] == ["ToyDraftModel"] and cfg["dflash_config"]["anchor_bonus"] == 0.5
    assert cfg["dflash_module"] == str(forker["plugins"] / "toy_variant.py")
    records = [json.loads(x) for x in open(os.path.join(straight, "metrics.jsonl"))]
    assert [r["eval_walk_tau"] >= 1 for r in records if "eval_walk_tau" in r] == [True, True]
    # resume: 2 steps, stop, 2 more = 4 steps straight, bitwise (the stage's count of steps resumed with it)
    dflash.main(forker["base"] + ["--out", split, "--max_steps", "2", "--save_every", "1"])
    dflash.main(forker["base"] + ["--out", split, "--max_steps", "4", "--resume"])
    a, b = weights(straight, 4), weights(split, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one, two = weights(split, 1), weights(split, 2)  # the toy stage: fc frozen for 2 steps, the rest trained
    assert torch.equal(one["fc.weight"], two["fc.weight"]) and not torch.equal(two["fc.weight"], a["fc.weight"])
    assert not torch.equal(one["norm.weight"], two["norm.weight"])
    # eval.py measures the toy drafter's tau, importing its code only when asked
    drafter = os.path.join(straight, "step_4")
    prompts = forker["dir"] / "prompts.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 5, 9, 11, 2, 40]}) + "\n")
    argv = ["--target", forker["q3"], "--drafter", drafter, "--prompts", str(prompts), "--max_new_tokens", "12",
            "--no_progress", "--no_prompt_lookup"]
    one_error(capsys, ev.main, argv, "toy_variant.py", "--trust_variant_code")
    out = forker["dir"] / "tau.json"
    ev.main(argv + ["--trust_variant_code", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["results"][0]["tau"] >= 1
    # what eval.py walked: the toy's own Drafter (its draft rule) and config, found by config.json's dflash_module
    loaded = dflash.load_drafter(drafter)
    assert type(loaded).__name__ == "Drafter" and loaded.cfg.anchor_bonus == 0.5


def test_plugin_flags_only_beside_their_plugin(forker, capsys, tmp_path):
    base = [a for a in forker["base"] if a not in ("--anchor_bonus", "0.5")] + ["--out", str(tmp_path / "o")]
    without_variant = base[:base.index("--variant")] + base[base.index("--variant") + 2:]
    one_error(capsys, dflash.main, without_variant + ["--selector_top_k", "4"], "--selector_top_k", "--variant dflash2")
    one_error(capsys, dflash.main, base + ["--conv_kernel_size", "2"], "--conv_kernel_size", "--variant dflash2")
    one_error(capsys, dflash.main, without_variant + ["--dflash2", "--anchor_bonus", "1"], "--anchor_bonus")
    one_error(capsys, dflash.main, base + ["--dpace_alpha", "0.2"], "--dpace_alpha", "--loss dpace")
    one_error(capsys, dflash.main, base + ["--dflash2"], "--dflash2", "toy_variant.py")
    one_error(capsys, dflash.main, base + ["--loss", "nothing"], "--loss nothing", "dpace")
    one_error(capsys, dflash.main, base + ["--variant", str(tmp_path / "missing.py")], "missing.py")
    assert not os.path.exists(tmp_path / "o")


def test_a_loss_plugin_gets_its_exact_gradient_through_the_chunked_head():
    """weighted_ce with the toy loss, chunked (a chunk smaller than the tokens), equals the loss and gradient of
    full logits computed directly (in float64; the head computes its logits in fp32)."""
    sys.modules.setdefault("dflash", dflash)
    ns = {}
    exec(TOY_LOSS, ns)
    loss = ns["Smoothed"](0.3)
    torch.manual_seed(0)
    hidden = torch.randn(2, 3, 4, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, VOCAB, bias=False).double()
    labels = torch.randint(0, VOCAB, (2, 3, 4))
    w = torch.rand(2, 3, 4, dtype=torch.float64) * (torch.rand(2, 3, 4) > 0.3)
    got, stats = dflash.weighted_ce(hidden, head, labels, w, chunk=5, loss=loss)
    got.backward()
    h2 = hidden.detach().clone().requires_grad_()
    logp = head(h2).log_softmax(-1)
    per = -(0.7 * logp.gather(-1, labels[..., None]).squeeze(-1) + 0.3 * logp.mean(-1))
    want = (per * w).sum()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert torch.allclose(hidden.grad, h2.grad, rtol=1e-5, atol=1e-7)
    assert stats["w"].item() == pytest.approx(w.sum().item())


def test_a_loss_sees_the_target_distribution_chunked(forker, monkeypatch):
    """The toy forward KL, from its file outside the repository: dflash_loss asks the chunked lm_head for the target's
    logits before each block token (a chunk of 5 rows at a time, never the batch's whole) and its loss and gradient
    equal a direct computation from the target's own full logits (Hugging Face's forward) by autograd."""
    spec = importlib.util.spec_from_file_location("toy_kl_outside", forker["plugins"] / "toy_kl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss, seen = module.LOSSES["fkl"](None), []
    real = loss.token_loss
    loss.token_loss = lambda logits, labels, target_logits: seen.append(target_logits.shape) or real(
        logits, labels, target_logits)
    monkeypatch.setattr(dflash, "vocab_chunk", lambda vocab_size, budget=None: 5)
    target = dflash.load_target(forker["q3"])
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(tiny_cfg(vocab_size=VOCAB, mask_token_id=VOCAB - 1, num_target_layers=4,
                                            target_layer_ids=[1, 2]))
    g = torch.Generator().manual_seed(4)
    rows = [(torch.randint(0, VOCAB - 1, (n,), generator=g).tolist(), [0] * 3 + [1] * (n - 3)) for n in (16, 11)]
    batch = dflash.collate(rows, 0, keys=[1, 2])
    anchors, valid = dflash.batch_anchors(batch, 5)
    w = dflash.loss_weights(anchors, valid, batch["loss_mask"], drafter.cfg.block_size, 4.0)
    got, stats = dflash.dflash_loss(drafter, drafter.cfg, target, batch, anchors, valid, w, loss=loss)
    got.backward()
    assert seen and all(s[0] <= 5 and s[1] == VOCAB for s in seen) and sum(s[0] for s in seen) == (w > 0).sum()
    ours = {k: p.grad.clone() for k, p in drafter.named_parameters()}
    drafter.zero_grad()
    with torch.no_grad():  # the target's distribution at a+i: its logits at a+i-1, from the full model
        logits = target.model(input_ids=batch["input_ids"]).logits
        context, _ = dflash.target_features(target, batch["input_ids"], [1, 2])
    S, B = logits.shape[1], drafter.cfg.block_size
    pos = (anchors[..., None] + torch.arange(B) - 1).clamp(0, S - 1)
    logp = logits[torch.arange(2)[:, None, None], pos].log_softmax(-1)              # (b, N, B, V)
    ids = torch.full((*anchors.shape, B), VOCAB - 1)
    ids[..., 0] = batch["input_ids"].gather(1, anchors)
    hidden = drafter(context, target.embed(ids), anchors, valid)
    kl = (logp.exp() * (logp - target.lm_head(hidden).log_softmax(-1))).sum(-1)
    want = (kl * w).sum() / w.sum()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5) and want.item() > 0
    for k, p in drafter.named_parameters():
        assert torch.allclose(ours[k], p.grad, rtol=1e-4, atol=1e-7), k
    assert stats["w"].item() == pytest.approx(w.sum().item())


def test_a_loss_against_the_target_distribution_is_one_loss_file(forker, tmp_path):
    """--loss toy_kl.py:fkl trains from the command line, from its file outside the repository."""
    base = forker["base"][:forker["base"].index("--loss")]
    dflash.main(base + ["--loss", f"{forker['plugins'] / 'toy_kl.py'}:fkl", "--out", str(tmp_path / "kl"),
                        "--max_steps", "2", "--eval_walk_prompts", "0"])
    records = [json.loads(x) for x in open(tmp_path / "kl" / "metrics.jsonl")]
    losses = [r["loss"] for r in records if "loss" in r and "eval_loss" not in r]
    assert len(losses) == 2 and all(x > 0 for x in losses)


def test_plugins_in_dflash_tools_are_found_from_their_files():
    found = {(f, m, a) for f, m, a in dflash.tool_plugins()}
    assert ("--variant", "dflash2", "DFlash2DraftModel") in found and ("--loss", "losses", None) in found
    assert ("--stage", "onpolicy", None) in found
    assert "DFlash2DraftModel" not in open(os.path.join(ROOT, "dflash.py")).read()  # the map comes from the modules
    assert "DFlash2" not in open(os.path.join(ROOT, "eval.py")).read()


def test_eval_refuses_outside_variant_code_in_a_subprocess_too(forker, tmp_path):
    """A fresh process (no module already imported): the refusal names the module and the flag."""
    out = str(tmp_path / "run")
    dflash.main(forker["base"] + ["--out", out, "--max_steps", "1", "--eval_walk_prompts", "0"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "dflash.py"), "--target", forker["q3"], "--data",
                           forker["data"], "--out", str(tmp_path / "ft"), "--init_from", os.path.join(out, "step_1"),
                           "--max_steps", "1"], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "toy_variant.py" in lines[0], proc.stderr
    assert "--trust_variant_code" in lines[0]
