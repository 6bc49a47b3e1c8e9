"""The on-policy stage (dflash_tools/onpolicy.py): its rollout is eval.py's walk (greedy and sampled, DFlash and
DFlash2) and the target's distribution comes from that walk's one hooked pass; the objective's gradient equals a
direct recomputation written out block by block; a resume mid-stage (between rollouts) is bitwise; bad flags are
one line. Tiny random models on CPU, fp32."""

import copy
import io
import json
import math
import os
import re
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

import dflash
import eval as ev
from conftest import (DENSE_DRAFTER, DENSE_TARGET, SMALL, VOCAB, one_error, randomize, reference_greedy, tiny_cfg,
                      tiny_qwen3, torch_threads, train_on_continuations, write_data, write_lines)
from dflash_tools import dflash2, onpolicy

pytestmark = pytest.mark.usefixtures("one_thread_module")

V2 = dict(conv_kernel_size=2, conv_group_size=4, selector_rank=4, selector_top_k=5)
TOKENS = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny dense target, 4 prompts, a DFlash drafter trained briefly on their continuations and a DFlash2 one
    whose selector moves its path off the unary argmax."""
    target = dflash.load_target(tiny_qwen3(str(tmp_path_factory.mktemp("op") / "target"), **DENSE_TARGET))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, DENSE_DRAFTER["mask_token_id"], (8,), generator=g).tolist() for _ in range(4)]
    conts = [reference_greedy(target, p, TOKENS) for p in prompts]
    torch.manual_seed(0)
    d1 = train_on_continuations(target, dflash.DFlashDrafter(tiny_cfg(DENSE_DRAFTER)), prompts, conts, steps=20)
    torch.manual_seed(0)
    d2 = train_on_continuations(target, dflash2.Drafter(tiny_cfg(DENSE_DRAFTER, V2)), prompts, conts, steps=20)
    randomize(d2.candidate_selector, 12)
    return {"target": target, "prompts": prompts, "dflash": d1, "dflash2": d2}


# -----------------------------------------------------------------------------
# The rollout is eval.py's walk


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollout_is_eval_walk(tiny, variant, temperature):
    target, drafter, prompts = tiny["target"], tiny[variant], tiny["prompts"]
    sampling = ev.Sampling(temperature, samples=1, seed=5) if temperature else None
    report = ev.evaluate_drafters(target, {"d": drafter}, prompts, TOKENS, progress=False, sampling=sampling,
                                  dump_drafts=True)
    entries = report["results"][0]["prompts"]
    steps = 0
    for i, (prompt, e) in enumerate(zip(prompts, entries)):
        r = onpolicy.rollout(drafter, target, prompt, TOKENS, temperature, dflash.mix_seed(5, i, 0),
                             dflash.mix_seed(5, i, 0, 1))
        assert r["ids"].tolist() == prompt + e["continuation"]
        assert (r["accepted"] + 1).tolist() == e["acceptance_lengths"]
        assert r["starts"].tolist() == ev.step_anchors(e["acceptance_lengths"])
        if not temperature:  # (eval.py dumps drafts only where they are the proposals: the greedy walk)
            assert r["proposals"].tolist() == e["drafts"]
        steps += len(e["acceptance_lengths"])
    assert steps > len(prompts)  # more than one block a prompt: the walk moved
    if temperature and variant == "dflash":
        assert any(e["continuation"] != reference_greedy(target, p, TOKENS) for p, e in zip(prompts, entries))


def test_target_distribution_is_the_walk_pass(tiny):
    """The recorded final hidden states through lm_head are the target's own logits over prompt + continuation."""
    target, prompt = tiny["target"], tiny["prompts"][0]
    r = onpolicy.rollout(tiny["dflash"], target, prompt, TOKENS)
    with torch.no_grad():
        logits = target.model(input_ids=r["ids"][None]).logits[0]
    assert torch.allclose(target.lm_head(r["final"]), logits, atol=1e-5)
    B, S, P = tiny["dflash"].cfg.block_size, len(r["ids"]), len(prompt)
    rows = sum(P + k + m + 2 < S and m + 2 < B for k, m in zip(r["starts"].tolist(), r["accepted"].tolist()))
    # the B-1 drafts of each block with a draft-induced state, over one cached pass of the sequence (attention only)
    assert rows > 0 and onpolicy.attention_only(target) and r["target_tokens"] == 2 * S - 1 + S + rows * (B - 1)


