"""
eval.py: measure tau, the mean number of tokens per verification step, of DFlash drafters against their target.

Greedy speculative decoding is lossless: the accepted tokens are exactly the target's greedy continuation s. So
tau is computed exactly without a decode loop (DESIGN 5): the target generates s once per prompt (its normal
cached generation), one hooked pass over prompt + s gives every context feature, and each drafter's blocks are
walked along s: draft the block anchored at s[k] from the context < its position, accept the longest prefix
that equals s, move the anchor past the accepted tokens and the target's own token, repeat. Nothing is ever
rolled back, so hybrid targets (Qwen3.5/3.6: Gated DeltaNet state) work too. `--mode loop` runs a real
speculative decoding loop instead (KV-cache targets only) and checks it reproduces plain greedy decoding.

    # ours vs z-lab's drafter vs the prompt-lookup baseline, on the built-in coding prompts
    huggingface-cli download z-lab/Qwen3-8B-DFlash-b16 --local-dir drafters/zlab-q3-8b
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000 --drafter drafters/zlab-q3-8b \
        --max_new_tokens 2048 --json tau.json

    # your prompts (JSONL: {"prompt": ...} | {"messages": [...]} | {"text": ...} | {"input_ids": [...]})
    python eval.py --target Qwen/Qwen3.6-27B --drafter runs/q36/step_6000 --prompts mt_bench.jsonl --enable_thinking

    # a real speculative decoding loop (dense targets: Qwen3, Llama): tokens/s against plain greedy decoding
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000 --mode loop

As a library (demo.py): `evaluate_drafters(target, {"ours": drafter, "prompt-lookup": "prompt-lookup"}, prompts,
max_new_tokens)` returns the report that `print_report` prints and `write_json` saves.
"""

import argparse
import json
import os
import sys
import time

import torch

import dflash
from dflash import DFlashError

PROMPT_LOOKUP = "prompt-lookup"
PROMPT_LOOKUP_MAX_NGRAM = 3      # match the last 3, 2, then 1 tokens of the context (longest first)
DEFAULT_BLOCK_SIZE = 16          # prompt-lookup's block size when no neural drafter sets one
MEMORY_BUDGET = 2**27            # elements of the largest intermediate when drafting many anchors at once

# Fresh coding prompts for when no --prompts is given (written for this project).
BUILTIN_PROMPTS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping closed intervals given as "
    "(start, end) tuples and returns them sorted. Include a docstring and three doctest examples.",
    "Implement an LRU cache class in Python with `get(key)` and `put(key, value)` in O(1) time, without using "
    "functools or OrderedDict. Explain the data structures you chose.",
    "Write a C function `int is_valid_utf8(const unsigned char *s, size_t n)` that returns 1 if the buffer is "
    "well-formed UTF-8 (rejecting overlong encodings and surrogates) and 0 otherwise.",
    "Given a SQL table `orders(id, customer_id, amount, created_at)`, write a query that returns, for each "
    "customer, their three largest orders of the last 90 days, and explain how it works.",
    "Write a Rust function that parses a string like \"3h25m10s\" into a std::time::Duration, returning a "
    "Result with a descriptive error for malformed input. Add unit tests.",
    "Write a bash script that finds the ten largest files under a directory given as the first argument, "
    "prints their sizes in human-readable form, and exits with an error message if the directory is missing.",
    "Implement Dijkstra's shortest path algorithm in Python using heapq for a graph given as a dict of "
    "adjacency lists with weights, and return both the distances and the predecessor of each node.",
    "Write a TypeScript debounce function with correct generic typing that also exposes `cancel()` and "
    "`flush()` methods, and show how to use it with a search input.",
]


# -----------------------------------------------------------------------------
# Prompts: JSONL -> token-id lists


