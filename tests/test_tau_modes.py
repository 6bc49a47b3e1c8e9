"""tau beyond greedy chains: tree verification (DDTree's best-first tree) and sampling at temperature T (one-hot
drafts, rejection sampling), each walked exactly and checked against a real draft-verify loop on a tiny dense target;
the held-out tree tau of training; bad input. Tiny random models on CPU, fp32."""

import json
import math

import pytest
import torch

import dflash
from dflash_tools import sampling, tree
import eval as ev
from conftest import NEW_TOKENS, SMALL, one_error, reference_greedy, tiny_qwen3, write_data
from dflash import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread_module")


# -----------------------------------------------------------------------------
# The tree: hand examples


def test_tree_nodes_and_tree_accept_hand_example():
    # depth 1: ranks 0, 1 with log q -0.1, -1.0; depth 2: -0.2, -0.5; depth 3: -0.3, -3.0
    logq = [[-0.1, -1.0], [-0.2, -0.5], [-0.3, -3.0]]
    tokens = [[5, 6], [7, 8], [9, 4]]
    # best first: (0,) -0.1, (0,0) -0.3, (0,1) -0.6, (0,0,0) -0.6 (tie: the smaller rank tuple first), (0,1,0) -0.9,
    # (1,) -1.0, (1,0) -1.2, ...
    assert tree.tree_nodes(logq, 7) == [(0,), (0, 0), (0, 0, 0), (0, 1), (0, 1, 0), (1,), (1, 0)]
    assert tree.tree_nodes(logq, 100)[:3] == [(0,), (0, 0), (0, 0, 0)]
    assert len(tree.tree_nodes(logq, 100)) == 2 + 4 + 8  # every path once, then the heap runs dry
    assert tree.tree_nodes(logq, 1) == [(0,)]
    assert tree.tree_accept(logq, tokens, [5, 7, 9], 3) == 3   # the chain of top tokens
    assert tree.tree_accept(logq, tokens, [5, 8, 9], 3) == 1   # (0,1) is not in a 3-node tree
    assert tree.tree_accept(logq, tokens, [5, 8, 9], 5) == 3   # ... but (0,1,0) is in a 5-node one
    assert tree.tree_accept(logq, tokens, [6, 7, 9], 5) == 0   # depth-1 rank 1 joins only at node 6
    assert tree.tree_accept(logq, tokens, [6, 7, 9], 7) == 2
    assert tree.tree_accept(logq, tokens, [3, 7, 9], 100) == 0  # not among the top-K at depth 1
    assert tree.tree_accept(logq, tokens, [5, 7], 100) == 2     # the truth ends (end of the continuation)
    chain = [[q[0]] for q in logq], [[t[0]] for t in tokens]      # K = 1, budget B-1: the chain
    assert tree.tree_accept(*chain, [5, 7, 4], 3) == dflash.accepted_prefix([5, 7, 9], [5, 7, 4]) == 2


# -----------------------------------------------------------------------------
# The tree walk against a real tree-verification loop (dense target)


def drafter_top(nd, anchor, K):
    """(log q, tokens) (B-1, K) of the block anchored at `anchor`, by the incremental (inference) forward."""
    top = nd.block_logits(anchor).float().log_softmax(-1).topk(K)
    return top.values.tolist(), top.indices.tolist()