def test_cached_verification_is_the_batched_pass(tiny, monkeypatch):
    """Each block's drafts over the KV cache cut at its anchor give the states that one batched pass over [ids up to
    each anchor, its drafts] gives (the path of a target with recurrent layers), within 1e-4, for fewer tokens."""
    target = tiny["target"]
    r = onpolicy.rollout(tiny["dflash"], target, tiny["prompts"][1], TOKENS)
    args = (target, r["ids"], r["starts"] + r["prompt_len"], r["accepted"], r["proposals"], r["final"])
    cached, n_cached = onpolicy.verify_states(*args)
    monkeypatch.setattr(onpolicy, "attention_only", lambda t: False)
    batched, n_batched = onpolicy.verify_states(*args)
    induced = ~torch.isclose(batched, onpolicy.verify_states(*args, induced=False)[0], atol=1e-3).all(-1)
    assert induced.any() and torch.allclose(cached, batched, atol=1e-4) and n_cached < n_batched


def test_a_captured_greedy_continuation_is_walked_as_a_generated_one(tiny):
    """Given the target's greedy continuation (captured once), the rollout is the generated one's, less the generation's
    target tokens; a captured continuation at T > 0 is one error line."""
    target, drafter, prompt = tiny["target"], tiny["dflash"], tiny["prompts"][1]
    r = onpolicy.rollout(drafter, target, prompt, TOKENS)
    c = onpolicy.rollout(drafter, target, prompt, TOKENS, continuation=r["ids"][len(prompt):].tolist())
    for k in ("ids", "starts", "accepted", "proposals", "verify", "final"):
        assert torch.equal(r[k], c[k]), k
    assert r["target_tokens"] - c["target_tokens"] == len(r["ids"]) - 1
    with pytest.raises(dflash.DFlashError, match="captured continuation is greedy"):
        onpolicy.rollout(drafter, target, prompt, TOKENS, 1.0, continuation=c["ids"][len(prompt):].tolist())


# -----------------------------------------------------------------------------
# The objective against a direct recomputation, block by block


def token_div(mode, lq, lp):
    """The authors' estimators at one token, from its two log-probabilities, with their clamps written out."""
    if mode == "k3":
        r = min(max(lp - lq, -20.0), 20.0)
        return min(math.exp(r) - r - 1, 10.0) if not torch.is_tensor(lq) else torch.clamp(
            torch.exp(torch.clamp(lp - lq, -20, 20)) - torch.clamp(lp - lq, -20, 20) - 1, max=10.0)
    top = math.log1p(-torch.finfo(torch.float32).eps)
    lq, lp = torch.clamp(lq, -10.0, top), torch.clamp(torch.as_tensor(lp, dtype=lq.dtype), -10.0, top)
    pq, pp = lq.exp(), lp.exp()
    return torch.clamp(pp * (lp - lq) + (1 - pp) * (torch.log(1 - pp) - torch.log(1 - pq)), max=10.0)


