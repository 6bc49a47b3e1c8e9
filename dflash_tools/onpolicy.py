"""The on-policy stage (--stage onpolicy): a trained drafter (--init_from) trained where serving puts its blocks.

Every --onpolicy_every optimizer steps the current drafter is rolled out on the prompts of the step's training
samples (the tokens before their first loss token): the target continues each prompt (greedy, or sampled at
--onpolicy_temperature with eval.py's sampling), one hooked target pass over prompt + continuation gives the
drafter's context features and the target's final hidden states, and the drafter is walked along the continuation
exactly as eval.py walks it (its draft rule's drafts; a rule that samples its block is rejection-sampled at T > 0).
The rollout records the block starts, the proposals, the accepted lengths and the target's final hidden states where
serving's verification reads them: before offset i of a block anchored at a, the state on [context, anchor, d1 ...
d(i-1)]. Up to the first rejection that prefix is the continuation (the walk's pass has it); past it, the blocks'
B-1 drafts, batched, each over the sequence's KV cache cut at its anchor, give the rest (the draft-induced states;
a target with recurrent layers, whose state has no such cut: one batched pass over [tokens up to each anchor, its
drafts]). Through the target's lm_head they give the target's distribution p at every verified position.

The objective (Draft-OPD's, arXiv 2605.29343, by default) re-runs the drafter, with gradient, at the recorded block
starts. A block with m accepted drafts covers offsets 1..B-1 (those inside the continuation):
  - the committed tokens, offsets 1..m+1 (the accepted drafts and the first rejection), weight 1: fkl2, the
    two-outcome forward KL at the committed token y, p(y) log(p(y)/q(y)) + (1-p(y)) log((1-p(y))/(1-q(y)));
    or fkl, KL(p || q) over the vocabulary; or ce, CE to the target's greedy token through the drafter's block_loss
    (a variant's own terms too) (--onpolicy_accepted);
  - the rejected drafts, offsets m+1..B-1 (the first rejected draft included), weight decay^(i-1) by offset i:
    k3, the k3 estimator of KL(q || p) at the drafted token d, p(d)/q(d) - log(p(d)/q(d)) - 1; or rkl, KL(q || p);
    or tv, total variation; or tv1, total variation at offset m+1 only, weight 1 (--onpolicy_rejected,
    --onpolicy_decay); each side also takes MODULE_OR_PATH:NAME, a divergence of that module's DIVERGENCES
    (the registry below says its form: a new divergence is one file);
summed and divided by the global batch's sum of those weights; plus --onpolicy_sft_weight times the usual SFT loss
(dflash.dflash_loss) on random anchors of the same samples (default 0). --loss takes the place of the CE in both CE
terms (--onpolicy_accepted ce, the SFT term); beside another committed-side divergence it is refused. As the
authors' code: log-probabilities in fkl2 clamped to [-10, log(1 - eps)], k3's log-ratio to [-20, 20], both terms at
most 10. --onpolicy_rejected_from truth takes the rejected drafts' p from the target on the true continuation
instead (teacher-forced). q is what the drafter's logprobs hook says it drafts from (DFlash: the softmax of its
logits; a variant may add distributions over some tokens, each against p renormalised over those, the token before
each position given: the drafted one on the rejected side; at one token, a distribution without it adds nothing). p
is the target's softmax at --onpolicy_teacher_temperature (default: the rollout temperature, 1 for greedy rollouts;
< 1 sharpens it). The logits exist one chunk of tokens at a time, recomputed in backward (memory bounded as in SFT).
The stage runs on dflash.train_step (the Stage class): the optimizer step is the core's.

Rollout seeds derive from (--seed, step, sample key) and the rollouts live in the stage's state (saved in every
checkpoint), so a resumed run is bitwise the same. Each step appends a line to <out>/onpolicy.jsonl: the rollouts'
age in optimizer steps, their walked tau, the two loss terms, and the step's compute (target forward tokens,
drafter forward and backward tokens)."""
import itertools
import json
import math
import os
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import dflash

