"""
The exact tau walk, shared by eval.py and by dflash.py's held-out evaluation (`eval_walk_tau` in metrics.jsonl).

Greedy speculative decoding is lossless: the accepted tokens are exactly the target's greedy continuation s. So
tau is computed without a decode loop: the target generates s once per prompt, one hooked pass over prompt + s
gives every context feature, the drafter drafts the block anchored at every position of s at once (each block sees
only the context before its anchor), and tau_walk walks those blocks along s.

Imports nothing of the project (dflash.py and eval.py both import it): the target and the drafter are duck-typed
(target.model, target.embed, target.lm_head; drafter.cfg, drafter.context_kv, drafter.blocks), and what lives in
dflash.py (the hooked feature pass, flex's padding rule) is passed in.
"""

import torch
import torch.nn.functional as F

MEMORY_BUDGET = 2**27  # elements of the largest intermediate when drafting many anchors at once


def accepted_prefix(drafts, truth):
    """Number of leading drafts equal to the truth (compared only where the truth exists)."""
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def tau_walk(continuation, drafts):
    """Acceptance lengths of greedy speculative decoding along the target's greedy continuation.

    continuation s: the n tokens the target generates; s[0] comes with the prefill, so the first block is anchored
    at s[0]. drafts[k]: the tokens drafted by the block anchored at s[k] (they predict s[k+1], s[k+2], ...), looked up
    only at the anchors the walk visits, in increasing order. Each step accepts the longest prefix of its drafts that
    equals s, then the target adds one token of its own: accepted + 1 tokens, and the next anchor is that token.
    The last step compares only against the tokens that exist. Returns [accepted + 1 per step]."""
    lengths, k = [], 0
    while k < len(continuation) - 1:
        d = drafts[k]
        accepted = accepted_prefix(d, continuation[k + 1:k + 1 + len(d)])
        lengths.append(accepted + 1)
        k += accepted + 1
    return lengths


def step_anchors(lengths):
    """Continuation index of each step's anchor: 0, then the running sum of the acceptance lengths."""
    anchors, k = [], 0
    for n in lengths:
        anchors.append(k)
        k += n
    return anchors


@torch.no_grad()
def greedy_continuation(target, prompt, max_new_tokens, eos):
    """The target's own cached greedy generation (hooks not active): up to max_new_tokens tokens, stopping after an
    eos token. Logits processors that would move the argmax (a repetition penalty in a hub generation_config, ...)
    are switched off: greedy verification accepts the plain argmax."""
    ids = torch.tensor([prompt], device=target.lm_head.weight.device)
    eos = sorted(eos)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=eos or None,
                                pad_token_id=eos[0] if eos else 0, repetition_penalty=1.0, no_repeat_ngram_size=0,
                                min_new_tokens=0)
    return out[0, len(prompt):].tolist()