def direct_loss(drafter, target, rollouts, s, alpha):
    """The objective written out: each recorded block run alone through the drafter's forward, the full softmaxes,
    the regions and weights from the accepted lengths by hand (the rejected drafts' p from the recorded verifier
    states, checked against a draft-verify loop below); DFlash2's selector term with explicit loops."""
    cfg, B, M = drafter.cfg, drafter.cfg.block_size, drafter.cfg.mask_token_id
    T = s["onpolicy_teacher_temperature"] or s["onpolicy_temperature"] or 1.0
    W = target.lm_head.weight
    total, norm = 0.0, 0.0
    for r in rollouts:
        ids, S, P = r["ids"], len(r["ids"]), r["prompt_len"]
        for j, (k, m) in enumerate(zip(r["starts"].tolist(), r["accepted"].tolist())):
            a = P + k
            drafted = [ids[a].item()] + r["proposals"][j].tolist()
            x = F.embedding(torch.tensor([[[ids[a].item()] + [M] * (B - 1)]]), target.embed.weight)
            h = drafter(r["features"][None], x, torch.tensor([[a]]), torch.ones(1, 1, dtype=torch.bool))[0, 0]
            for i in range(1, B):
                if a + i >= S:
                    break
                z = W @ h[i]
                if isinstance(drafter, dflash2.Drafter):
                    z = dflash2.unary_logits(z, cfg.output_multiplier, cfg.final_logit_softcapping)
                logq = F.log_softmax(z, -1)
                label = (W @ r["final"][a + i - 1]).argmax().item()
                sides = []
                if i <= m + 1:  # committed: the truth's state, predecessor and token
                    sides.append((1.0, s["onpolicy_accepted"], r["final"][a + i - 1], ids[a + i - 1].item(),
                                  ids[a + i].item()))
                rej = s["onpolicy_rejected"]
                if rej != "none" and (i == m + 1 if rej == "tv1" else i >= m + 1):
                    w = 1.0 if rej == "tv1" else s["onpolicy_decay"] ** (i - 1)
                    drafts = s["onpolicy_rejected_from"] == "drafts"
                    state = r["verify"][j, i] if drafts and i > m + 1 else r["final"][a + i - 1]
                    sides.append((w, rej, state, drafted[i - 1] if drafts else ids[a + i - 1].item(), drafted[i]))
                for w, mode, state, pred, tok in sides:
                    logp = F.log_softmax(W @ state / T, -1)
                    terms = [(logq, logp, 1.0, None)]
                    if isinstance(drafter, dflash2.Drafter):
                        top = z.topk(cfg.selector_top_k)
                        sc = torch.stack([top.values[c] + (drafter.candidate_selector.predecessor_codebook[pred]
                                                           * drafter.candidate_selector.hidden_projection(h[i])
                                                           ) @ drafter.candidate_selector.successor_codebook[t]
                                          for c, t in enumerate(top.indices.tolist())])
                        pc = logp[top.indices]
                        if mode == "ce":
                            hit = (top.indices == label).nonzero()
                            sel = (sc.logsumexp(0) - sc[hit[0, 0]]) if len(hit) else sc.sum() * 0
                            terms.append((sel, None, alpha, None))
                        else:
                            terms.append((F.log_softmax(sc, 0), pc - pc.logsumexp(0), alpha, top.indices.tolist()))
                    for lq, lp, c, held in terms:
                        if lp is None:
                            total = total + w * c * lq
                        elif mode == "ce":
                            total = total + w * c * -lq[label]
                        elif mode in ("fkl2", "k3"):
                            if held is None:
                                total = total + w * c * token_div(mode, lq[tok], lp[tok])
                            elif tok in held:
                                total = total + w * c * token_div(mode, lq[held.index(tok)], lp[held.index(tok)])
                        elif mode == "fkl":
                            total = total + w * c * (lp.exp() * (lp - lq)).sum()
                        elif mode == "rkl":
                            total = total + w * c * (lq.exp() * (lq - lp)).sum()
                        else:
                            total = total + w * c * 0.5 * (lq.exp() - lp.exp()).abs().sum()
                    norm += w
    return total / norm


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("accepted,rejected,T,source", [("fkl2", "k3", 0.0, "drafts"), ("ce", "tv", 0.0, "drafts"),
                                                        ("fkl", "rkl", 0.7, "truth"), ("fkl2", "tv1", 0.0, "drafts")])