def tree_verify_loop(target, drafter, prompt, n, budget):
    """Greedy tree speculative decoding of n tokens: each step builds the tree from the drafter's block at the
    anchor, the target scores every root-to-leaf path (a batch of context + path rows, right-padded, no cache) and
    accepts the longest prefix of a path that equals its argmax, plus its own next token. Returns (tokens,
    acceptance lengths)."""
    nd, layers = ev.NeuralDrafter(drafter), drafter.cfg.target_layer_ids
    tokens, lengths = [int(target.model(torch.tensor([prompt])).logits[0, -1].argmax())], []
    while len(tokens) < n:
        ctx = prompt + tokens
        features, _ = dflash.target_features(target, torch.tensor([ctx[:-1]]), layers)
        nd.start(target, ctx[:-1], features)
        logq, top = drafter_top(nd, tokens[-1], budget)
        paths = [[top[d][r] for d, r in enumerate(node)] for node in tree.tree_nodes(logq, budget)]
        leaves = [p for p in paths if not any(len(q) > len(p) and q[:len(p)] == p for q in paths)]
        rows = torch.tensor([ctx + p + [0] * (len(max(leaves, key=len)) - len(p)) for p in leaves])
        choices = target.model(rows).logits[:, len(ctx) - 1:].argmax(-1).tolist()  # the padding is causal-invisible
        best, bonus = [], None
        for path, choice in zip(leaves, choices):  # choice[i]: the target's token after context + path[:i]
            m = dflash.accepted_prefix(path, choice)
            if bonus is None or m > len(best):
                best, bonus = path[:m], choice[m]
        left = n - len(tokens)
        lengths.append(min(len(best), left) + 1)
        tokens += (best + [bonus])[:left]
    return tokens, lengths


def test_tree_walk_equals_real_tree_loop_and_chain(dense):
    target, drafter = dense["target"], dense["drafter"]
    prompts, ref = dense["prompts"][:3], dense["continuations"][:3]
    budgets = (7, 40, 300)  # 7 = B-1: a chain-sized tree
    report = ev.evaluate_drafters(target, {"ours": drafter, "prompt-lookup": ev.PromptLookupDrafter()}, prompts,
                                  NEW_TOKENS, continuations=ref, tree_budgets=budgets, progress=False)
    ours, lookup = report["results"]
    assert "tree" not in lookup and set(ours["tree"]) == {"7", "40", "300"}
    for b in (7, 40):
        for prompt, cont, e in zip(prompts, ref, ours["prompts"]):
            tokens, lengths = tree_verify_loop(target, drafter, prompt, NEW_TOKENS, b)
            assert tokens == cont == reference_greedy(target, prompt, NEW_TOKENS)  # lossless: plain greedy
            assert lengths == e["tree"][str(b)], (b, lengths, e["tree"][str(b)])  # every step
    # a bigger tree holds the smaller one, so it accepts as much or more; this briefly trained drafter is unsure
    # (top-1 q ~ 0.04 at every depth), so its small trees go wide and shallow and lose to the chain (measured here:
    # chain 2.79, trees of 7 / 40 / 300 nodes 1.86 / 2.00 / 2.89)
    taus = [ours["tree"][str(b)]["tau"] for b in budgets]
    assert taus == sorted(taus) and taus[0] < taus[-1] and taus[-1] >= ours["tau"], (ours["tau"], taus)
    # a chain is a tree: top-1 per depth, B-1 nodes, gives the chain walk's acceptance lengths exactly
    for prompt, cont, e in zip(prompts, ref, ours["prompts"]):
        ids = torch.tensor([prompt + cont])
        features, _ = dflash.target_features(target, ids, drafter.cfg.target_layer_ids)
        drafts, top = dflash.draft_every_anchor(drafter, target, features, ids, len(prompt), rule=tree.topk_rule(3))
        logq, tokens = top["logq"], top["tokens"]
        assert torch.equal(tokens[..., 0], drafts)
        assert tree.tree_walk(cont, logq[..., :1], tokens[..., :1], 7) == e["acceptance_lengths"]
        assert dflash.tau_walk(cont, drafts.tolist()) == e["acceptance_lengths"]


# -----------------------------------------------------------------------------
# Sampling: the target's distribution p', the rejection-sampling loop, and the walk along sampled continuations


def test_sampling_probs_match_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for t, p, k in [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (0.5, 0.9, 10), (2.0, 0.3, 3)]:
        z = TemperatureLogitsWarper(t)(None, logits)
        z = TopKLogitsWarper(k)(None, z) if k else z
        z = TopPLogitsWarper(p)(None, z) if p < 1 else z
        ours = sampling.sampling_probs(logits, ev.Sampling(t, p, k))
        assert torch.allclose(ours, z.softmax(-1), atol=1e-6), (t, p, k)
        assert ((ours > 0).sum(-1) <= (k or 50)).all()
    one = sampling.sampling_probs(torch.tensor([2.0, 1.0, 0.0]), ev.Sampling(1.0, top_p=0.5))
    assert one.tolist() == [1.0, 0.0, 0.0]  # the top token alone holds 0.67 >= 0.5