def anchors_per_chunk(cfg, S, attention, budget=MEMORY_BUDGET):
    """How many blocks to draft at once so the largest intermediates stay near `budget` elements. Both paths share
    the context keys/values; the dense path's scores, (heads, B, S+B) per block, are alive twice while the softmax
    is formed, with the (B, S+B) mask (and the mask rule's integer intermediates) beside them; flex never
    materialises scores, so only the MLP and the logits grow with the number of blocks."""
    B = cfg.block_size
    per_anchor = 3 * B * cfg.intermediate_size + B * cfg.vocab_size
    if attention == "dense":
        per_anchor += 2 * (cfg.num_attention_heads + 1) * B * (S + B)
    return max(1, budget // per_anchor)


@torch.no_grad()
def draft_every_anchor(drafter, target, context_features, ids, first, padded_length=None, budget=MEMORY_BUDGET):
    """The training-mode forward at every anchor a = first..S-2 of ids (1, S), each block seeing only context < a
    (the mask rule). context_features (1, S, m*D). padded_length: flex's padding rule (dflash.padded_length), needed
    when the drafter's attention is flex. Returns (S-1-first, B-1) drafted ids, row k for anchor first+k."""
    cfg, flex = drafter.cfg, drafter.attention == "flex"
    B, dtype, S = cfg.block_size, drafter.fc.weight.dtype, ids.shape[1]
    anchors = torch.arange(first, S - 1, device=ids.device)
    if flex:  # few shapes for the compiled flex kernel: the context padded by the one rule (padding is never
        # visible: j >= S > a), anchors padded to whole chunks (padding anchors see nothing)
        pad = padded_length(S) - S
        context_features, ids = F.pad(context_features, (0, 0, 0, pad)), F.pad(ids, (0, pad))
    S_ctx = context_features.shape[1]
    chunk = anchors_per_chunk(cfg, S_ctx, drafter.attention, budget)
    kv = drafter.context_kv(context_features.to(dtype))  # per layer (1, S_ctx, hk, hd), computed once
    out = []
    for c in range(0, len(anchors), chunk):
        a = anchors[c:c + chunk]
        n = len(a)
        valid = torch.ones(n, dtype=torch.bool, device=ids.device)
        if flex and n < chunk:
            a, valid = torch.cat([a, a.new_zeros(chunk - n)]), torch.cat([valid, valid.new_zeros(chunk - n)])
        block = torch.full((1, len(a), B), cfg.mask_token_id, dtype=torch.long, device=ids.device)
        block[0, :, 0] = ids[0, a]                                                    # [tok[a], M, ..., M]
        h = drafter.blocks(target.embed(block).to(dtype), a[None], valid[None], kv, S_ctx)  # (1, N, B, D)
        out.append(target.lm_head(h[0, :n, 1:].to(target.lm_head.weight.dtype)).argmax(-1))  # (n, B-1)
    return torch.cat(out) if out else torch.zeros(0, B - 1, dtype=torch.long, device=ids.device)


# -----------------------------------------------------------------------------
# The walk inside training: a fixed set of held-out prompts, continuations generated once, walked at every eval


def walk_prompts(samples, num_prompts):
    """The prompt part (the tokens before the first loss token) of the first num_prompts (ids, loss_mask) samples
    that have one."""
    return [ids[:mask.index(1)] for ids, mask in samples if 1 in mask and mask.index(1) > 0][:num_prompts]


def held_out_walk(target, samples, num_prompts, num_tokens, rank=0, world=1):
    """This rank's share of the walk set, or None when off (num_prompts 0): walk_prompts of the held-out samples
    and the target's greedy continuation of each (num_tokens at most), generated here once. Rank r takes prompts
    r, r + world, ..."""
    if not num_prompts:
        return None
    mine = walk_prompts(samples, num_prompts)[rank::world]
    return mine, [greedy_continuation(target, p, num_tokens, target.eos_ids()) for p in mine]


@torch.no_grad()
def walk_tau(drafter, target, walk, world, features, padded_length):
    """Pooled tau of the walk over every rank's prompts: each rank walks its own, then the total of acceptance
    lengths and the number of steps are summed over ranks. features: dflash.target_features. None if no steps or
    the walk is off (walk None, the same on every rank)."""
    if walk is None:
        return None
    dev = target.lm_head.weight.device
    total = torch.zeros(2, device=dev)  # sum of acceptance lengths, steps
    layers = drafter.cfg.target_layer_ids
    for prompt, continuation in zip(*walk):
        ids = torch.tensor([prompt + continuation], device=dev)
        drafts = draft_every_anchor(drafter, target, features(target, ids, layers)[0], ids, len(prompt),
                                    padded_length).tolist()
        lengths = tau_walk(continuation, drafts)
        total += torch.tensor([sum(lengths), len(lengths)], device=dev)
    if world > 1:
        torch.distributed.all_reduce(total)
    return (total[0] / total[1]).item() if total[1] > 0 else None