def test_objective_gradient_equals_direct_recomputation(tiny, variant, accepted, rejected, T, source):
    target, prompts = tiny["target"], tiny["prompts"][:2]
    drafter = copy.deepcopy(tiny[variant]).double().train()
    target64 = copy.copy(target)
    target64.lm_head = copy.deepcopy(target.lm_head).double()
    target64.embed = copy.deepcopy(target.embed).double()
    s = {**onpolicy.DEFAULTS, "onpolicy_accepted": accepted, "onpolicy_rejected": rejected, "onpolicy_decay": 0.7,
         "onpolicy_temperature": T, "onpolicy_rejected_from": source}
    rollouts = [onpolicy.rollout(tiny[variant], target, p, 12, T, seed=i, accept_seed=i) for i, p in enumerate(prompts)]
    rollouts = [{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in r.items()}
                for r in rollouts]
    assert any((r["accepted"] < drafter.cfg.block_size - 2).any() for r in rollouts)  # rejected proposals exist
    loss, norm, _, _ = onpolicy.onpolicy_terms(drafter, drafter, target64, drafter.cfg, rollouts, s, (0, 1))
    (loss / norm).backward()
    got = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad()
    ref = direct_loss(drafter, target64, rollouts, s, getattr(drafter, "alpha", 0.0))
    tol = 1e-6  # fp32 parts: the weights decay^(i-1), the drafter's own CE (block_loss)
    assert (loss / norm).item() == pytest.approx(ref.item(), rel=tol)
    ref.backward()
    want = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and len(got) > 4
    for n in got:
        assert (got[n] - want[n]).norm() <= tol * want[n].norm() and want[n].norm() > 0, n


def test_rejected_drafts_p_is_a_draft_verify_loops_verification(tiny):
    """Speculative decoding written out (the drafter drafts a block at the last committed token from the target's
    features of the committed text, the target verifies [committed, drafts] in one forward, the greedy-matching prefix
    and the target's token are committed): its blocks are the rollout's, and the target's logits where it verified
    each rejected draft are the recorded verifier states through lm_head; past the first rejection they differ from
    the true continuation's (the draft-induced states)."""
    target, drafter = tiny["target"], tiny["dflash"]
    cfg, B = drafter.cfg, drafter.cfg.block_size
    induced = 0
    for prompt in tiny["prompts"][:3]:
        r = onpolicy.rollout(drafter, target, prompt, TOKENS)
        P, S = len(prompt), len(r["ids"])
        seq = r["ids"][:P + 1].tolist()  # the prefill's token
        blocks = []
        with torch.no_grad():
            while len(seq) < S:
                a = len(seq) - 1
                feats, _ = dflash.target_features(target, torch.tensor([seq]), cfg.target_layer_ids)
                x = F.embedding(torch.tensor([[[seq[a]] + [cfg.mask_token_id] * (B - 1)]]), target.embed.weight)
                h = drafter(feats, x, torch.tensor([[a]]), torch.ones(1, 1, dtype=torch.bool))[0, 0]
                drafts = (target.lm_head(h[1:])).argmax(-1).tolist()
                logits = target.model(input_ids=torch.tensor([seq + drafts])).logits[0]
                want = logits[a:a + B].argmax(-1).tolist()  # the target's token at offsets 1..B (B: the bonus)
                m = next((i for i in range(B - 1) if drafts[i] != want[i]), B - 1)
                m = min(m, S - 1 - a)  # (the walk's continuation ends at S)
                blocks.append((a, m, drafts, logits))
                seq += drafts[:m] + ([want[m]] if a + m + 1 < S else [])
        assert seq == r["ids"].tolist()
        assert [b[0] - P for b in blocks] == r["starts"].tolist() and [b[1] for b in blocks] == r["accepted"].tolist()
        for j, (a, m, drafts, logits) in enumerate(blocks):
            assert r["proposals"][j].tolist() == drafts
            for i in range(1, min(B, S - a)):
                got = target.lm_head(r["verify"][j, i])
                assert torch.allclose(got, logits[a + i - 1], atol=1e-4), (j, i)
                if i > m + 1:
                    induced += not torch.allclose(got, target.lm_head(r["final"][a + i - 1]), atol=1e-3)
    assert induced > 0