def residual(p, d):
    """The rejection residual: p' with the rejected draft removed, renormalised."""
    r = p.clone()
    r[d] = 0
    return r / r.sum()


def verify_block(probs, drafts, gen, residual=residual):
    """One verification step with one-hot drafts: probs (B, V) = p' after the anchor and after each draft prefix.
    Accept draft i with probability p'_i(d_i); on the first rejection emit a sample of the residual; all accepted:
    emit a sample of p' after the last. Returns (accepted, emitted tokens)."""
    for i, d in enumerate(drafts):
        if torch.rand((), generator=gen) >= probs[i, d]:
            return i, drafts[:i] + [int(torch.multinomial(residual(probs[i], d), 1, generator=gen))]
    return len(drafts), drafts + [int(torch.multinomial(probs[len(drafts)], 1, generator=gen))]


def rejection_loop(target, drafter, prompt, n, s, gen):
    """Speculative sampling of n tokens with a real draft-verify loop (no cache): the drafter's argmax block at the
    anchor, one target pass over context + drafts for p', verify_block. Returns (tokens, acceptance lengths)."""
    nd, layers, B = ev.NeuralDrafter(drafter), drafter.cfg.target_layer_ids, drafter.cfg.block_size
    probs_after = lambda ids, k: sampling.sampling_probs(target.model(torch.tensor([ids])).logits[0, -k:], s)  # noqa
    tokens, lengths = [int(torch.multinomial(probs_after(prompt, 1)[0], 1, generator=gen))], []
    while len(tokens) < n:
        ctx = prompt + tokens
        features, _ = dflash.target_features(target, torch.tensor([ctx[:-1]]), layers)
        nd.start(target, ctx[:-1], features)
        drafts = nd.draft(tokens[-1], B - 1)
        accepted, new = verify_block(probs_after(ctx + drafts, B), drafts, gen)
        left = n - len(tokens)
        lengths.append(min(accepted, left) + 1)  # as the walk counts the last step: only tokens that exist
        tokens += new[:left]
    return tokens, lengths


SAMPLING = ev.Sampling(0.05, top_p=0.95, top_k=8)  # the tiny random target's logits are flat: sharpen them
RUNS, N = 40, 12


def test_sampled_walk_agrees_with_rejection_sampling_loop(dense):
    """Mean acceptance length per continuation, the walk over RUNS sampled continuations against the loop over
    RUNS seeds, within their standard errors; the greedy walk is far off (so the check can fail)."""
    target, drafter, prompt = dense["target"], dense["drafter"], dense["prompts"][0]
    walk = ev.evaluate_drafters(target, {"ours": drafter}, [prompt], N, progress=False,
                                sampling=ev.Sampling(**{**vars(SAMPLING), "samples": RUNS}))["results"][0]
    loop = [rejection_loop(target, drafter, prompt, N, SAMPLING, torch.Generator().manual_seed(seed))[1]
            for seed in range(RUNS)]
    means = [sum(x) / len(x) for x in loop]
    loop_mean, loop_se = sum(means) / RUNS, ev.stderr(means)
    walk_mean, walk_se = walk["tau_per_prompt"], walk["tau_per_prompt_stderr"]
    assert abs(walk_mean - loop_mean) < 3 * math.hypot(walk_se, loop_se), (walk_mean, walk_se, loop_mean, loop_se)
    pooled = sum(map(sum, loop)) / sum(map(len, loop))
    assert abs(walk["tau"] - pooled) < 3 * math.hypot(walk["tau_stderr"], loop_se), (walk["tau"], pooled)
    greedy = ev.evaluate_drafters(target, {"ours": drafter}, [prompt], N, progress=False)["results"][0]
    assert abs(greedy["tau"] - walk["tau"]) > 6 * walk["tau_stderr"], (greedy["tau"], walk["tau"])
    assert 1.15 < walk["tau"], walk  # drafts do get accepted at this temperature (measured here: ~1.3)