def encode_prompt(rec, tokenizer, where, template_kwargs=None):
    """One JSONL record -> prompt token ids. {"prompt": str} is a single user turn through the chat template (raw
    text when the tokenizer has none); {"messages": [...]} goes through the chat template, trailing assistant
    turns dropped (the target writes its own); {"text": str} is raw text; {"input_ids": [...]} is used as is."""
    if not isinstance(rec, dict):
        raise DFlashError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    if "input_ids" in rec:
        ids = rec["input_ids"]
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise DFlashError(f"{where}: input_ids must be a non-empty list of integers")
        return ids
    if not any(k in rec for k in ("prompt", "messages", "text")):
        raise DFlashError(f"{where}: none of the known fields (prompt | messages | text | input_ids); "
                          f"got keys {sorted(rec)}")
    if tokenizer is None:
        raise DFlashError(f"{where}: the target has no tokenizer; use pre-tokenized {{\"input_ids\": [...]}} lines")
    kw = template_kwargs or {}
    if "messages" in rec:
        messages = rec["messages"]
        if not (isinstance(messages, list) and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise DFlashError(f"{where}: messages must be a list of {{\"role\": ..., \"content\": ...}} objects")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DFlashError(f"{where}: messages hold no turn before the assistant's")
        if not tokenizer.chat_template:
            raise DFlashError(f"{where}: messages need a chat template, and the target's tokenizer has none")
        ids = dflash.chat_ids(tokenizer, messages, add_generation_prompt=True, **kw)
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise DFlashError(f"{where}: prompt must be a string")
        if tokenizer.chat_template:
            turn = [{"role": "user", "content": rec["prompt"]}]
            ids = dflash.chat_ids(tokenizer, turn, add_generation_prompt=True, **kw)
        else:
            ids = tokenizer(rec["prompt"], add_special_tokens=False)["input_ids"]
    else:
        if not isinstance(rec["text"], str):
            raise DFlashError(f"{where}: text must be a string")
        ids = tokenizer(rec["text"], add_special_tokens=False)["input_ids"]
    if not ids:
        raise DFlashError(f"{where}: the prompt encodes to no tokens")
    return ids


def template_kwargs(tokenizer, enable_thinking):
    """Pass enable_thinking through only when it is set and the chat template reads it."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"enable_thinking": enable_thinking} if enable_thinking is not None and "enable_thinking" in template else {}


def load_prompts(path, tokenizer, enable_thinking=None):
    """A JSONL file (or None: the built-in coding prompts) -> list of prompt token-id lists."""
    kw = template_kwargs(tokenizer, enable_thinking)
    if path is None:
        if tokenizer is None:
            raise DFlashError("the target has no tokenizer, so the built-in prompts cannot be encoded; pass --prompts "
                              "with pre-tokenized {\"input_ids\": [...]} lines")
        return [encode_prompt({"prompt": p}, tokenizer, f"built-in prompt {i}", kw)
                for i, p in enumerate(BUILTIN_PROMPTS)]
    prompts = [encode_prompt(rec, tokenizer, where, kw) for where, rec in dflash.read_jsonl(path, "prompts")]
    if not prompts:
        raise DFlashError(f"{path}: no prompts")
    return prompts


# -----------------------------------------------------------------------------
# The tau walk (DESIGN 5) and the statistics of acceptance lengths


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


def acceptance_stats(lengths, block_size):
    """tau = mean(accepted + 1) over steps; histogram[L-1] = steps with accepted + 1 = L (L = 1..B);
    per_offset_acceptance[k-1] = P(draft at offset k accepted) over ALL steps = P(accepted >= k), k = 1..B-1
    (so tau = 1 + sum(per_offset_acceptance))."""
    steps = len(lengths)
    histogram = [0] * block_size
    for n in lengths:
        histogram[n - 1] += 1
    per_offset = [sum(n > k for n in lengths) / steps if steps else 0.0 for k in range(1, block_size)]
    return {"tau": sum(lengths) / steps if steps else None, "steps": steps, "histogram": histogram,
            "per_offset_acceptance": per_offset}


# -----------------------------------------------------------------------------
# The prompt-lookup baseline: copy what followed the most recent earlier match of the last tokens


def is_lookup(drafter):
    return isinstance(drafter, str) and drafter == PROMPT_LOOKUP


class PromptLookup:
    """An n-gram index over a growing token list. draft(k): find the most recent earlier occurrence of the last
    n tokens (n = max_ngram down to 1, longest first) and copy the k tokens that followed it; a copy that runs into
    the end of the context continues into its own output (LZ77-style), so a repeating pattern drafts a full block.
    No match: no drafts."""

    def __init__(self, tokens=(), max_ngram=PROMPT_LOOKUP_MAX_NGRAM):
        self.max_ngram = max_ngram
        self.tokens = []
        self.last_end = {}  # n-gram tuple -> end (exclusive) of its most recent occurrence before the current suffix
        self.extend(tokens)

    def extend(self, tokens):
        for t in tokens:
            L = len(self.tokens)
            for n in range(1, min(self.max_ngram, L) + 1):  # the suffixes ending here become "earlier" occurrences
                self.last_end[tuple(self.tokens[L - n:])] = L
            self.tokens.append(int(t))

    def draft(self, k):
        L = len(self.tokens)
        for n in range(min(self.max_ngram, L), 0, -1):
            end = self.last_end.get(tuple(self.tokens[L - n:]))
            if end is not None:
                out = []
                for i in range(k):
                    j = end + i
                    out.append(self.tokens[j] if j < L else out[j - L])
                return out
        return []


class LookupDrafts:
    """drafts[k] for tau_walk: prompt-lookup drafts for the block anchored at continuation[k], with the context
    (prompt + continuation[:k+1]) indexed incrementally (the walk asks for increasing k)."""

    def __init__(self, prompt, continuation, num_drafts):
        self.lookup = PromptLookup(prompt)
        self.continuation, self.num_drafts, self.upto = continuation, num_drafts, 0
        self.drafted = {}  # k -> drafts, so the walk's steps can be read again (--dump_drafts)

    def __getitem__(self, k):
        if k not in self.drafted:
            if k + 1 < self.upto:
                raise ValueError("LookupDrafts must be read at increasing anchors")
            self.lookup.extend(self.continuation[self.upto:k + 1])
            self.upto = k + 1
            self.drafted[k] = self.lookup.draft(self.num_drafts)
        return self.drafted[k]


# -----------------------------------------------------------------------------
# The target: greedy continuation, context features


def eos_token_ids(target):
    """The token ids that end a generation (the target's generation_config), as a set; used by both methods."""
    eos = getattr(target.model.generation_config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


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


def select_layers(features, union, layer_ids):
    """features (1, S, len(union)*D) captured for the layers `union` -> (1, S, len(layer_ids)*D) for a subset."""
    idx = [union.index(t) for t in layer_ids]
    if idx == list(range(len(union))):
        return features
    return features.unflatten(-1, (len(union), -1))[:, :, idx].flatten(-2)


# -----------------------------------------------------------------------------
# Exact method: draft at every anchor of the continuation in batches, then walk


def anchors_per_chunk(cfg, S, budget=MEMORY_BUDGET):
    """How many blocks to draft at once so the largest intermediates (the dense path's per-block copies of the
    context keys/values and its scores, the MLP, the logits) stay near `budget` elements."""
    B = cfg.block_size
    per_anchor = ((S + B) * (2 * cfg.num_key_value_heads * cfg.head_dim + 2 * cfg.num_attention_heads * B)
                  + 3 * B * cfg.intermediate_size + B * cfg.vocab_size)
    return max(1, budget // per_anchor)


@torch.no_grad()
def draft_every_anchor(drafter, target, context_features, ids, first, path="dense", budget=MEMORY_BUDGET):
    """The training-mode forward at every anchor a = first..S-2 of ids (1, S), each block seeing only context < a
    (the mask rule). context_features (1, S, m*D). Returns (S-1-first, B-1) drafted ids, row k for anchor first+k."""
    cfg = drafter.cfg
    B, dtype, S = cfg.block_size, drafter.fc.weight.dtype, ids.shape[1]
    anchors = torch.arange(first, S - 1, device=ids.device)
    if path == "flex":
        # few distinct shapes for the compiled flex kernel (it recompiles per shape): the context padded to a power
        # of two (padding is never visible, j >= S > a, and flex skips fully masked tiles), anchors padded to whole
        # chunks (padding anchors see nothing)
        pad = max(256, 1 << (S - 1).bit_length()) - S
        context_features = torch.nn.functional.pad(context_features, (0, 0, 0, pad))
        ids = torch.nn.functional.pad(ids, (0, pad))
    S_ctx = context_features.shape[1]
    chunk = anchors_per_chunk(cfg, S_ctx, budget)
    kv = drafter.context_kv(drafter.context(context_features.to(dtype)))  # per layer (1, S_ctx, hk, hd), computed once
    out = []
    for c in range(0, len(anchors), chunk):
        a = anchors[c:c + chunk]
        n = len(a)
        valid = torch.ones(n, dtype=torch.bool, device=ids.device)
        if path == "flex" and n < chunk:
            a = torch.cat([a, a.new_zeros(chunk - n)])
            valid = torch.cat([valid, valid.new_zeros(chunk - n)])
        x = target.embed(dflash.block_input_ids(ids, a[None], B, cfg.mask_token_id)).to(dtype)  # (1, N, B, D)
        h = drafter.blocks(x, a[None], valid[None], kv, S_ctx, path)                          # (1, N, B, D)
        logits = target.lm_head(h[0, :n, 1:].to(target.lm_head.weight.dtype))                   # (n, B-1, V)
        out.append(logits.argmax(-1))
    if not out:
        return torch.zeros(0, B - 1, dtype=torch.long, device=ids.device)
    return torch.cat(out)


# -----------------------------------------------------------------------------
# Loop mode: a real speculative decoding loop with the target's KV cache


def check_loop_target(target):
    from transformers import DynamicCache
    if not DynamicCache(config=target.model.config).is_croppable:
        raise DFlashError(f"--mode loop needs a target whose KV cache can be cropped after a rejected draft; "
                          f"{target.name} has recurrent (linear-attention) state that cannot be rolled back. "
                          f"Use --mode exact, which gives the same tau without rolling back")


@torch.no_grad()
def speculative_decode(target, drafter, prompt, max_new_tokens, block_size, eos):
    """Greedy speculative decoding of up to max_new_tokens tokens (stopping after eos), drafter a DFlashDrafter or
    PROMPT_LOOKUP. Each step drafts B-1 tokens after the anchor (the last token so far, at position `pos`), verifies
    [anchor, drafts] in one target pass on the KV cache, keeps the accepted drafts plus the target's own next token,
    and crops both caches back to the anchor and the accepted drafts. Returns (tokens, acceptance lengths, drafts)."""
    from transformers import DynamicCache
    model, dev = target.model, target.lm_head.weight.device
    neural = not is_lookup(drafter)
    layer_ids = drafter.cfg.target_layer_ids if neural else []
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding-window layers keep what a crop may need
    features = lambda store: torch.cat([store[t] for t in layer_ids], -1)  # noqa: E731  (1, T, m*D)

    ids = torch.tensor([prompt], device=dev)
    with dflash.capture_hidden(target, layer_ids) as store:
        out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    tokens = [int(out.logits[0, -1].argmax())]  # the prefill's token: the first anchor
    if neural:
        draft_cache = dflash.DraftCache(drafter)
        draft_cache.extend(features(store))
    else:
        lookup = PromptLookup(prompt + tokens)
    lengths, all_drafts = [], []
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        pos = len(prompt) + len(tokens) - 1  # the anchor's position = tokens the caches hold
        if neural:
            drafts = dflash.draft_block(drafter, draft_cache, tokens[-1], target.embed, target.lm_head)
            drafts = drafts[:block_size - 1].tolist()
        else:
            drafts = lookup.draft(block_size - 1)
        block = torch.tensor([[tokens[-1]] + drafts], device=dev)
        with dflash.capture_hidden(target, layer_ids) as store:
            out = model(input_ids=block, cache=cache, use_cache=True)
        choice = out.logits[0].argmax(-1).tolist()  # choice[i]: the target's token at pos+1+i
        accepted = accepted_prefix(drafts, choice)
        new = choice[:accepted + 1][:max_new_tokens - len(tokens)]  # accepted drafts + the target's own token
        for i, t in enumerate(new):
            if t in eos:
                new = new[:i + 1]
                break
        tokens += new
        lengths.append(min(accepted, len(new)) + 1)  # as tau_walk counts it: drafts match up to where tokens end
        all_drafts.append(drafts)
        keep = pos + accepted + 1  # the anchor and the accepted drafts; the target's own token is the next anchor
        cache.crop(keep - cache.get_seq_length())  # a negative count removes that many positions
        if neural:
            draft_cache.extend(features(store)[:, :accepted + 1])
            assert draft_cache.length == keep
        else:
            lookup.extend(new)
    return tokens, lengths, all_drafts


# -----------------------------------------------------------------------------
# Evaluation of several drafters on the same target and prompts


def resolve_block_sizes(drafters, block_size):
    """Per drafter: --block_size (at most the drafter's trained block size) or its own; prompt-lookup takes
    --block_size, else the first neural drafter's, else DEFAULT_BLOCK_SIZE."""
    neural = [d for d in drafters.values() if not is_lookup(d)]
    sizes = {}
    for name, d in drafters.items():
        if is_lookup(d):
            sizes[name] = block_size or (neural[0].cfg.block_size if neural else DEFAULT_BLOCK_SIZE)
        else:
            if block_size and block_size > d.cfg.block_size:
                raise DFlashError(f"--block_size {block_size} is larger than drafter {name}'s trained block size "
                                  f"{d.cfg.block_size}; it can only be evaluated at a block size <= {d.cfg.block_size}")
            sizes[name] = block_size or d.cfg.block_size
        if sizes[name] < 2:
            raise DFlashError(f"block size must be >= 2 (one anchor + drafts), got {sizes[name]}")
    return sizes


def evaluate_drafters(target, drafters, prompts, max_new_tokens=256, block_size=None, mode="exact", dump_drafts=False,
                      progress=True, path=None, continuations=None):
    """tau of each drafter on the same prompts and the same target continuations.

    drafters: {name: DFlashDrafter | "prompt-lookup"}; prompts: list of token-id lists; mode "exact" (DESIGN 5, any
    target) or "loop" (a real speculative decoding loop, KV-cache targets). continuations: the target's greedy
    continuations of the prompts if already known (else generated here, once per prompt, shared by all drafters;
    in loop mode they are the plain greedy reference). Returns the JSON-shaped report."""
    from tqdm import tqdm
    if not drafters:
        raise DFlashError("no drafters to evaluate")
    if mode not in ("exact", "loop"):
        raise DFlashError(f"unknown mode {mode!r}; use exact or loop")
    if max_new_tokens < 1:
        raise DFlashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DFlashError("every prompt needs at least one token")
    if continuations is not None and len(continuations) != len(prompts):
        raise DFlashError(f"{len(continuations)} continuations for {len(prompts)} prompts")
    for name, d in drafters.items():
        if isinstance(d, str) and not is_lookup(d):
            raise DFlashError(f"drafter {name}: {d!r} is neither a DFlashDrafter nor {PROMPT_LOOKUP!r}")
        if not is_lookup(d):
            dflash.check_compatible(d.cfg, target, where=f"drafter {name}")
    if mode == "loop":
        check_loop_target(target)
    sizes = resolve_block_sizes(drafters, block_size)
    dev = target.lm_head.weight.device
    path = path or dflash.default_attention_path(dev)
    eos = eos_token_ids(target)
    union = sorted({t for d in drafters.values() if not is_lookup(d) for t in d.cfg.target_layer_ids})

    per = {name: {"prompts": [], "time_s": 0.0} for name in drafters}
    timing = {"generate_s": 0.0, "features_s": 0.0}
    if mode == "loop" and continuations is None:  # pay the one-time costs outside the timed greedy baseline
        greedy_continuation(target, prompts[0], 2, eos)
    for i, prompt in enumerate(tqdm(prompts, desc=f"tau ({mode})", disable=not progress, dynamic_ncols=True)):
        t0 = time.perf_counter()
        if continuations is None:
            continuation = greedy_continuation(target, prompt, max_new_tokens, eos)
        else:
            continuation = [int(t) for t in continuations[i]]
        timing["generate_s"] += time.perf_counter() - t0
        if mode == "exact" and union:
            t0 = time.perf_counter()
            ids = torch.tensor([prompt + continuation], device=dev)
            features, _ = dflash.target_features(target, ids, union)  # (1, S, len(union)*D), one hooked pass
            timing["features_s"] += time.perf_counter() - t0
        for name, d in drafters.items():
            B = sizes[name]
            t0 = time.perf_counter()
            if mode == "loop":
                tokens, lengths, drafts = speculative_decode(target, d, prompt, max_new_tokens, B, eos)
                entry = {"prompt_tokens": len(prompt), "continuation": tokens, "acceptance_lengths": lengths,
                         "matches_greedy": tokens == continuation}
            else:
                if is_lookup(d):
                    at = LookupDrafts(prompt, continuation, B - 1)
                else:
                    ctx = select_layers(features, union, d.cfg.target_layer_ids)
                    at = draft_every_anchor(d, target, ctx, ids, len(prompt), path)[:, :B - 1].tolist()
                lengths = tau_walk(continuation, at)
                drafts = [at[k] for k in step_anchors(lengths)] if dump_drafts else None
                entry = {"prompt_tokens": len(prompt), "continuation": continuation, "acceptance_lengths": lengths}
            if dump_drafts:
                entry["drafts"] = drafts
            per[name]["time_s"] += time.perf_counter() - t0
            per[name]["prompts"].append(entry)

    results = []
    for name in drafters:
        entries = per[name]["prompts"]
        lengths = [n for e in entries for n in e["acceptance_lengths"]]
        r = {"drafter": name, "block_size": sizes[name], **acceptance_stats(lengths, sizes[name]),
             "tokens": sum(len(e["continuation"]) for e in entries), "time_s": per[name]["time_s"]}
        if mode == "loop":
            r["tokens_per_s"] = r["tokens"] / max(per[name]["time_s"], 1e-9)
            r["greedy_tokens_per_s"] = r["tokens"] / timing["generate_s"] if continuations is None else None
            r["matches_greedy"] = all(e["matches_greedy"] for e in entries)
        r["prompts"] = entries
        results.append(r)
    return {"target": target.name, "mode": mode, "block_size": block_size or results[0]["block_size"],
            "max_new_tokens": max_new_tokens, "num_prompts": len(prompts), "timing": timing, "results": results}


# -----------------------------------------------------------------------------
# Report


def print_report(report, file=None):
    """The side-by-side table: tau, steps, tokens and time per drafter, then per acceptance length L = 1..B the
    histogram count and P(draft at offset L accepted) over all steps."""
    file = file or sys.stdout
    out = lambda s="": print(s, file=file)  # noqa: E731
    results = report["results"]
    t = report["timing"]
    out(f"target {report['target']}  mode {report['mode']}  prompts {report['num_prompts']}  max_new_tokens "
        f"{report['max_new_tokens']}  (greedy generation {t['generate_s']:.1f}s"
        + (f", context features {t['features_s']:.1f}s)" if report["mode"] == "exact" else ")"))
    w = max(16, *(len(r["drafter"]) for r in results))
    loop = report["mode"] == "loop"
    out(f"{'drafter':<{w}}  {'B':>3}  {'tau':>6}  {'steps':>7}  {'tokens':>7}  {'time_s':>7}"
        + (f"  {'tok/s':>8}  {'greedy':>8}  {'speedup':>7}  same-as-greedy" if loop else ""))
    for r in results:
        tau = f"{r['tau']:.3f}" if r["tau"] is not None else "-"
        line = (f"{r['drafter']:<{w}}  {r['block_size']:>3}  {tau:>6}  {r['steps']:>7}  {r['tokens']:>7}  "
                f"{r['time_s']:>7.1f}")
        if loop:
            greedy = r["greedy_tokens_per_s"]
            vs = f"{greedy:>8.1f}  {r['tokens_per_s'] / greedy:>6.2f}x" if greedy else f"{'-':>8}  {'-':>7}"
            line += f"  {r['tokens_per_s']:>8.1f}  {vs}  {'yes' if r['matches_greedy'] else 'NO'}"
        out(line)
    out()
    out("L = accepted+1: steps with that acceptance length | P(draft at offset L accepted), over all steps")
    cw = 18
    out(f"{'L':>3}  " + "  ".join(f"{r['drafter'][-cw:]:>{cw}}" for r in results))
    for L in range(1, max(r["block_size"] for r in results) + 1):
        cells = []
        for r in results:
            if L > r["block_size"]:
                cells.append(" " * cw)
                continue
            p = f"{r['per_offset_acceptance'][L - 1]:.3f}" if L < r["block_size"] else "-"
            cells.append(f"{r['histogram'][L - 1]:>9} | {p:>6}".rjust(cw))
        out(f"{L:>3}  " + "  ".join(cells))


def write_json(report, path):
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)
    return path


# -----------------------------------------------------------------------------
# Command line


def load_drafters(names, target, dtype, prompt_lookup=True):
    """--drafter values -> {name: DFlashDrafter | "prompt-lookup"}, each checked against the target before its
    weights are read; the prompt-lookup baseline is included unless prompt_lookup is False."""
    drafters = {}
    for name in names:
        if name == PROMPT_LOOKUP:
            drafters[name] = PROMPT_LOOKUP
            continue
        cfg = dflash.read_drafter_config(name)
        dflash.check_compatible(cfg, target, where=f"drafter {name}")
        drafters[name] = dflash.load_drafter(name, target.lm_head.weight.device, dtype).eval()
    if prompt_lookup and PROMPT_LOOKUP not in drafters:
        drafters[PROMPT_LOOKUP] = PROMPT_LOOKUP
    return drafters


def get_parser():
    p = argparse.ArgumentParser(description="Measure tau (tokens per verification step) of DFlash drafters against "
                                            "their target.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--target", required=True, help="target model: a local directory or a hub id (loaded as dflash.py does)")
    a("--drafter", action="append", default=[],
      help="drafter directory in the z-lab layout (z-lab's or one of our checkpoints), or 'prompt-lookup'; repeat "
           "for a side-by-side comparison")
    a("--no_prompt_lookup", action="store_true", help="leave out the prompt-lookup baseline (included by default)")
    a("--prompts", default=None,
      help="JSONL of {prompt} | {messages} | {text} | {input_ids} lines (default: 8 built-in coding prompts)")
    a("--limit", type=int, default=0, help="use only the first N prompts (0: all)")
    a("--max_new_tokens", type=int, default=256, help="greedy continuation length per prompt (stops early at eos)")
    a("--block_size", type=int, default=None,
      help="evaluate at this block size (<= each drafter's trained one; drafts are truncated to B-1); default: each "
           "drafter's own, prompt-lookup the first drafter's or 16")
    a("--mode", choices=["exact", "loop"], default="exact",
      help="exact: DESIGN 5, no decode loop, any target; loop: a real speculative decoding loop with the KV cache "
           "(dense targets), reports tokens/s and checks the output equals plain greedy decoding")
    a("--enable_thinking", action=argparse.BooleanOptionalAction, default=None,
      help="passed to the chat template when it reads enable_thinking (default: the template's own default)")
    a("--json", default=None, help="write the full report (continuations, acceptance lengths per prompt) here")
    a("--dump_drafts", action="store_true", help="also write every verification step's drafted tokens to --json")
    a("--attention", choices=["auto", "flex", "dense"], default="auto",
      help="drafter attention path for the exact method (auto: flex on CUDA, dense elsewhere)")
    a("--dtype", choices=["auto", "bf16", "fp32", "fp16"], default="auto",
      help="target and drafter dtype (auto: bf16 on CUDA, fp32 on CPU)")
    a("--device", default=None, help="device (default: cuda if available, else cpu)")
    a("--trust_remote_code", action="store_true", help="allow the target's custom code")
    a("--no_progress", action="store_true", help="no progress bar")
    a("--debug", action="store_true", help="show tracebacks for input errors (or DFLASH_DEBUG=1)")
    return p


def run(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    if args.dump_drafts and not args.json:
        raise DFlashError("--dump_drafts writes into the --json report; pass --json OUT too")
    target = dflash.load_target(args.target, device, dtype, args.trust_remote_code)
    drafters = load_drafters(args.drafter, target, target.lm_head.weight.dtype, prompt_lookup=not args.no_prompt_lookup)
    prompts = load_prompts(args.prompts, target.tokenizer, args.enable_thinking)
    if args.limit:
        prompts = prompts[:args.limit]
    path = None if args.attention == "auto" else args.attention
    report = evaluate_drafters(target, drafters, prompts, args.max_new_tokens, args.block_size, args.mode,
                               args.dump_drafts, progress=not args.no_progress, path=path)
    print_report(report)
    if args.json:
        print(f"wrote {write_json(report, args.json)}")
    return report


def main(argv=None):
    return dflash.run_main(run, get_parser().parse_args(argv))


if __name__ == "__main__":
    main()