def test_the_stage_names_no_variant():
    """What the stage needs of a variant comes through the drafter's hooks (logprobs, block_loss, draft): its code
    names none (the objective tests above run it on DFlash2 too)."""
    code = "".join(line for line in open(onpolicy.__file__) if not line.lstrip().startswith("#"))
    assert not re.search(r"dflash2|selector|candidate|unary", code, re.I)


def test_region_weights_by_hand():
    # blocks of B = 5 at anchors 2 and 4 of a row of length 8: m = 1 accepted, then m = 3 (the block runs off the end)
    valid = torch.tensor([[True, True, False]])
    acc, rej = onpolicy.region_weights(torch.tensor([8]), torch.tensor([[2, 4, 0]]), valid, torch.tensor([[1, 3, 0]]),
                                       5, 0.5, "rkl")
    assert acc.tolist() == [[[0, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0] * 5]]
    assert rej.tolist() == [[[0, 0, 0.5, 0.25, 0.125], [0] * 5, [0] * 5]]  # offsets m+1.., 0.5^(offset-1)
    _, first = onpolicy.region_weights(torch.tensor([8]), torch.tensor([[2]]), torch.tensor([[True]]),
                                       torch.tensor([[1]]), 5, 0.5, "tv1")
    assert first.tolist() == [[[0, 0, 1, 0, 0]]]
    _, none = onpolicy.region_weights(torch.tensor([8]), torch.tensor([[2]]), torch.tensor([[True]]),
                                      torch.tensor([[1]]), 5, 0.5, "none")
    assert not none.any()


# -----------------------------------------------------------------------------
# Steps and resume


def run_steps(drafter, target, batches, args, steps, state=None, optimizer=None, start=0):
    opt = optimizer or torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    state = {} if state is None else state
    for step in range(start, steps):
        micro = [batches.get(step, m) for m in range(2)]
        dflash.train_step(drafter, opt, target, drafter.cfg, micro, 1e-3, 6, 1.0, 1, stage=onpolicy.Stage(args, state),
                          progress=(step, steps), gamma=4.0, noise_std=0.02, labels="target", raw_model=drafter)
    return opt, state