DEFAULTS = {"onpolicy_every": 1, "onpolicy_tokens": 64, "onpolicy_temperature": 0.0, "onpolicy_accepted": "fkl2",
            "onpolicy_rejected": "k3", "onpolicy_rejected_from": "drafts", "onpolicy_decay": 0.8,
            "onpolicy_sft_weight": 0.0, "onpolicy_teacher_temperature": None}
LOGP_MIN, LOSS_MAX = -10.0, 10.0  # the authors' clamps: fkl2's log-probabilities, each token's loss


def add_flags(g):
    f = dflash.flag
    f(g, "--onpolicy_every", None, "roll out every k optimizer steps, training on the latest rollouts in between "
      "(default 1)", int, lo=1)
    f(g, "--onpolicy_tokens", None, "tokens the target generates per rollout prompt (default 64)", int, lo=1)
    f(g, "--onpolicy_temperature", None, "rollout temperature, 0: greedy (default 0)", float, hi=100)
    f(g, "--onpolicy_accepted", None, "loss on the committed tokens, the accepted drafts and the first rejection: "
      "fkl2 (default: the two-outcome forward KL at the token), fkl, ce, or MODULE_OR_PATH:NAME (its DIVERGENCES)")
    f(g, "--onpolicy_rejected", None, "loss on the rejected drafts: k3 (default: the k3 estimator of KL(q||p) at the "
      "drafted token), rkl, tv, tv1 (total variation at the first one), none (off), or MODULE_OR_PATH:NAME")
    f(g, "--onpolicy_rejected_from", None, "the rejected drafts' p: drafts, the verifier's state on the drafted "
      "prefix (default); truth, the target's on the true continuation", choices=["drafts", "truth"])
    f(g, "--onpolicy_decay", None, "weight decay^(i-1) of the rejected draft at block offset i (default 0.8)", float,
      open_lo=True, hi=1)
    f(g, "--onpolicy_sft_weight", None, "weight of the SFT loss on random anchors (default 0: off)", float)
    f(g, "--onpolicy_teacher_temperature", None, "the target's temperature in p (default: the rollout's, 1 for "
      "greedy; < 1 sharpens it)", float, open_lo=True, hi=100)


def settings(args):
    """The stage's flags with their defaults filled in, as a dict."""
    return {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in DEFAULTS.items()}


def check(args):
    """Refuse the combinations that have no meaning, one line each, before any weights load."""
    need = dflash.need
    need(args.init_from, "--stage onpolicy trains a trained drafter further; add --init_from DIR (an SFT run's step_N)")
    s = settings(args)
    divergence_of(s["onpolicy_accepted"], "accepted"), divergence_of(s["onpolicy_rejected"], "rejected")
    need(args.loss == "ce" or s["onpolicy_accepted"] == "ce", f"--loss {args.loss}: the on-policy stage has its own "
         f"objective on the committed tokens (--onpolicy_accepted {s['onpolicy_accepted']}); --loss takes the place of "
         f"its CE: add --onpolicy_accepted ce, or drop --loss")
    need(args.labels == "target", "--labels data: the on-policy stage learns the target's own distribution; drop "
         "--labels")
    need(not getattr(args, "shard_target", False), "--shard_target: the on-policy rollouts generate per rank; drop "
         "--shard_target")
    need(not (args.onpolicy_rejected in ("none", "tv1") and args.onpolicy_decay is not None), "--onpolicy_decay "
         f"weighs the rejected drafts by offset, --onpolicy_rejected {args.onpolicy_rejected} none; drop one")
    need(s["onpolicy_tokens"] >= 2, "--onpolicy_tokens 1 gives no block to walk; use 2 or more")
    need(s["onpolicy_temperature"] == 0 or s["onpolicy_temperature"] > 1e-3, "--onpolicy_temperature: 0 (greedy) "
         "or at least 0.001")


# -----------------------------------------------------------------------------
# The rollout: eval.py's walk of the current drafter, recorded

def prompts_of(batch):
    """(row, prompt) of each row of a collated batch that has a prompt: the tokens before its first loss token."""
    out = []
    for r, mask in enumerate(batch["loss_mask"].tolist()):
        if 1 in mask and mask.index(1) > 0:
            out.append((r, batch["input_ids"][r, :mask.index(1)].tolist()))
    return out