def test_rejection_step_emits_the_target_distribution(dense):
    """Plain sampling at the anchor draws from p'_0; one verification step emits its first token with the same
    frequencies (chi-square over many trials), and a residual that keeps the rejected draft does not."""
    target, drafter, prompt = dense["target"], dense["drafter"], dense["prompts"][1]
    s = ev.Sampling(0.1, top_k=8)
    ctx = prompt + [dense["continuations"][1][0]]
    nd = ev.NeuralDrafter(drafter)
    nd.start(target, ctx[:-1], dflash.target_features(target, torch.tensor([ctx[:-1]]), drafter.cfg.target_layer_ids)[0])
    drafts = nd.draft(ctx[-1], drafter.cfg.block_size - 1)
    probs = sampling.sampling_probs(target.model(torch.tensor([ctx + drafts])).logits[0, len(ctx) - 1:], s)
    p0 = probs[0]
    assert 0.1 < p0[drafts[0]] < 0.9, p0[drafts[0]]  # the draft is neither sure nor hopeless: the test has power
    trials = 4000

    def chi2(res):
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros_like(p0)
        for _ in range(trials):
            counts[verify_block(probs, drafts, gen, res)[1][0]] += 1
        keep = p0 > 0
        assert counts[~keep].sum() == 0  # never a token outside top_k
        return float(((counts[keep] - trials * p0[keep]) ** 2 / (trials * p0[keep])).sum()), int(keep.sum()) - 1

    stat, df = chi2(residual)
    assert stat < df + 5 * math.sqrt(2 * df), (stat, df)
    stat, df = chi2(lambda p, d: p)  # wrong: the rejected draft can be drawn again
    assert stat > df + 5 * math.sqrt(2 * df), (stat, df)


def test_sampled_continuations_are_seeded_and_follow_temperature(dense):
    target, prompts = dense["target"], dense["prompts"][:2]
    s = ev.Sampling(1.0, samples=3, seed=7)
    a = ev.evaluate_drafters(target, {"pl": ev.PromptLookupDrafter()}, prompts, 12, progress=False, sampling=s)
    b = ev.evaluate_drafters(target, {"pl": ev.PromptLookupDrafter()}, prompts, 12, progress=False, sampling=s)
    conts = [e["continuation"] for e in a["results"][0]["prompts"]]
    assert conts == [e["continuation"] for e in b["results"][0]["prompts"]]  # reproducible
    assert len(conts) == 6 and len(set(map(tuple, conts))) == 6             # 3 different samples per prompt
    assert [e["sample"] for e in a["results"][0]["prompts"]] == [0, 1, 2, 0, 1, 2]
    cold = ev.Sampling(1e-4, samples=2)  # near zero temperature: the greedy continuation
    c = ev.evaluate_drafters(target, {"pl": ev.PromptLookupDrafter()}, prompts, 12, progress=False, sampling=cold)
    assert [e["continuation"] for e in c["results"][0]["prompts"]] == \
        [cont[:12] for cont in dense["continuations"][:2] for _ in range(2)]


# -----------------------------------------------------------------------------
# The command line, and the tree tau inside training