def round_trip(obj):
    """What a checkpoint keeps: torch.save, then torch.load as dflash reads train_state.pt (weights only)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_resume_mid_stage_is_bitwise(tiny, variant, tmp_path):
    target = tiny["target"]
    samples = [(p + c, [0] * len(p) + [1] * len(c)) for p, c in
               ((p, reference_greedy(target, p, 12)) for p in tiny["prompts"])]
    batches = dflash.Batches(samples, 1, 2, 0, 1, 0, 0)
    args = type("A", (), dict(onpolicy.DEFAULTS, seed=0, out=str(tmp_path), onpolicy_every=3,
                              onpolicy_temperature=0.5))()
    with torch_threads(2):
        a = copy.deepcopy(tiny[variant]).train()
        run_steps(a, target, batches, args, 5)
        b = copy.deepcopy(tiny[variant]).train()
        opt, state = run_steps(b, target, batches, args, 2)  # stopped between two rollouts (steps 0 and 3)
        saved = round_trip({"w": b.state_dict(), "opt": opt.state_dict(), "stage": state})
        c = copy.deepcopy(tiny[variant]).train()
        c.load_state_dict(saved["w"])
        opt_c = torch.optim.AdamW(c.parameters(), lr=1e-3)
        opt_c.load_state_dict(saved["opt"])
        run_steps(c, target, batches, args, 5, saved["stage"], opt_c, start=2)
    sa, sc = a.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)
    assert not all(torch.equal(sa[k], tiny[variant].state_dict()[k]) for k in sa)  # it trained
    ages = [json.loads(line)["rollout_age"] for line in open(tmp_path / "onpolicy.jsonl")]
    assert ages[:5] == [0, 1, 2, 0, 1]


# -----------------------------------------------------------------------------
# The command line: --stage onpolicy end to end, resumed bitwise from a checkpoint between rollouts; bad flags


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    d = tmp_path_factory.mktemp("opcli")
    base = ["--target", tiny_qwen3(d / "q3"), "--data", write_data(d / "data.jsonl", 8), "--batch_size", "2",
            "--grad_accum", "1", *SMALL]
    with torch_threads(1):
        dflash.main([*base, "--max_steps", "2", "--out", str(d / "sft")])
    stage = ["--stage", "onpolicy", "--init_from", str(d / "sft" / "step_2"), "--onpolicy_every", "2",
             "--onpolicy_tokens", "8", "--onpolicy_temperature", "0.7", "--onpolicy_sft_weight", "0.1",
             "--max_steps", "3"]
    return {"dir": d, "base": base, "stage": stage}


def test_cli_stage_resumes_bitwise(cli):
    d, argv = cli["dir"], cli["base"] + cli["stage"]
    with torch_threads(1):
        dflash.main([*argv, "--save_every", "1", "--out", str(d / "a")])
        os.makedirs(d / "b")
        shutil.copytree(d / "a" / "step_1", d / "b" / "step_1")  # after step 1: the rollouts of step 0 are 1 old
        (d / "b" / "latest").write_text("step_1\n")
        dflash.main([*argv, "--save_every", "1", "--out", str(d / "b"), "--resume"])
    a, b = dflash.read_safetensors(str(d / "a" / "step_3")), dflash.read_safetensors(str(d / "b" / "step_3"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = dflash.read_safetensors(str(d / "sft" / "step_2"))
    assert not all(torch.equal(a[k], s[k]) for k in s)
    records = [json.loads(line) for line in open(d / "a" / "onpolicy.jsonl")]
    assert [r["rollout_age"] for r in records] == [0, 1, 0] and all(r["target_tokens"] > 0 for r in records)
    resumed = [json.loads(line) for line in open(d / "b" / "onpolicy.jsonl")]
    assert [r["step"] for r in resumed] == [2, 3] and resumed == records[1:]  # (b: from step_1's copy, no log)
    kept = torch.load(d / "a" / "step_2" / "train_state.pt", weights_only=True)["stage_state"]
    assert "rollouts" not in kept and "rollouts" in torch.load(d / "a" / "step_1" / "train_state.pt",
                                                              weights_only=True)["stage_state"]


@pytest.mark.parametrize("extra,needles", [
    (["--onpolicy_rejected", "none", "--onpolicy_decay", "0.5"], ["--onpolicy_decay", "drop one"]),
    (["--onpolicy_rejected", "tv1", "--onpolicy_decay", "0.5"], ["--onpolicy_rejected tv1", "drop one"]),
    (["--onpolicy_teacher_temperature", "0"], ["--onpolicy_teacher_temperature"]),
    (["--onpolicy_rejected_from", "prompt"], ["--onpolicy_rejected_from"]),
    (["--loss", "dpace"], ["--loss dpace", "own objective"]),
    (["--labels", "data"], ["--labels data"]),
    (["--onpolicy_tokens", "1"], ["--onpolicy_tokens 1"]),
    (["--onpolicy_temperature", "0.0001"], ["--onpolicy_temperature"]),
    (["--onpolicy_every", "0"], ["--onpolicy_every"]),
    (["--onpolicy_decay", "1.5"], ["--onpolicy_decay"]),
    (["--onpolicy_accepted", "rkl"], ["--onpolicy_accepted"]),
])
def test_bad_flags_are_one_line(cli, capsys, extra, needles):
    one_error(capsys, dflash.main, [*cli["base"], *cli["stage"], *extra, "--out", str(cli["dir"] / "x")], *needles,
              progress=True)


def test_stage_needs_a_trained_drafter_and_its_flags_need_the_stage(cli, capsys):
    one_error(capsys, dflash.main, [*cli["base"], "--stage", "onpolicy", "--out", str(cli["dir"] / "y")],
              "--init_from", progress=True)
    one_error(capsys, dflash.main, [*cli["base"], "--onpolicy_every", "2", "--out", str(cli["dir"] / "y")],
              "--onpolicy_every", progress=True)


# -----------------------------------------------------------------------------
# dflash_tools/onpolicy_bench.py: every arm runs from the SFT checkpoint to the budget and the report reads them


def test_bench_runs_every_arm_and_reports(cli, tmp_path, monkeypatch):
    """The measurement's pieces on the tiny run (2 held-out prompts, 8-token continuations, 4 updates of 2): the new
    sequences keep no prompt that begins as an SFT prompt, the held-out set carries the target's top-1 probability,
    every arm runs and is evaluated per prompt, an on-policy update costs more FLOPs than an SFT one, and the report
    pairs the arms prompt by prompt."""
    from dflash_tools import onpolicy_bench as ob
    from dflash_tools import tiny_target
    d, work = cli["dir"], tmp_path / "work"
    os.makedirs(work / "cache")
    os.makedirs(work / "runs")
    os.symlink(d / "q3", work / "cache" / "tiny_qwen35")
    shutil.copy(d / "data.jsonl", work / "cache" / "demo_data.jsonl")
    shutil.copytree(d / "sft", work / "sft_dflash")
    for name, value in dict(TOKENS=8, HELDOUT=2, HELDOUT_TOKENS=8, BATCH=2, ANCHORS=6, LAYER_IDS=[1, 2]).items():
        monkeypatch.setattr(ob, name, value)
    target = dflash.load_target(str(work / "cache" / "tiny_qwen35"))
    old = [json.loads(line)["input_ids"][:6] for line in open(d / "data.jsonl")]
    fresh = [[(t + 7) % 40 for t in p] for p in old[:6]]  # (none begins as an old prompt does: checked below)
    assert not {tuple(p) for p in fresh} & {tuple(p) for p in old}

    def regenerated(path, out, num_samples, seed):  # what make_regenerated_data writes: old prompts among new ones
        rows = [p + reference_greedy(target, p, 8) for p in [old[0]] + fresh + [old[1]]][:num_samples]
        return write_lines(tmp_path / "raw.jsonl", [json.dumps({"input_ids": r, "loss_mask": [0] * 6 + [1] * 8})
                                                    for r in rows])
    monkeypatch.setattr(tiny_target, "make_regenerated_data", regenerated)
    ob.new_sequences(str(work / "cache" / "tiny_qwen35"), str(d / "data.jsonl"), str(work / "cache" / "new.jsonl"), 6)
    assert [json.loads(line)["input_ids"][:6] for line in open(work / "cache" / "new.jsonl")] == fresh
    monkeypatch.setattr(tiny_target, "heldout_prompts", lambda path, num_prompts: fresh[:num_prompts])
    held = ob.held_out_set(target, str(work / "cache" / "tiny_qwen35"), str(work / "heldout.pt"))
    with torch.no_grad():  # the top-1 probability at each position that predicts a continuation token
        top1 = torch.cat([target.model(input_ids=torch.tensor([p + reference_greedy(target, p, 8)])).logits[0, 5:-1]
                          .softmax(-1).max(-1).values for p in fresh[:2]])
    assert len(held["items"]) == 2 and held["top1"] == pytest.approx(top1.mean().item(), abs=1e-5)
    with torch_threads(1):
        for arm in ob.ARMS:
            ob.run_one(str(work), "dflash", arm, 0, 4)  # (one thread, as the bench's processes run)
    runs = {arm: json.load(open(work / "runs" / f"dflash_{arm}_0.json")) for arm in ob.ARMS}
    for arm, r in runs.items():
        assert [c["step"] for c in r["curve"]] == [0, 2, 4] and len(r["curve"][-1]["taus"]) == 2, arm
        assert all(t >= 1 for t in r["curve"][-1]["taus"])
    flops = {arm: r["curve"][-1]["flops"] for arm, r in runs.items()}
    assert flops["A"] < flops["P"] and flops["C0"] < flops["P"], flops  # P: the verification pass besides C0's walk
    pytest.importorskip("matplotlib")  # (the plot; requirements.txt installs it)
    ob.report(str(work), str(tmp_path / "plot.png"))
    table = (work / "table.md").read_text()
    assert all(f"| {arm}: {ob.ARMS[arm]} |" in table for arm in ob.ARMS) and "| P − B0 |" in table
    m, lo, hi, n = ob.paired([runs["P"]], [runs["B0"]])
    want = sum(a - b for a, b in zip(runs["P"]["curve"][-1]["taus"], runs["B0"]["curve"][-1]["taus"])) / 2
    assert m == pytest.approx(want) and lo <= m <= hi and n == 1
    assert os.path.getsize(tmp_path / "plot.png") > 0


def test_bench_from_a_given_target_and_sft(cli, tmp_path, monkeypatch):
    """--target, --sft, --data, --new, --heldout: a new prompt equal to an SFT prompt is dropped, the others get the
    target's greedy continuations (batched: each token the argmax within 1e-4), the SFT drafter is evaluated once and
    every run starts from that evaluation, the arms run in a worker process, and the report names the target."""
    from dflash_tools import onpolicy_bench as ob
    d, work = cli["dir"], tmp_path / "work"
    rows = [json.loads(line) for line in open(d / "data.jsonl")]
    sft_prompt = rows[0]["input_ids"][:rows[0]["loss_mask"].index(1)]
    g = torch.Generator().manual_seed(5)
    fresh = [torch.randint(0, VOCAB - 1, (6,), generator=g).tolist() for _ in range(7)]
    new = write_lines(tmp_path / "new.jsonl", [json.dumps({"input_ids": p}) for p in [sft_prompt] + fresh[:5]])
    held = write_lines(tmp_path / "held.jsonl", [json.dumps({"input_ids": p}) for p in fresh[5:]])
    argv = ["--work", str(work), "--target", str(d / "q3"), "--sft", str(d / "sft"), "--data", str(d / "data.jsonl"),
            "--new", new, "--heldout", held, "--steps", "2", "--batch", "2", "--tokens", "6", "--heldout_prompts", "2",
            "--heldout_tokens", "6", "--seeds", "1", "--arms", "B0,P", "--jobs", "1", "--png", str(tmp_path / "p.png")]
    monkeypatch.setattr(sys, "argv", ["onpolicy_bench.py", *argv])
    pytest.importorskip("matplotlib")
    with torch_threads(1):
        ob.main()
    target = dflash.load_target(str(d / "q3"))
    made = [json.loads(line) for line in open(work / "new.jsonl")]
    assert [r["input_ids"][:6] for r in made] == fresh[:4] and all(r["loss_mask"][:6] == [0] * 6 for r in made)
    with torch.no_grad():
        for r in made:
            logits = target.model(input_ids=torch.tensor([r["input_ids"]])).logits[0, 5:-1]
            chosen = logits.gather(1, torch.tensor(r["input_ids"][6:])[:, None])[:, 0]
            assert len(r["input_ids"]) > 7 and (logits.max(-1).values - chosen).max() < 1e-4
    assert json.load(open(work / "bench.json"))["target"] == str(d / "q3")
    runs = [json.load(open(work / "runs" / f"dflash_{arm}_0.json")) for arm in ("B0", "P")]
    start = json.load(open(work / "sft_eval_dflash.json"))
    assert all(r["curve"][0] == {"step": 0, **start} and r["curve"][-1]["step"] == 2 for r in runs)
    assert len(start["taus"]) == 2 and str(d / "q3") in (work / "table.md").read_text()