@torch.no_grad()
def rollout(drafter, target, prompt, num_tokens, temperature=0.0, seed=0, accept_seed=0, continuation=None,
            induced=True):
    """The exact walk of drafter on one prompt: eval.py's (greedy, or at temperature T its sampled continuation,
    drawn with a generator seeded by seed, and acceptance rule, a sampling rule's uniforms seeded by accept_seed),
    recorded. continuation: the target's greedy one, captured before (not generated again: it does not depend on
    the drafter). induced False: no verification pass (the states past each first rejection stay the truth's).
    Returns {ids (S,), prompt_len, features (S, m*D), final (S, D), starts (n,) the continuation index of each
    block's anchor, accepted (n,), proposals (n, B-1), verify (n, B, D) verify_states', target_tokens}."""
    import eval as tau_eval
    dev, cfg = target.lm_head.weight.device, drafter.cfg
    eos = target.eos_ids()
    sampling = tau_eval.Sampling(temperature) if temperature > 0 else None
    sampler = dflash.import_tool("sampling", "--onpolicy_temperature") if sampling else None
    captured = continuation is not None
    if captured:
        dflash.need(not sampling, "a captured continuation is greedy; drop the temperature")
    elif sampling:
        g = torch.Generator(dev).manual_seed(seed)
        continuation = sampler.sampled_continuation(target, prompt, num_tokens, eos, sampling, g)
    else:
        continuation = dflash.greedy_continuation(target, prompt, num_tokens, eos)
    ids = torch.tensor([prompt + continuation], device=dev)
    features, final = dflash.target_features(target, ids, cfg.target_layer_ids)  # the walk's one hooked pass
    walks, drafts, details = dflash.walk_continuation(drafter, target, prompt, continuation, features,
                                                      temperature=temperature)  # eval.py's walk
    lengths, drafts = walks["tau"], torch.tensor(drafts, dtype=torch.long, device=dev).view(-1, cfg.block_size - 1)
    if sampling and "q" in details:  # a rule that samples its block (its q of each true token): rejection-sampled
        p_truth = sampler.truth_probs(target, final, len(prompt), continuation, sampling)
        lengths = sampler.sampled_lengths(continuation, p_truth, details["q"],
                                          torch.Generator().manual_seed(accept_seed))
    starts = torch.tensor(tau_eval.step_anchors(lengths), dtype=torch.long, device=dev)
    accepted, proposals = torch.tensor(lengths, dtype=torch.long, device=dev) - 1, drafts[starts]
    verify, verify_tokens = verify_states(target, ids[0], starts + len(prompt), accepted, proposals, final[0],
                                          induced)
    return {"ids": ids[0], "prompt_len": len(prompt), "features": features[0], "final": final[0], "starts": starts,
            "accepted": accepted, "proposals": proposals, "verify": verify,  # target tokens: the generation (P + n
            "target_tokens": (0 if captured else len(ids[0]) - 1) + len(ids[0]) + verify_tokens}  # - 1), two passes