def test_cli_json_sampled_and_tree(dense, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in dense["prompts"][:2]))
    drafter = str(tmp_path / "drafter")
    dflash.save_drafter(dense["drafter"], drafter, dtype=torch.float32)
    base = ["--target", dense["path"], "--drafter", drafter, "--prompts", str(prompts), "--max_new_tokens", "12",
            "--no_progress"]
    out = tmp_path / "s.json"
    ev.main(base + ["--temperature", "0.5", "--top_p", "0.9", "--top_k", "20", "--samples", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "temperature 0.5" in printed and "+-" in printed
    r = json.loads(out.read_text())
    assert (r["temperature"], r["top_p"], r["top_k"], r["samples"], r["seed"]) == (0.5, 0.9, 20, 3, 0)
    for res in r["results"]:
        assert {"tau", "tau_per_prompt", "tau_stderr", "tau_per_prompt_stderr"} <= set(res)
        assert len(res["prompts"]) == 6 and res["tau_stderr"] >= 0
    out = tmp_path / "t.json"
    ev.main(base + ["--tree_budget", "4,16", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "tree verification" in printed and "N=16" in printed and "no tree" in printed
    r = json.loads(out.read_text())
    assert r["temperature"] == 0 and r["tree_budgets"] == [4, 16]
    ours, lookup = r["results"]
    assert set(ours["tree"]) == {"4", "16"} and "tree" not in lookup and "tau_stderr" not in ours
    assert set(ours["tree"]["16"]) == {"tau", "tau_per_prompt"}
    assert 1 <= ours["tree"]["4"]["tau"] <= ours["tree"]["16"]["tau"]  # a bigger tree holds the smaller one


def test_training_logs_the_tree_tau_eval_reports(tmp_path):
    target = tiny_qwen3(tmp_path / "target")
    data = write_data(tmp_path / "d.jsonl", 32, seed=1)
    out = tmp_path / "out"
    args = dflash.get_parser().parse_args(
        ["--target", target, "--data", data, "--out", str(out), "--max_steps", "6", "--batch_size", "4",
         "--grad_accum", "1", "--labels", "data", *SMALL[:-6], "--eval_every", "0", "--save_every", "0",
         "--eval_fraction", "0.25", "--lr", "1e-2", "--eval_walk_prompts", "4", "--eval_walk_tokens", "16",
         "--eval_walk_tree_budget", "6"])
    _, _, tgt = dflash.train(args)
    with open(out / "metrics.jsonl") as f:
        last = [r for r in map(json.loads, f) if "eval_loss" in r][-1]
    samples = dflash.load_samples(data, tgt.tokenizer, args.max_len, say=lambda *a: None)
    prompts = dflash.walk_prompts(dflash.split_eval(samples, 0.25, args.seed)[1], 4)
    final = dflash.load_drafter(str(out / "step_6")).eval()
    r = ev.evaluate_drafters(tgt, {"final": final}, prompts, 16, tree_budgets=(6,), progress=False)["results"][0]
    assert r["tau"] == pytest.approx(last["eval_walk_tau"], abs=1e-6)
    assert r["tree"]["6"]["tau"] == pytest.approx(last["eval_walk_tree_tau"], abs=1e-6), (r["tree"], last)
    assert last["eval_walk_tree_tau"] >= last["eval_walk_tau"]


def test_bad_tau_mode_input_is_one_error_line(dense, capsys):
    base = ["--target", dense["path"], "--no_progress"]
    for argv, needles in [
            (["--temperature", "-0.5"], ["--temperature", ">= 0"]),
            (["--temperature", "1", "--top_p", "0"], ["--top_p", "> 0 and <= 1"]),
            (["--temperature", "1", "--top_p", "1.5"], ["--top_p", "> 0 and <= 1"]),
            (["--temperature", "1", "--top_k", "-1"], ["--top_k", ">= 0"]),
            (["--temperature", "1", "--samples", "0"], ["--samples", ">= 1"]),
            (["--tree_budget", "0"], ["--tree_budget", "at least 1"]),
            (["--tree_budget", "4,x"], ["--tree_budget", "list of integers"]),
            (["--top_p", "0.9"], ["--top_p", "--temperature > 0"]),
            (["--samples", "4"], ["--samples", "--temperature > 0"]),
            (["--temperature", "1", "--tree_budget", "8"], ["--tree_budget", "greedy", "--temperature"]),
            (["--tree_budget", "8", "--drafter", "prompt-lookup"], ["prompt-lookup", "no distribution"]),
            (["--tree_budget", "8", "--mode", "loop"], ["--mode loop", "drop"]),
            (["--temperature", "1", "--bench", "gsm8k"], ["--temperature", "--bench"])]:
        one_error(capsys, ev.main, base + argv, *needles)
    with pytest.raises(DFlashError, match="tree verification"):
        ev.check_modes("exact", True, (8,), False)