@torch.no_grad()
def verify_states(target, ids, anchors, accepted, proposals, final, induced=True):
    """The target's final hidden states where serving's verification reads them: (n, B, D), [j, i] the state before
    offset i of block j (anchored at anchors[j], its drafts proposals[j]), on [ids up to the anchor, d1 ... d(i-1)];
    [j, 0] zeros. Offsets up to the first rejection (i <= m+1: the prefix is the continuation) are the walk's pass's
    (final (S, D)); the later ones inside the continuation come from the drafts of the blocks that have them, run as
    serving verifies a block: over the cached prefix ids[:a+1] (cached_drafts_pass), or for a target with recurrent
    layers one batched pass over [ids[:a+1], the B-1 drafts]. Returns (states, the target tokens run)."""
    n, B, S = proposals.shape[0], proposals.shape[1] + 1, len(ids)
    i = torch.arange(B, device=ids.device)
    out = final[(anchors[:, None] + i - 1).clamp(0, S - 1)]
    out[:, 0] = 0
    rows = [j for j in range(n) if induced and anchors[j] + accepted[j] + 2 < S and accepted[j] + 2 < B]
    if not rows:
        return out, 0
    if attention_only(target):
        states, tokens = cached_drafts_pass(target, ids, anchors[rows], proposals[rows])  # (r, B-1, D): after d_k
        first = lambda a: 0  # noqa: E731 (states[r, k]: the state after draft k+1, before offset k+2)
    else:
        seqs = [torch.cat([ids[:anchors[j] + 1], proposals[j]]) for j in rows]
        batch = torch.stack([F.pad(x, (0, max(map(len, seqs)) - len(x))) for x in seqs])  # right pads: causal, unseen
        with dflash.capture_hidden(target, []) as store:
            target.backbone(input_ids=batch, use_cache=False)
        states, tokens, first = store["final"], sum(map(len, seqs)), lambda a: a + 1  # noqa: E731
    for r, j in enumerate(rows):
        a, m = anchors[j].item(), accepted[j].item()
        hi = min(B, S - a)  # offsets inside the continuation
        out[j, m + 2:hi] = states[r, first(a) + m:first(a) + hi - 2].to(out.dtype)
    return out, tokens


def attention_only(target):
    """True when every decoder layer attends over a KV cache (no recurrent layer, whose state has no per-row cut)."""
    kinds = getattr(target.model.config.get_text_config(), "layer_types", None) or ["full_attention"]
    return not target.sharded and all(k in ("full_attention", "sliding_attention") for k in kinds)


@torch.no_grad()
def cached_drafts_pass(target, ids, anchors, drafts):
    """The target's final states on [ids[:a+1], drafts] for each anchor a (r,) and its drafts (r, B-1), from one
    cached pass over ids: each row a copy of the cache, masked past its anchor, its drafts at positions a+1.. (the
    prefix is not recomputed per block). Returns ((r, B-1, D), target tokens run)."""
    r, n, S = drafts.shape[0], drafts.shape[1], len(ids)
    cache = target.backbone(input_ids=ids[None], use_cache=True).cache
    cache.batch_repeat_interleave(r)
    seen = torch.arange(S, device=ids.device)[None] <= anchors[:, None]  # (r, S): each row's prefix ids[:a+1]
    mask = torch.cat([seen, seen.new_ones(r, n)], 1).long()
    positions = anchors[:, None] + 1 + torch.arange(n, device=ids.device)
    with dflash.capture_hidden(target, []) as store:
        target.backbone(input_ids=drafts, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
    return store["final"], S + r * n


def rollout_batch(drafter, target, batch, num_tokens, temperature, seed, step, captured=False, induced=True):
    """The rollouts of a collated micro-batch's prompts, each seeded by (seed, step, its sample key); captured: each
    row's loss tokens are already the target's greedy continuation of its prompt (walked, not generated again)."""
    was = drafter.training
    drafter.eval()
    kept = lambda r, p: batch["input_ids"][r, len(p):][batch["loss_mask"][r, len(p):] > 0].tolist()  # noqa: E731
    out = [rollout(drafter, target, p, num_tokens, temperature, dflash.mix_seed(seed, step, batch["keys"][r]),
                   dflash.mix_seed(seed, step, batch["keys"][r], 1), kept(r, p) if captured else None, induced)
           for r, p in prompts_of(batch)]
    drafter.train(was)
    return out


# -----------------------------------------------------------------------------
# The objective

def pack(rollouts, cfg, device):
    """Rollouts -> padded tensors: ids (b, S), context (b, S, m*D), final (b, S, D), then region_weights' first
    arguments: lengths (b,), anchors, valid, accepted (b, N), with N the most blocks of a row (padding anchors are
    invalid); then the blocks' inputs as drafted, [anchor, d1 ... d(B-1)] (b, N, B), and the verifier's states
    (b, N, B, D)."""
    S = max(len(r["ids"]) for r in rollouts)
    N = max(1, max(len(r["starts"]) for r in rollouts))
    pad = lambda t, n: F.pad(t, (0, 0) * (t.dim() - 1) + (0, n - t.shape[0]))  # noqa: E731
    stack = lambda key, n, f=lambda t, r: t: torch.stack([pad(f(r[key], r), n) for r in rollouts]).to(device)  # noqa
    ids, context, final = stack("ids", S), stack("features", S), stack("final", S)
    anchors = stack("starts", N, lambda t, r: t + r["prompt_len"])
    drafted = torch.cat([ids.gather(1, anchors)[..., None], stack("proposals", N)], -1)
    valid = torch.stack([torch.arange(N) < len(r["starts"]) for r in rollouts]).to(device)
    lengths = torch.tensor([len(r["ids"]) for r in rollouts], device=device)
    return ids, context, final, lengths, anchors, valid, stack("accepted", N), drafted, stack("verify", N)


def region_weights(lengths, anchors, valid, accepted, B, decay, rejected):
    """(b, N, B) weights of the committed side (offsets 1..m+1: 1) and of the rejected side (offsets m+1..B-1:
    decay^(i-1) at offset i; tv1: offset m+1 only, 1; none: 0), both 0 outside the continuation and on padding."""
    i = torch.arange(B, device=anchors.device)
    inside = (anchors[..., None] + i < lengths[:, None, None]) & valid[..., None] & (i > 0)
    m = accepted[..., None]
    acc = (inside & (i <= m + 1)).float()
    if rejected == "none":
        return acc, torch.zeros_like(acc)
    if rejected == "tv1":
        return acc, (inside & (i == m + 1)).float()
    return acc, torch.where(inside & (i >= m + 1), decay ** (i - 1).float(), 0.0)


# -----------------------------------------------------------------------------
# The divergences: DIVERGENCES maps a name to f(logq, logp) -> (T,), the token losses of q against p, both in log space.
# Over a distribution (the default) logq, logp are (T, K), K the vocabulary or the tokens a drafter's distribution
# holds (p renormalised over them); f.at_token = True: (T,), the two log-probabilities of one token (the committed one,
# or the drafted one on the rejected side). f.side, "accepted" or "rejected", keeps it to that side (unset: either).
# --onpolicy_accepted / --onpolicy_rejected name one, or MODULE_OR_PATH:NAME a name in that module's DIVERGENCES: a new
# divergence is one file (its code is trusted: the flag names it), e.g. jsd.py with DIVERGENCES = {"jsd": jsd}.

def fkl2(logq, logp):  # the two-outcome forward KL at the token, log-probabilities clamped (the authors')
    top = math.log1p(-torch.finfo(torch.float32).eps)
    lq, lp = logq.clamp(LOGP_MIN, top), logp.clamp(LOGP_MIN, top)
    return (lp.exp() * (lp - lq) + (1 - lp.exp()) * (torch.log1p(-lp.exp()) - torch.log1p(-lq.exp()))
            ).clamp(max=LOSS_MAX)


def k3(logq, logp):  # the k3 estimator of KL(q || p) at the drafted token, its log-ratio clamped (the authors')
    r = (logp - logq).clamp(-20, 20)
    return (r.exp() - r - 1).clamp(max=LOSS_MAX)


def fkl(logq, logp):  # KL(p || q)
    return (logp.exp() * (logp - logq)).sum(-1)


def rkl(logq, logp):  # KL(q || p)
    return (logq.exp() * (logq - logp)).sum(-1)


def tv(logq, logp):  # total variation
    return 0.5 * (logq.exp() - logp.exp()).abs().sum(-1)


fkl2.side = fkl.side = "accepted"
k3.side = rkl.side = tv.side = "rejected"
fkl2.at_token = k3.at_token = True
DIVERGENCES = {f.__name__: f for f in (fkl2, fkl, k3, rkl, tv)}
MODES = {"accepted": ("ce",), "rejected": ("tv1", "none")}  # the stage's own: ce through block_loss; tv1 is tv's


def divergence_of(name, side):
    """The divergence --onpolicy_<side> NAME names (None: the stage's own ce or none), refused in one line."""
    if name in MODES[side]:
        return tv if name == "tv1" else None
    module, _, key = name.rpartition(":")
    if module:  # a file or module outside: the flag naming it trusts it, as --loss does
        dflash.TRUSTED.add(os.path.realpath(module) if module.endswith(".py") else module)
    known = getattr(dflash.plugin(module, f"--onpolicy_{side} {name}"), "DIVERGENCES", {}) if module else DIVERGENCES
    f, names = known.get(key), [*MODES[side], *(k for k, g in DIVERGENCES.items() if g.side == side)]
    dflash.need(f is not None and getattr(f, "side", side) == side, f"--onpolicy_{side} {name}: no such divergence "
                f"of the {side} side; give one of {', '.join(names)}, or MODULE_OR_PATH:NAME (its DIVERGENCES)")
    return f


def divergence(drafter, h, f, prev, lm_head, mode, temperature, progress=None, token=None):
    """Per-token divergence (T,) of the drafter's q (from final-normed hidden states h (T, D), with gradient) to the
    target's p (from its final hidden states f (T, D)) by mode, a function of DIVERGENCES (token (T,): the token an
    at_token one reads). q is what the drafter's logprobs hook says it drafts from (prev (T,): the token before
    each row): a weighted sum over its distributions, each against p renormalised over its tokens (at a token one
    does not hold, it adds nothing). Chunks of tokens, recomputed in backward: no (T, V) tensor is kept."""
    chunk = dflash.vocab_chunk(lm_head.weight.shape[0])
    fp32 = torch.promote_types(lm_head.weight.dtype, torch.float32)  # (float64 in the tests)
    at_token = getattr(mode, "at_token", False)

    def piece(hc, fc, pc, tc):
        with torch.no_grad():
            logp = F.log_softmax(lm_head(fc.to(lm_head.weight.dtype)).to(fp32) / temperature, -1)
        out = 0
        for weight, logq, ids in drafter.logprobs(lm_head(hc.to(lm_head.weight.dtype)).to(fp32), hc, pc, progress):
            p = logp if ids is None else logp.gather(1, ids)  # over some tokens: p renormalised over them
            p = p if ids is None else p - p.logsumexp(-1, keepdim=True)
            if not at_token:
                out = out + weight * mode(logq, p)
                continue
            at = tc[:, None] if ids is None else (ids == tc[:, None]).float().argmax(1, keepdim=True)
            held = 1.0 if ids is None else (ids == tc[:, None]).any(1).to(fp32)
            out = out + weight * held * mode(logq.gather(1, at)[:, 0], p.gather(1, at)[:, 0])
        return out

    token = prev if token is None else token
    parts = [checkpoint(piece, *(x[s:s + chunk] for x in (h, f, prev, token)), use_reentrant=False)
             if torch.is_grad_enabled() else piece(*(x[s:s + chunk] for x in (h, f, prev, token)))
             for s in range(0, len(h), chunk)]
    return torch.cat(parts) if parts else h.new_zeros(0)


def onpolicy_terms(model, raw, target, cfg, rollouts, s, progress=None, loss=None):
    """The on-policy loss of one micro-batch's rollouts, unnormalised: (sum of weighted token losses, its weight
    total, the stats of the drafter's block_loss on the committed side, drafter tokens run). loss: --loss's object,
    the committed side's CE under --onpolicy_accepted ce (given the target's states there if it asks)."""
    dev, B = target.lm_head.weight.device, cfg.block_size
    ids, context, final, lengths, anchors, valid, accepted, drafted, verify = pack(rollouts, cfg, dev)
    acc_w, rej_w = region_weights(lengths, anchors, valid, accepted, B, s["onpolicy_decay"], s["onpolicy_rejected"])
    block_ids = dflash.block_input_ids(ids, anchors, B, cfg.mask_token_id)
    with torch.no_grad():
        x = dflash.embed_blocks(target, block_ids)
        greedy = dflash.block_labels(dflash.greedy_labels(final, target.lm_head), anchors, B)
    with torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext():
        hidden = model(context.to(raw.fc.weight.dtype), x, anchors, valid)                     # (b, N, B, D)
    # the committed side at offset i: the target's state final[a+i-1], the token before ids[a+i-1], the token ids[a+i]
    sides = [(divergence_of(s["onpolicy_accepted"], "accepted"), acc_w, dflash.block_labels(final, anchors - 1, B),
              dflash.block_labels(ids, anchors - 1, B), dflash.block_labels(ids, anchors, B))]
    if s["onpolicy_accepted"] == "ce":
        f = sides[0][2] if getattr(loss, "target_logits", False) else None
        loss, stats = raw.block_loss(hidden, target.lm_head, greedy, acc_w, block_ids, loss=loss, progress=progress,
                                     final=f)
    else:
        with torch.no_grad():
            _, stats = raw.block_loss(hidden.detach(), target.lm_head, greedy, acc_w, block_ids, progress=progress)
        loss = hidden.new_zeros((), dtype=torch.float32)
    if s["onpolicy_rejected"] != "none":  # the rejected side: the verifier's state, the drafted tokens
        drafts = s["onpolicy_rejected_from"] == "drafts"
        sides.append((divergence_of(s["onpolicy_rejected"], "rejected"), rej_w, verify if drafts else sides[0][2],
                      F.pad(drafted[..., :-1], (1, 0)) if drafts else sides[0][3], drafted))
    T = s["onpolicy_teacher_temperature"] or s["onpolicy_temperature"] or 1.0
    for mode, w, f, prev, token in sides:
        if mode is None:  # ce: block_loss's above
            continue
        sel = (w.flatten() > 0).nonzero().squeeze(1)
        h = hidden.reshape(-1, hidden.shape[-1])[sel]
        loss = loss + (divergence(raw, h, f.reshape(-1, f.shape[-1])[sel], prev.flatten()[sel], target.lm_head,
                                  mode, T, progress, token.flatten()[sel]) * w.flatten()[sel]).sum()
    return loss, acc_w.sum() + rej_w.sum(), stats, int(valid.sum()) * B


class Stage(dflash.SFT):
    """The on-policy stage on dflash.train_step's one optimizer step: plan rolls out when the step asks for it (else
    trains on the state's latest rollouts); a micro-batch's loss is its rollouts' terms over the global batch's sum
    of their weights, plus --onpolicy_sft_weight times the SFT loss on its random anchors."""

    captured = False  # True: the samples' loss tokens are the target's greedy continuations (a bench's, captured once)
    runs_target = True  # it generates and verifies with the target's layers: --features (none loaded) is refused

    def __init__(self, args, state):
        self.args, self.state, self.s = args, state, settings(args)

    def plan(self, inp, micro_batches):
        """The rollouts (when due) and, per micro-batch, the shares of the two normalisers: "op" the on-policy
        weights, "w" the SFT term's (none when --onpolicy_sft_weight is 0)."""
        s, state, cfg, dev = self.s, self.state, inp.cfg, inp.target.lm_head.weight.device
        raw, progress = inp.loss_kw.get("raw_model") or inp.model, inp.loss_kw.get("progress")
        self.step = step = progress[0] if progress else state.get("step", 0)
        compute = {"target_tokens": 0, "drafter_fwd_tokens": 0}
        if "rollouts" not in state or step % s["onpolicy_every"] == 0:
            state["rollouts"] = [rollout_batch(raw, inp.target, mb, s["onpolicy_tokens"], s["onpolicy_temperature"],
                                               self.args.seed, step, self.captured, s["onpolicy_rejected"] != "none"
                                               and s["onpolicy_rejected_from"] == "drafts") for mb in micro_batches]
            state["rollout_step"] = step
            rolled = [r for rs in state["rollouts"] for r in rs]
            compute["target_tokens"] += sum(r["target_tokens"] for r in rolled)
            compute["drafter_fwd_tokens"] += sum(len(r["ids"]) - r["prompt_len"] - 1 for r in rolled) * cfg.block_size
        state["step"] = step + 1
        rolled = [r for rs in state["rollouts"] for r in rs]
        walk = torch.tensor([float(sum(len(r["ids"]) - r["prompt_len"] - 1 for r in rolled)), float(
            sum(len(r["starts"]) for r in rolled))], device=dev)  # walked tokens (accepted + 1 each step), steps
        self.first = {"walk": walk, **{k: torch.tensor(float(v), device=dev) for k, v in compute.items()}}
        sft = super().plan(inp, micro_batches) if s["onpolicy_sft_weight"] > 0 else itertools.repeat(({}, None))
        for mb, rs, (shares, work) in zip(micro_batches, state["rollouts"], sft):
            dflash.need(rs or work, "a micro-batch has no prompt to roll out (each of its samples starts in the "
                        "loss) and --onpolicy_sft_weight is 0; give prompts or an --onpolicy_sft_weight")
            acc, rej = region_weights(*pack(rs, cfg, dev)[3:7], cfg.block_size, s["onpolicy_decay"],
                                      s["onpolicy_rejected"]) if rs else (torch.zeros((), device=dev),) * 2
            yield {"op": acc.sum() + rej.sum(), **shares}, (rs, work)

    def loss(self, inp, mb, work, totals):
        """The micro-batch's on-policy terms over totals["op"], plus --onpolicy_sft_weight x its SFT loss; its stats:
        the drafter's block_loss on the accepted side (the SFT term's without rollouts) and the log's figures."""
        (rs, sft), dev = work, inp.target.lm_head.weight.device
        zero = torch.zeros((), device=dev)
        out, op, sft_sum, n, stats = zero, zero, zero, 0, None
        if rs:
            op, _, stats, n = onpolicy_terms(inp.model, inp.loss_kw.get("raw_model") or inp.model, inp.target,
                                             inp.cfg, rs, self.s, inp.loss_kw.get("progress"), inp.loss_kw.get("loss"))
            out = op / totals["op"].clamp(min=1e-9)
        if sft:
            sft_out, sft_stats = super().loss(inp, mb, sft, totals)
            out = out + self.s["onpolicy_sft_weight"] * sft_out
            sft_sum, stats, n = sft_stats["ce_w"], stats or sft_stats, n + int(sft[1].sum()) * inp.cfg.block_size
        self.totals, first = totals, self.first
        self.first = {k: torch.zeros_like(v) for k, v in first.items()}  # the rollout's figures: once a step
        return out, {**stats, "op_loss": op.detach(), "sft_loss": sft_sum, "walk": first["walk"],
                     "target_tokens": first["target_tokens"] + (mb["tokens"] if sft else 0),
                     "drafter_fwd_tokens": first["drafter_fwd_tokens"] + n,
                     "drafter_bwd_tokens": torch.tensor(float(n), device=dev)}

    def after(self, stats):
        log(self.args, self.step, self.state, self.totals, stats)
        if (self.step + 1) % self.s["onpolicy_every"] == 0:  # the next step rolls out anew: no checkpoint needs these
            self.state.pop("rollouts")


TRIMMED = set()  # the onpolicy.jsonl files this process has trimmed to its first step


def log(args, step, state, totals, total):
    """Rank 0 appends the step's on-policy record to <out>/onpolicy.jsonl."""
    if (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0) or not getattr(args, "out", None):
        return
    walk = total["walk"].tolist()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    mean = lambda k, n: (total[k] / (world * totals[n]).clamp(min=1e-9)).item()  # noqa: E731 (totals: / world)
    record = {"step": step + 1, "rollout_age": step - state["rollout_step"],
              "rollout_tau": walk[0] / walk[1] if walk[1] else None, "onpolicy_loss": mean("op_loss", "op"),
              "sft_loss": mean("sft_loss", "w") if "w" in totals else None,
              **{k: int(total[k].item()) for k in ("target_tokens", "drafter_fwd_tokens", "drafter_bwd_tokens")}}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "onpolicy.jsonl")
    if path not in TRIMMED and os.path.exists(path):  # a resumed run: drop the records of the steps it redoes
        with open(path) as f:
            kept = [line for line in f if json.loads(line)["step"] <= step]
        with open(path, "w") as f:
            f.writelines(kept)
    TRIMMED.add(path)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
