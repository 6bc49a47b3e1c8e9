"""
eval.py: measure tau, the mean number of tokens per verification step, of DFlash drafters against their target.

Greedy speculative decoding is lossless: the accepted tokens are exactly the target's greedy continuation s. So tau
is exact without a decode loop: the target generates s once per prompt, one hooked pass over prompt + s gives every
context feature, and each drafter's blocks are walked along s as training walks them (dflash.walk_continuation).
Nothing is rolled back, so hybrid targets (Qwen3.5/3.6) work too; `--mode loop` runs a real decoding loop instead.

    # ours vs z-lab's drafter vs the prompt-lookup baseline, on the built-in coding prompts
    huggingface-cli download z-lab/Qwen3-8B-DFlash-b16 --local-dir drafters/zlab-q3-8b
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000 --drafter drafters/zlab-q3-8b \
        --max_new_tokens 2048 --json tau.json

    # your prompts (JSONL: {"prompt": ...} | {"messages": [...]} | {"text": ...} | {"input_ids": [...]})
    python eval.py --target Qwen/Qwen3.6-27B --drafter runs/q36/step_6000 --prompts mt_bench.jsonl --enable_thinking

    # a real speculative decoding loop (dense targets: Qwen3, Llama): tokens/s against plain greedy decoding
    python eval.py --target Qwen/Qwen3-8B --drafter runs/q3-8b/step_6000 --mode loop

    # saved reports in one table (refused unless measured alike), and the acceptance-length histograms drawn
    python eval.py --compare a.json --compare b.json --plot hist.png

As a library (dflash_tools/demo.py): `evaluate_drafters(target, {"ours": drafter, "prompt-lookup":
PromptLookupDrafter()}, prompts, max_new_tokens)` returns the report that `print_report` prints and `write_json` saves.

The report carries both conventions, `tau` pooled over all verification steps and `tau_per_prompt` the mean over
prompts of each one's mean (z-lab's "Average Acceptance length"), and how it was measured ("measured": thinking mode,
max_new_tokens, serving mode, hashes of the chat template and prompts): tau measured otherwise never share a table.
"""

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

import dflash
from dflash import DFlashError, accepted_prefix, greedy_continuation, need

PROMPT_LOOKUP = "prompt-lookup"  # its name in reports and on the command line
PROMPT_LOOKUP_MAX_NGRAM = 3      # match the last 3, 2, then 1 tokens of the context (longest first)
DEFAULT_BLOCK_SIZE = 16          # prompt-lookup's block size when no neural drafter sets one

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

def step_anchors(lengths):
    """Continuation index of each step's anchor: 0, then the running sum of the acceptance lengths."""
    return list(itertools.accumulate(lengths, initial=0))[:-1]

# -----------------------------------------------------------------------------
# Prompts: JSONL -> token-id lists

def chat_ids(tokenizer, messages, add_generation_prompt=False, **template_kwargs):  # the chat template's token ids
    kw = dict(tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs)
    return tokenizer(tokenizer.apply_chat_template(messages, **kw), add_special_tokens=False)["input_ids"]

def encode_prompt(rec, tokenizer, where, template_kwargs=None, vocab_size=None):
    """One record -> prompt token ids, each checked against vocab_size when given: {"prompt": str} a user turn through
    the chat template (raw text without one); {"messages": [...]} through the chat template, trailing assistant turns
    dropped (the target writes its own); {"text": str} raw text; {"input_ids": [...]} as is."""
    rec = dflash.chat_record(rec, where)  # ShareGPT's conversations: messages
    kind = dflash.record_kind(rec, where, tokenizer, ("input_ids", "messages", "prompt", "text"))
    if kind == "input_ids":
        need(rec["input_ids"] != [], f"{where}: input_ids is empty; a prompt needs at least one token")
        return dflash.check_ids(rec["input_ids"], vocab_size, where)
    kw = template_kwargs or {}
    if kind == "messages":
        messages = dflash.plain_messages(rec["messages"], where)  # content parts: their one text
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        need(messages, f"{where}: messages hold no turn before the assistant's")
        ids = chat_ids(tokenizer, messages, add_generation_prompt=True, **kw)
    elif kind == "prompt" and tokenizer.chat_template:
        ids = chat_ids(tokenizer, [{"role": "user", "content": rec["prompt"]}], add_generation_prompt=True, **kw)
    else:  # a prompt without a chat template, or text: raw text
        ids = tokenizer(rec[kind], add_special_tokens=False)["input_ids"]
    need(ids, f"{where}: the prompt encodes to no tokens")
    return dflash.check_ids(ids, vocab_size, where)

def load_prompts(path, tokenizer, enable_thinking=None, vocab_size=None):
    """A data file in any format dflash.py reads (read_records; or None: the built-in coding prompts) -> list of
    prompt token-id lists, each id checked against vocab_size when given."""
    kw = dflash.template_kwargs(tokenizer, enable_thinking)
    if path is None:
        need(tokenizer is not None, "the target has no tokenizer for the built-in prompts; pass --prompts of input_ids")
        return [encode_prompt({"prompt": p}, tokenizer, f"built-in prompt {i}", kw, vocab_size)
                for i, p in enumerate(BUILTIN_PROMPTS)]
    prompts = [encode_prompt(r, tokenizer, where, kw, vocab_size) for where, r in dflash.read_records(path, "prompts")]
    need(prompts, f"{path}: no prompts")
    return prompts

# -----------------------------------------------------------------------------
# The statistics of acceptance lengths (counted by dflash.acceptance_counts, as training's walked tau counts them)

def acceptance_stats(lengths, block_size):
    """tau = mean(accepted + 1) over steps; histogram[L-1]: steps with accepted + 1 = L (L = 1..B);
    per_offset_acceptance[k-1] = P(draft at offset k accepted) = P(accepted >= k) over ALL steps, so tau = 1 + sum."""
    steps, (histogram, accepting) = len(lengths), dflash.acceptance_counts(lengths, block_size)
    return {"tau": sum(lengths) / steps if steps else None, "steps": steps, "histogram": histogram,
            "per_offset_acceptance": [n / steps if steps else 0.0 for n in accepting]}

# tau by context depth: a step's depth is its anchor's position (prompt + continuation so far). Acceptance decays with
# depth for drafters trained at short length and a pooled tau hides it: reports split every figure by depth bucket.
DEPTH_EDGES_LONG = (1024, 4096, 16384, 65536)        # < 1k, 1-4k, 4-16k, 16-64k, >= 64k
DEPTH_EDGES_SHORT = (128, 256, 512, 1024, 2048)     # runs whose deepest anchor is below 4k

def depth_edges(max_depth, edges=None):
    """The bucket edges of a run (given ones kept): 1k, 4k, 16k, 64k when an anchor lies at 4k or deeper, else
    powers of two from 128 (empty buckets are left out of the report)."""
    if edges:
        return sorted(set(int(e) for e in edges))
    return list(DEPTH_EDGES_LONG if max_depth >= 4096 else DEPTH_EDGES_SHORT)

def depth_label(lo, hi):
    k = lambda n: f"{n // 1024}k" if n % 1024 == 0 else str(n)  # noqa: E731
    return f"< {k(hi)}" if lo == 0 else f">= {k(lo)}" if hi is None else f"{k(lo)}-{k(hi)}"

def step_depths(entry):
    """Each verification step's depth: the absolute position of its anchor, prompt_tokens + step_anchors."""
    return [entry["prompt_tokens"] + a for a in step_anchors(entry["acceptance_lengths"])]

def depth_stats(entries, block_size, edges):
    """The steps of entries split by depth bucket [lo, hi): acceptance_stats and accepted tokens per non-empty bucket.
    Each step falls in one bucket: steps, tokens and histograms sum to the pooled ones, tau is their weighted mean."""
    bounds, buckets = [0, *edges, None], [[] for _ in edges + [None]]
    for e in entries:
        for depth, n in zip(step_depths(e), e["acceptance_lengths"]):
            buckets[sum(depth >= x for x in edges)].append(n)
    return [{"depth": depth_label(lo, hi), "lo": lo, "hi": hi, **acceptance_stats(lengths, block_size),
             "accepted_tokens": sum(lengths)} for lo, hi, lengths in zip(bounds, bounds[1:], buckets) if lengths]

def add_depth(report, edges=None):
    """Every result of the report gets its depth buckets ("depth"), all on the same edges (report["depth_edges"]):
    the run's (depth_edges of its deepest anchor) unless given."""
    deepest = max((d for r in report["results"] for e in r.get("prompts", []) for d in step_depths(e)), default=0)
    report["depth_edges"] = edges = depth_edges(deepest, edges)
    for r in report["results"]:
        r["depth"] = depth_stats(r.get("prompts", []), r["block_size"], edges)
    return report

# -----------------------------------------------------------------------------
# How a tau was measured (dflash.measurement): two tau are comparable only when all of its settings agree

def measured_line(m):
    """The settings as the table's one line."""
    return "measured: " + ", ".join(f"{k} {v}" for k, v in m.items())

def check_same_measurement(reports):
    """{name: report} -> the shared settings; refuses (one error line per difference) tau measured differently."""
    (first, m0), *rest = ((n, r.get("measured")) for n, r in reports.items())
    problems = []
    for name, m in rest:
        if m is None or m0 is None:
            problems.append(f"{first if m0 is None else name} has no measurement settings (made by an older eval.py); "
                            f"measure both again")
            continue
        problems += [f"{name} was measured with {k} {m.get(k)}, {first} with {m0.get(k)}: their tau are not "
                     f"comparable; measure them under the same settings (one eval.py call)"
                     for k in sorted(set(m0) | set(m)) if m0.get(k) != m.get(k)]
    need(not problems, "\n".join(problems))
    return m0

# -----------------------------------------------------------------------------
# Drafters as eval sees them: walk(target, prompt, continuation, features, B, **kw) -> (walks, drafts, the rule's
# tensors) as dflash.walk_continuation (the exact walk); start(target, prompt, features), draft(anchor, num_drafts),
# accept(tokens, features) (the loop); layer_ids: the target layers whose features it reads ([] for prompt lookup).

class PromptLookup:
    """An n-gram index over a growing token list. draft(k): the k tokens after the most recent earlier occurrence of
    the last n tokens (n = max_ngram down to 1; a copy reaching the end repeats, LZ77-style); none without a match."""
    def __init__(self, tokens=(), max_ngram=PROMPT_LOOKUP_MAX_NGRAM):
        self.max_ngram, self.tokens = max_ngram, []
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
            if end is not None:  # a copy reaching L reads its own output: the period L - end repeats
                return [self.tokens[end + i % (L - end)] for i in range(k)]
        return []

class PromptLookupDrafter:
    """The prompt-lookup baseline: copy what followed the most recent earlier match of the last tokens."""
    block_size, layer_ids = None, []  # any block size; reads no target features

    def walk(self, target, prompt, continuation, features, B, **kw):
        """The chain along the continuation, the context indexed as the walk moves on; drafts: {anchor index: block}."""
        self.start(target, prompt, features)
        drafts = {}

        def accept(k, truth):
            self.lookup.extend(continuation[len(self.lookup.tokens) - len(prompt):k + 1])
            drafts[k] = self.lookup.draft(B - 1)
            return accepted_prefix(drafts[k], truth)
        return {"tau": dflash.walk_steps(continuation, accept)}, drafts, {}

    def start(self, target, prompt, features):
        self.lookup = PromptLookup(prompt)

    def draft(self, anchor, num_drafts):
        self.lookup.extend([anchor])
        return self.lookup.draft(num_drafts)

    def accept(self, tokens, features):
        self.lookup.extend(tokens[1:])  # the anchor is already indexed

class NeuralDrafter:
    """A DFlashDrafter (any variant): every anchor at once through its draft rule (the walk), or one block at a time
    over an incremental cache of per-layer context keys/values (the loop: rejected drafts' features never enter)."""
    def __init__(self, drafter):
        self.drafter, self.cfg = drafter, drafter.cfg
        self.block_size, self.layer_ids = drafter.cfg.block_size, drafter.cfg.target_layer_ids

    def walk(self, target, prompt, continuation, features, B, **kw):
        return dflash.walk_continuation(self.drafter, target, prompt, continuation, features, B, **kw)

    def start(self, target, prompt, features):
        """features (1, P, m*D) of the prompt's positions: the context of the first block."""
        self.target, self.kv, self.length = target, None, 0  # kv: per layer (k, v), each (1, length, hk, hd)
        self.accept(prompt, features)

    @torch.no_grad()
    def accept(self, tokens, features):
        """tokens became context: add their features (1, len(tokens), m*D) at positions length, length+1, ..."""
        new = self.drafter.context_kv(features.to(self.drafter.fc.weight.dtype), start=self.length)
        self.kv = new if self.kv is None else [(torch.cat([k0, k1], 1), torch.cat([v0, v1], 1))
                                               for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.length += features.shape[1]

    def draft(self, anchor, num_drafts):
        """The drafts after `anchor`, which sits at position self.length (its context is everything before it)."""
        h = self.block_hidden(anchor)
        logits = self.target.lm_head(h.to(self.target.lm_head.weight.dtype))
        drafts = self.drafter.draft(logits[None], h[None], torch.tensor([anchor], device=h.device))[0]  # its rule
        return drafts[0, :num_drafts].tolist()

    @torch.no_grad()
    def block_hidden(self, anchor):
        """(B-1, D) final-normed hidden states of the drafted offsets of the block anchored at position self.length."""
        cfg, dev = self.cfg, self.drafter.fc.weight.device
        ids = torch.full((1, 1, cfg.block_size), cfg.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0, 0] = anchor
        x = dflash.embed_blocks(self.target, ids).to(self.drafter.fc.weight.dtype)
        anchors, valid = torch.full((1, 1), self.length, device=dev), torch.ones(1, 1, dtype=torch.bool, device=dev)
        return self.drafter.blocks(x, anchors, valid, self.kv, self.length)[0, 0, 1:]

    def block_logits(self, anchor):
        """(B-1, V) logits of the block anchored at `anchor` (position self.length)."""
        return self.target.lm_head(self.block_hidden(anchor).to(self.target.lm_head.weight.dtype))

def select_layers(features, union, layer_ids):
    """features (1, S, len(union)*D) captured for the layers `union` -> (1, S, len(layer_ids)*D) for a subset."""
    idx, n = [union.index(t) for t in layer_ids], len(union)
    return features if idx == list(range(n)) else features.unflatten(-1, (n, -1))[:, :, idx].flatten(-2)

# How the target samples at temperature T > 0 (--temperature): dflash_tools/sampling.py walks its continuations
MAX_SAMPLES = 100  # --samples: continuations per prompt (tau's standard error shrinks as 1/sqrt: 100 is plenty)

@dataclass
class Sampling:
    """How the target samples: temperature (> 0), top_p (1: off), top_k (0: off); samples continuations per
    prompt, continuation j of prompt i drawn with a generator seeded by (seed, i, j)."""
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    samples: int = 1
    seed: int = 0

def measured(tokenizer, enable_thinking, max_new_tokens, sampling=None, prompts=None):
    """dflash.measurement's settings, serving as sampled at T > 0 (its temperature, top_p and top_k) when it is."""
    m, s = dflash.measurement(tokenizer, enable_thinking, max_new_tokens, prompts), sampling
    sampled = s is not None and s.temperature > 0
    return {**m, "serving": f"sampled T={s.temperature:g} top_p={s.top_p:g} top_k={s.top_k}"} if sampled else m

# -----------------------------------------------------------------------------
# Loop mode: a real speculative decoding loop with the target's KV cache

@torch.no_grad()
def speculative_decode(target, drafter, prompt, max_new_tokens, block_size, eos):
    """Greedy speculative decoding of up to max_new_tokens tokens (stopping after eos): each step drafts B-1 tokens
    after the anchor (the last token, at `pos`), verifies [anchor, drafts] in one target pass on the KV cache, keeps
    the accepted drafts and the target's own token, and crops the cache back to the accepted ones (all the drafter
    ever sees). Returns (tokens, acceptance lengths, drafts)."""
    from transformers import DynamicCache
    model, dev, layer_ids = target.model, target.lm_head.weight.device, drafter.layer_ids
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()  # sliding-window layers keep what a crop may need
    features = lambda store: torch.cat([store[t] for t in layer_ids], -1) if layer_ids else None  # noqa: E731
    with dflash.capture_hidden(target, layer_ids) as store:
        out = model(input_ids=torch.tensor([prompt], device=dev), cache=cache, use_cache=True, logits_to_keep=1)
    drafter.start(target, prompt, features(store))
    tokens = [int(out.logits[0, -1].argmax())]  # the prefill's token: the first anchor
    lengths, all_drafts = [], []
    while len(tokens) < max_new_tokens and tokens[-1] not in eos:
        pos = len(prompt) + len(tokens) - 1  # the anchor's position = tokens the caches hold
        drafts = drafter.draft(tokens[-1], block_size - 1)
        with dflash.capture_hidden(target, layer_ids) as store:
            out = model(input_ids=torch.tensor([[tokens[-1]] + drafts], device=dev), cache=cache, use_cache=True)
        choice = out.logits[0].argmax(-1).tolist()  # choice[i]: the target's token at pos+1+i
        accepted = accepted_prefix(drafts, choice)
        new = choice[:accepted + 1][:max_new_tokens - len(tokens)]  # accepted drafts + the target's own token
        new = new[:next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]  # up to an eos token
        lengths.append(min(accepted, len(new)) + 1)  # as tau_walk counts it: drafts match up to where tokens end
        all_drafts.append(drafts)
        drafter.accept([tokens[-1]] + drafts[:accepted], features(store)[:, :accepted + 1] if layer_ids else None)
        tokens += new
        cache.crop(pos + accepted + 1 - cache.get_seq_length())  # the target's own token is the next anchor
    return tokens, lengths, all_drafts

# -----------------------------------------------------------------------------
# Evaluation of several drafters on the same target and prompts

def as_eval_drafter(name, d, target, block_size):
    """A DFlashDrafter (wrapped) or an eval drafter object, checked; and the block size it is evaluated at."""
    d = NeuralDrafter(d) if isinstance(d, dflash.DFlashDrafter) else d
    need(isinstance(d, (NeuralDrafter, PromptLookupDrafter)),
         f"drafter {name}: {d!r} is neither a DFlashDrafter nor a PromptLookupDrafter")
    if d.block_size is not None:
        dflash.check_compatible(d.cfg, target, where=f"drafter {name}")
        need(not block_size or block_size <= d.block_size,
             f"--block_size {block_size} > drafter {name}'s {d.block_size}; give at most that")
    return d, block_size or d.block_size

def check_modes(mode, sampled, tree_budgets, given_continuations):
    """Refuse what has no meaning: the loop is greedy chains; trees and given (greedy) continuations do not sample."""
    need(mode != "loop" or not (sampled or tree_budgets),
         "--mode loop is greedy chains only; drop it for --temperature or --tree_budget")
    need(not (sampled and tree_budgets), "--tree_budget measures greedy tree verification; drop it or --temperature")
    need(not (sampled and given_continuations),
         "--temperature samples continuations, and --bench gives greedy ones; drop --temperature")

def evaluate_drafters(target, drafters, prompts, max_new_tokens=256, block_size=None, mode="exact", dump_drafts=False,
                      progress=True, continuations=None, sampling=None, tree_budgets=(), enable_thinking=None,
                      depth_buckets=None):
    """The JSON-shaped report of tau of each drafter ({name: DFlashDrafter | NeuralDrafter | PromptLookupDrafter}) on
    the same prompts (token-id lists) and continuations: mode "exact" (the walk) or "loop" (a real decoding loop on
    KV-cache targets). continuations: the target's greedy ones if known (else generated once per prompt). sampling: a
    Sampling with temperature > 0 walks sampling.samples continuations per prompt sampled from the target.
    tree_budgets: also trees of each number of nodes. enable_thinking: for "measured". depth_buckets: depth_edges."""
    from tqdm import tqdm
    need(drafters, "no drafters to evaluate")
    need(mode in ("exact", "loop"), f"unknown mode {mode!r}; use exact or loop")
    need(prompts and all(len(p) for p in prompts), "every prompt needs at least one token")
    need(continuations is None or len(continuations) == len(prompts),
         f"{len(continuations or ())} continuations for {len(prompts)} prompts")
    limit, _ = dflash.target_window(target.model.config.get_text_config())  # max_position_embeddings, or yarn's reach
    i, longest = max(enumerate(map(len, prompts)), key=lambda x: x[1])
    need(longest < limit, f"prompt {i} is {longest} tokens, the target takes {limit} positions; shorten it")
    sampled = sampling is not None and sampling.temperature > 0
    check_modes(mode, sampled, tree_budgets, continuations is not None)
    drafters = {name: as_eval_drafter(name, d, target, block_size) for name, d in drafters.items()}
    own = next((f"{n} ({d.cfg.architecture})" for n, (d, _) in drafters.items() if isinstance(d, NeuralDrafter)
                and type(d.drafter).draft is not dflash.DFlashDrafter.draft), None)  # a tree branches on the argmax
    need(not (tree_budgets and own), f"--tree_budget: drafter {own} drafts one chain by its own rule; drop "
         f"--tree_budget or that drafter")
    default_B = next((B for _, B in drafters.values() if B), DEFAULT_BLOCK_SIZE)  # for prompt lookup
    drafters = {name: (d, B or default_B) for name, (d, B) in drafters.items()}
    if mode == "loop":
        from transformers import DynamicCache
        need(DynamicCache(config=target.model.config).is_croppable,
             f"--mode loop: {target.name}'s recurrent state cannot be rolled back; use --mode exact")
    eos, timing = target.eos_ids(), {"generate_s": 0.0, "features_s": 0.0}
    per = {name: {"prompts": [], "time_s": 0.0} for name in drafters}
    if mode == "loop" and continuations is None:  # pay the one-time costs outside the timed greedy baseline
        greedy_continuation(target, prompts[0], 2, eos)
    samples = sampling.samples if sampled else 1
    for i, prompt in enumerate(tqdm(prompts, desc=f"tau ({mode})", disable=not progress, dynamic_ncols=True)):
        for j in range(samples):
            t0 = time.perf_counter()
            if sampled:
                g = torch.Generator(target.lm_head.weight.device).manual_seed(dflash.mix_seed(sampling.seed, i, j))
                continuation = dflash.import_tool("sampling", "--temperature").sampled_continuation(
                    target, prompt, max_new_tokens, eos, sampling, g)
            elif continuations is None:
                continuation = greedy_continuation(target, prompt, max_new_tokens, eos)
            else:
                continuation = [int(t) for t in continuations[i]]
            timing["generate_s"] += time.perf_counter() - t0
            accept_seed = dflash.mix_seed(sampling.seed, i, j, 1) if sampled else None
            for name, entry, seconds in evaluate_prompt(target, drafters, prompt, continuation, mode, max_new_tokens,
                                                        eos, dump_drafts, timing, tree_budgets,
                                                        sampling if sampled else None, accept_seed):
                per[name]["time_s"] += seconds
                per[name]["prompts"].append({**entry, "sample": j} if sampled else entry)
    results = [summarize_drafter(name, B, per[name], mode, timing if continuations is None else None,
                                 samples if sampled else None) for name, (_, B) in drafters.items()]
    return add_depth({"target": target.name, "mode": mode, "block_size": block_size or results[0]["block_size"],
                      "max_new_tokens": max_new_tokens, "num_prompts": len(prompts),
                      **asdict(sampling if sampled else Sampling(0.0)), "tree_budgets": list(tree_budgets),
                      "measured": measured(target.tokenizer, enable_thinking, max_new_tokens, sampling, prompts),
                      "timing": timing, "results": results}, depth_buckets)

def evaluate_prompt(target, drafters, prompt, continuation, mode, max_new_tokens, eos, dump_drafts, timing,
                    tree_budgets=(), sampling=None, accept_seed=None):
    """Yield (name, entry, seconds) for every drafter on one prompt. The exact method hooks the union of the drafters'
    context layers in one target pass, then walks each (dflash.walk_continuation): the entry holds the chain's, the
    trees' and the rule's other walks' acceptance lengths (NAME_acceptance_lengths), per boolean tensor of the rule
    (each true token among its candidates?) [hits, true tokens] (NAME_hits); sampled, a rule's q by sampled_lengths."""
    union = sorted({t for d, _ in drafters.values() for t in d.layer_ids})
    if mode == "exact" and union:
        t0 = time.perf_counter()
        ids = torch.tensor([prompt + continuation], device=target.lm_head.weight.device)
        features, final = dflash.target_features(target, ids, union)  # (1, S, len(union)*D), (1, S, D)
        timing["features_s"] += time.perf_counter() - t0
    for name, (d, B) in drafters.items():
        t0, entry = time.perf_counter(), {"prompt_tokens": len(prompt)}
        if mode == "loop":
            tokens, lengths, drafts = speculative_decode(target, d, prompt, max_new_tokens, B, eos)
            entry.update(continuation=tokens, acceptance_lengths=lengths, matches_greedy=tokens == continuation)
        else:
            ctx = select_layers(features, union, d.layer_ids) if d.layer_ids else None
            walks, drafts, more = d.walk(target, prompt, continuation, ctx, B, trees=tree_budgets,
                                         temperature=sampling.temperature if sampling else 0.0)
            lengths, trees = walks.pop("tau"), walks.pop("tree", {})
            if sampling and "q" in more:  # a rule that samples its block
                sampler = dflash.import_tool("sampling", "--temperature")
                p_truth = sampler.truth_probs(target, final, len(prompt), continuation, sampling)
                lengths = sampler.sampled_lengths(continuation, p_truth, more["q"],
                                                  torch.Generator().manual_seed(accept_seed))
            entry.update({f"{k}_acceptance_lengths": v for k, v in walks.items()})
            for k, v in more.items():
                if v.dtype == torch.bool:
                    seen = (torch.arange(len(v))[:, None] + torch.arange(1, B)) < len(continuation)  # truth exists
                    entry[f"{k}_hits"] = [int((v.cpu() & seen).sum()), int(seen.sum())]
            entry.update({"tree": {str(b): v for b, v in trees.items()}} if trees else {})
            drafts = [drafts[k] for k in step_anchors(lengths)]
            entry.update(continuation=continuation, acceptance_lengths=lengths)
        entry.update({"drafts": drafts} if dump_drafts else {})
        yield name, entry, time.perf_counter() - t0

def conventions(runs):
    """Both tau conventions over runs of acceptance lengths: (pooled over all steps, mean of each run's mean)."""
    steps, means = sum(len(r) for r in runs), [sum(r) / len(r) for r in runs if r]
    return (sum(map(sum, runs)) / steps if steps else None), (sum(means) / len(means) if means else None)

def stderr(values):
    """Standard error of the mean of independent values (None for fewer than two)."""
    n, m = len(values), sum(values) / len(values) if len(values) > 1 and None not in values else None
    return None if m is None else math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1) / n)

def summarize_drafter(name, B, per, mode, timing, samples=None):
    """One drafter's result: both tau conventions over every continuation (sampled: each one's standard error over
    runs of the prompt set), the trees' per budget, its rule's diagnostics (NAME_tau, NAME_recall of its hits)."""
    entries, lengths = per["prompts"], [n for e in per["prompts"] for n in e["acceptance_lengths"]]
    tau, tau_per_prompt = conventions([e["acceptance_lengths"] for e in entries])
    r = {"drafter": name, "block_size": B, **acceptance_stats(lengths, B), "tau": tau, "tau_per_prompt": tau_per_prompt,
         "tokens": sum(len(e["continuation"]) for e in entries), "time_s": per["time_s"]}
    if samples:
        runs = [conventions([e["acceptance_lengths"] for e in entries if e["sample"] == j]) for j in range(samples)]
        r["tau_stderr"], r["tau_per_prompt_stderr"] = (stderr([run[c] for run in runs]) for c in (0, 1))
    if entries and "tree" in entries[0]:
        r["tree"] = {b: dict(zip(("tau", "tau_per_prompt"), conventions([e["tree"][b] for e in entries])))
                     for b in entries[0]["tree"]}
    for k in entries[0] if entries else ():
        if k.endswith("_acceptance_lengths"):
            r[k.replace("_acceptance_lengths", "_tau")] = conventions([e[k] for e in entries])[0]
        elif k.endswith("_hits"):
            hits, count = (sum(e[k][c] for e in entries) for c in (0, 1))
            r[k.replace("_hits", "_recall")] = hits / count if count else None
    if mode == "loop":
        r["tokens_per_s"] = r["tokens"] / max(per["time_s"], 1e-9)
        r["greedy_tokens_per_s"] = r["tokens"] / timing["generate_s"] if timing else None
        r["matches_greedy"] = all(e["matches_greedy"] for e in entries)
    r["prompts"] = entries
    return r

# -----------------------------------------------------------------------------
# z-lab's benchmarks (--bench): prompts built as z-lab's benchmark.py builds them (dflash_tools/benchmarks.py)

def load_bench(spec, bench_dir, max_samples):
    """--bench -> {name: samples (lists of user turns)}, every dataset loaded and checked before any generation."""
    b = dflash.import_tool("benchmarks", "--bench")
    try:
        return {name: b.subset(b.conversations(name, b.load_rows(name, path, bench_dir), path), max_samples)
                for name, path in b.parse_bench(spec)}
    except b.BenchmarkError as e:
        raise DFlashError(str(e)) from None

def bench_turns(samples, target, max_new_tokens, enable_thinking, progress=True):
    """(prompts, continuations) of every assistant turn of the samples: each user turn through the target's chat
    template (thinking off unless asked, as z-lab's), the target's greedy answer, later turns after it (mt-bench)."""
    from tqdm import tqdm
    tok = target.tokenizer
    need(tok is not None and tok.chat_template, "--bench needs the target tokenizer's chat template, and it has none")
    kw, eos = dflash.template_kwargs(tok, bool(enable_thinking)), target.eos_ids()
    render = lambda messages: chat_ids(tok, messages, add_generation_prompt=True, **kw)  # noqa: E731
    generate = lambda ids: greedy_continuation(target, ids, max_new_tokens, eos)  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    turns = [t for s in tqdm(samples, desc="greedy answers", disable=not progress, dynamic_ncols=True)
             for t in dflash.import_tool("benchmarks", "--bench").run_conversation(s, render, generate, decode)]
    return [p for p, _ in turns], [c for _, c in turns]

def evaluate_bench(target, drafters, bench, max_new_tokens, block_size=None, enable_thinking=None, progress=True,
                   tree_budgets=(), depth_buckets=None):
    """{name: samples} -> {"benchmarks": {name: report}, "average": {drafter: {"tau", "tau_per_prompt"}}}: each
    benchmark's report (every drafter on the same turns), and the mean over benchmarks of each convention."""
    reports = {}
    for name, samples in bench.items():
        prompts, continuations = bench_turns(samples, target, max_new_tokens, enable_thinking, progress)
        reports[name] = {"benchmark": name, "num_samples": len(samples), **evaluate_drafters(
            target, drafters, prompts, max_new_tokens, block_size, progress=progress, continuations=continuations,
            tree_budgets=tree_budgets, enable_thinking=bool(enable_thinking), depth_buckets=depth_buckets)}
    names = [r["drafter"] for r in next(iter(reports.values()))["results"]]
    mean = lambda xs: sum(xs) / len(xs) if xs and None not in xs else None  # noqa: E731
    average = {d: {k: mean([next(r[k] for r in rep["results"] if r["drafter"] == d) for rep in reports.values()])
                   for k in ("tau", "tau_per_prompt")} for d in names}
    measured = dflash.measurement(target.tokenizer, bool(enable_thinking), max_new_tokens)
    return {"measured": {**measured, "benchmarks": ",".join(bench)}, "benchmarks": reports, "average": average}

def print_bench(result, file=None):
    """One table per benchmark, then every drafter's tau per benchmark side by side, with the mean over them."""
    out, reports = lambda s="": print(s, file=file or sys.stdout), result["benchmarks"]
    out(measured_line(result["measured"]))
    for name, rep in reports.items():
        out(f"== {name}: {rep['num_samples']} samples, {rep['num_prompts']} assistant turns")
        print_report(rep, file)
        out()
    w = max(16, *(len(d) for d in result["average"]))
    for k, what in (("tau_per_prompt", "tau/prompt (z-lab's convention)"), ("tau", "tau pooled")):
        out(f"== {what} per benchmark, and their mean")
        out(f"{'drafter':<{w}}" + "".join(f"  {n:>10}" for n in reports) + f"  {'average':>10}")
        for d, avg in result["average"].items():
            cells = [next(r[k] for r in rep["results"] if r["drafter"] == d) for rep in reports.values()] + [avg[k]]
            out(f"{d:<{w}}" + "".join(f"  {c:>10.3f}" if c is not None else f"  {'-':>10}" for c in cells))

# -----------------------------------------------------------------------------
# Report

def print_report(report, file=None):
    """The side-by-side table of tau, steps, tokens and time per drafter (with their errors, diagnostics and trees),
    then per acceptance length L = 1..B the steps and P(draft at offset L accepted), then all by context depth."""
    out = lambda s="": print(s, file=file or sys.stdout)  # noqa: E731
    f3 = lambda r, k: f"{r[k]:.3f}" if r.get(k) is not None else "-"  # noqa: E731
    results, t, loop, sampled = report["results"], report["timing"], report["mode"] == "loop", report.get("temperature")
    out(f"target {report['target']}  mode {report['mode']}  prompts {report['num_prompts']}  max_new_tokens "
        f"{report['max_new_tokens']}  ({'sampled' if sampled else 'greedy'} generation {t['generate_s']:.1f}s"
        + (")" if loop else f", context features {t['features_s']:.1f}s)"))
    if report.get("measured"):
        out(measured_line(report["measured"]))
    w = max(16, *(len(r["drafter"]) for r in results))
    out(f"{'drafter':<{w}}  {'B':>3}  {'tau':>6}  {'tau/prompt':>10}  {'steps':>7}  {'tokens':>7}  {'time_s':>7}"
        + (f"  {'tok/s':>8}  {'greedy':>8}  {'speedup':>7}  same-as-greedy" if loop else ""))
    for r in results:
        line = (f"{r['drafter']:<{w}}  {r['block_size']:>3}  {f3(r, 'tau'):>6}  {f3(r, 'tau_per_prompt'):>10}  "
                f"{r['steps']:>7}  {r['tokens']:>7}  {r['time_s']:>7.1f}")
        if loop:
            greedy = r["greedy_tokens_per_s"]
            vs = f"{greedy:>8.1f}  {r['tokens_per_s'] / greedy:>6.2f}x" if greedy else f"{'-':>8}  {'-':>7}"
            line += f"  {r['tokens_per_s']:>8.1f}  {vs}  {'yes' if r['matches_greedy'] else 'NO'}"
        out(line)
    out("tau: pooled over all steps of all prompts; tau/prompt: mean over prompts of each prompt's mean (z-lab's)")
    if sampled:
        out(f"sampled at temperature {report['temperature']:g}, top_p {report['top_p']:g}, top_k {report['top_k']} "
            f"(0: off), {report['samples']} continuations per prompt (seed {report['seed']}); each tau over all of "
            f"them, +- its standard error over the samples:")
        for r in results:
            out(f"  {r['drafter']:<{w}}  tau {f3(r, 'tau')} +- {f3(r, 'tau_stderr')}  tau/prompt "
                f"{f3(r, 'tau_per_prompt')} +- {f3(r, 'tau_per_prompt_stderr')}")
    for r in results:  # a draft rule's diagnostics (summarize_drafter)
        diagnostics = [f"{k} {v:.3f}" for k, v in r.items() if k.endswith(("_tau", "_recall")) and v is not None]
        if diagnostics:
            out(f"  {r['drafter']:<{w}}  its draft rule's diagnostics: {', '.join(diagnostics)}")
    if report.get("tree_budgets"):
        out("\ntree verification (greedy, DDTree's best-first tree of N draft nodes per step): tau | tau/prompt")
        out(f"{'drafter':<{w}}  {'chain':>15}" + "".join(f"  {f'N={b}':>15}" for b in report["tree_budgets"]))
        for r in results:
            if "tree" not in r:
                out(f"{r['drafter']:<{w}}  (no tree: it drafts one chain without a distribution to branch on)")
                continue
            cells = [r] + [r["tree"][str(b)] for b in report["tree_budgets"]]
            out(f"{r['drafter']:<{w}}" + "".join(f"  {c['tau']:>7.3f} | {c['tau_per_prompt']:>5.3f}" if c["tau"] is not
                                                 None else f"  {'-':>15}" for c in cells))
    out("\nL = accepted+1: steps with that acceptance length | P(draft at offset L accepted), over all steps")
    cws = [max(18, len(r["drafter"])) for r in results]  # a column as wide as its drafter's whole name
    out(f"{'L':>3}  " + "  ".join(f"{r['drafter']:>{cw}}" for r, cw in zip(results, cws)))
    for L in range(1, max(r["block_size"] for r in results) + 1):
        p = lambda r: f"{r['per_offset_acceptance'][L - 1]:.3f}" if L < r["block_size"] else "-"  # noqa: E731
        out(f"{L:>3}  " + "  ".join(f"{r['histogram'][L - 1]:>9} | {p(r):>6}".rjust(cw) if L <= r["block_size"]
                                    else " " * cw for r, cw in zip(results, cws)))
    if any(r.get("depth") for r in results):
        out("\nby context depth (the anchor's position: prompt + continuation so far); the buckets sum to the pooled "
            "figures")
        out(f"{'drafter':<{w}}  {'depth':>9}  {'tau':>6}  {'steps':>7}  P(draft at offset k accepted), k = 1..B-1")
        for r in results:
            for d in r.get("depth", []):
                out(f"{r['drafter']:<{w}}  {d['depth']:>9}  {f3(d, 'tau'):>6}  {d['steps']:>7}  "
                    + " ".join(f"{p:.3f}"[1:] if p < 1 else "1.00" for p in d["per_offset_acceptance"]))

def check_output_file(path, flag):
    """A file written at the end (write_json): a directory in its place refused, its location proven writable."""
    need(not os.path.isdir(path) and not path.endswith(os.sep), f"{flag} {path!r} is a directory; give a file path")
    dflash.check_writable_dir(os.path.dirname(os.path.abspath(path)), f"{flag} {path!r}")

def compare_reports(paths, depth_buckets=None):
    """--compare: saved --json reports -> one report holding all their drafters (named FILE:drafter when two share
    a name), refused unless every report was measured on the same target under the same settings."""
    reports = {}
    for path in paths:
        reports[path] = r = dflash.read_json(path, "eval.py report")
        need(isinstance(r, dict) and isinstance(r.get("results"), list),
             f"{path}: not an eval.py --json report of drafters (--bench: measure them in one run)")
    measured = check_same_measurement(reports)
    for key in ("target", "mode", "tree_budgets"):  # the table's columns, or what was measured, would differ
        seen = {json.dumps(r.get(key)) for r in reports.values()}
        need(len(seen) == 1, f"--compare: the reports differ in {key} ({', '.join(sorted(seen))}); give alike")
    names = [res["drafter"] for r in reports.values() for res in r["results"]]
    results = [{**res, "drafter": res["drafter"] if names.count(res["drafter"]) == 1 else f"{path}:{res['drafter']}"}
               for path, r in reports.items() for res in r["results"]]
    timing = {k: sum(r["timing"][k] for r in reports.values()) for k in ("generate_s", "features_s")}
    saved = {json.dumps(r.get("depth_edges")) for r in reports.values()}  # their own buckets where they share them
    edges = depth_buckets or (next(iter(reports.values())).get("depth_edges") if len(saved) == 1 else None)
    return add_depth({**next(iter(reports.values())), "measured": measured, "timing": timing, "results": results,
                      "compared": list(paths)}, edges)

def write_json(report, path):
    """The report to path, written aside and renamed: a failure (a full disk) is one line, no partial file."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        dflash.write_atomic(path, json.dumps(report))
    except OSError as e:
        raise DFlashError(f"cannot write {path} ({e.strerror}); the report above is the result") from None
    return path

# -----------------------------------------------------------------------------
# Command line

def load_drafters(names, target, dtype, prompt_lookup=True, attention="dense", allow_other_target=False):
    """--drafter values -> {name: NeuralDrafter | PromptLookupDrafter} (prompt lookup included unless told), each
    checked before its weights are read: its shape, and the target it was trained against (unless allowed)."""
    drafters, record = {}, None
    for name in names:
        if name == PROMPT_LOOKUP:
            drafters[name] = PromptLookupDrafter()
            continue
        path = dflash.resolve_drafter(name)  # a local directory, or a hub id downloaded once
        dflash.check_compatible(dflash.read_drafter_config(path), target, where=f"drafter {name}")
        record = record or dflash.target_record(target)
        dflash.check_trained_against(path, record, f"drafter {name}", allow_other_target)
        drafters[name] = NeuralDrafter(dflash.load_drafter(path, target.lm_head.weight.device, dtype, attention).eval())
    if prompt_lookup and PROMPT_LOOKUP not in drafters:
        drafters[PROMPT_LOOKUP] = PromptLookupDrafter()
    return drafters

def bounded_list(lo, hi, what, sort=False):
    """An argparse type: comma-separated integers in [lo, hi] (hi None: unbounded), sorted once each or as given."""
    def parse(s):
        values, most = dflash.int_list(s), f" and at most {hi}" if hi else ""
        if min(values) < lo or hi is not None and max(values) > hi:
            raise argparse.ArgumentTypeError(f"{s}: every {what} must be at least {lo}{most}")
        return sorted(set(values)) if sort else tuple(values)
    return parse

def sampling_args(args):
    """--temperature and its flags -> a Sampling, or None for greedy (where they have no meaning)."""
    if args.temperature == 0:
        given = next((f"--{f}" for f in ("top_p", "top_k", "samples") if getattr(args, f) is not None), None)
        need(not given, f"{given} shapes the target's sampling; give --temperature > 0 with it")
        return None
    return Sampling(args.temperature, 1.0 if args.top_p is None else args.top_p, args.top_k or 0, args.samples or 5,
                    args.seed)

def get_parser():
    p = dflash.ArgumentParser(description="Measure tau (tokens per verification step) of drafters on their target.")
    flag = dflash.flag
    flag(p, "--target", help="target model: a local directory or hub id (loaded as dflash.py does); unless --compare")
    flag(p, "--drafter", [], "drafter directory in the z-lab layout (z-lab's or one of our checkpoints), a hub id "
         "(owner/name, downloaded), or 'prompt-lookup'; repeat for a side-by-side comparison", action="append")
    flag(p, "--trust_variant_code", False, "import the variant code a drafter's config.json names (dflash_module)",
         action="store_true")
    flag(p, "--variant", None, "the variant module a drafter's config.json names (dflash_module), trusted: a module "
         "or a .py path, e.g. where it now lives; it reads the drafters of its architecture")
    flag(p, "--allow_other_target", False, "measure a drafter although it records another target than --target as "
         "the one it was trained against (refused otherwise)", action="store_true")
    flag(p, "--no_prompt_lookup", False, "leave out the prompt-lookup baseline", action="store_true")
    flag(p, "--prompts", None, "{prompt} | {messages} | {conversations} (ShareGPT) | {text} | {input_ids} records "
         "in JSONL, a JSON array, Parquet or a datasets.save_to_disk directory (default: 8 built-in coding prompts)")
    flag(p, "--limit", 0, "use only the first N prompts (0: all)", int)
    flag(p, "--max_new_tokens", None, "greedy continuation length per prompt (stops early at eos); default 256, or "
         "2048 with --bench (z-lab's)", int, lo=1)
    flag(p, "--bench", None, "z-lab's benchmarks, comma-separated: gsm8k, math500, humaneval, mbpp, mt-bench "
         "(NAME=FILE: that one from a local JSONL/JSON file in the dataset's schema); downloaded with `datasets`")
    flag(p, "--bench_dir", None, "with --bench: a directory of NAME.jsonl (or NAME.json) files, one row per line in "
         "each dataset's own schema (offline; default: download through datasets.load_dataset)")
    flag(p, "--max_samples", None, "with --bench: the same N samples of each benchmark for every drafter (the first "
         "N after a shuffle seeded with 0; default: all)", int, lo=1)
    flag(p, "--block_size", None, "evaluate at this block size (<= each drafter's trained one; drafts are truncated "
         "to B-1); default: each drafter's own, prompt-lookup the first drafter's or 16", int, lo=2)
    flag(p, "--mode", "exact", "exact: the walk along the greedy continuation, any target; loop: a real speculative "
         "decoding loop with the KV cache (dense targets), tokens/s and a check that it equals greedy decoding",
         choices=["exact", "loop"])
    flag(p, "--temperature", 0.0, "tau when the target samples at this temperature: the walk along continuations "
         "sampled from the target (one-hot drafts, as vLLM and SGLang; a rule sampling its block: rejection-sampled; "
         "0: greedy)", float)
    flag(p, "--top_p", None, "with --temperature: nucleus sampling (default: 1, off)", float, open_lo=True, hi=1)
    flag(p, "--top_k", None, "with --temperature: sample among the k most likely tokens (0: off, the default)", int)
    flag(p, "--samples", None, "with --temperature: continuations per prompt (default: 5)", int, lo=1, hi=MAX_SAMPLES)
    flag(p, "--seed", 0, "with --temperature: continuation j of prompt i is seeded (seed, i, j)", int, hi=2**32 - 1)
    flag(p, "--tree_budget", (), "also tau of greedy tree verification (DDTree's rule) with N draft nodes per step, "
         "comma-separated N beside the chain (drafters of the argmax; one with its own rule drafts one chain)",
         type=bounded_list(1, dflash.TREE_BUDGET_MAX, "budget"))
    flag(p, "--depth_buckets", None, "edges of the context-depth buckets every report splits tau by, comma-separated "
         "anchor positions (default: 1024,4096,16384,65536 when an anchor lies at 4k or deeper, else powers of two "
         "128..2048)", type=bounded_list(1, None, "edge (an anchor position)", sort=True))
    flag(p, "--enable_thinking", None, "passed to the chat template when it reads enable_thinking (default: the "
         "template's own default)", action=argparse.BooleanOptionalAction)
    flag(p, "--json", None, "write the full report (continuations, acceptance lengths per prompt) here")
    flag(p, "--dump_drafts", False, "also write every step's drafted tokens to --json", action="store_true")
    flag(p, "--plot", None, "draw each drafter's acceptance-length histogram (share of verification steps at each "
         "length 0..B, as z-lab's benchmark prints it) side by side into this PNG (needs matplotlib)",
         metavar="FILE.png")
    flag(p, "--compare", [], "no measuring: print the drafters of saved --json reports in one table (repeat it); "
         "refused unless all were measured on the same target with the same thinking mode, max_new_tokens, serving "
         "mode, chat template and prompts", action="append", metavar="REPORT.json")
    flag(p, "--attention", "auto", "drafter attention path for the exact method (auto: flex on CUDA, dense "
         "elsewhere)", choices=["auto", "flex", "dense"])
    flag(p, "--dtype", "auto", "target and drafter dtype (auto: bf16 on CUDA, fp32 on CPU)", choices=[*dflash.DTYPES])
    flag(p, "--device", None, "device (default: cuda if available, else cpu)")
    flag(p, "--trust_remote_code", False, "allow the target's custom code", action="store_true")
    flag(p, "--no_progress", False, "no progress bar (none unless stderr is a terminal)", action="store_true")
    flag(p, "--debug", False, "show tracebacks for input errors (or DFLASH_DEBUG=1)", action="store_true")
    return p

def run(args):
    dflash.chosen_plugins(["--variant", args.variant] * bool(args.variant) +  # a drafter's code runs only when asked to
                          ["--trust_variant_code"] * args.trust_variant_code)
    if args.plot:
        check_output_file(args.plot, "--plot")
        dflash.import_tool("plot", "--plot").pyplot()  # without matplotlib: one line, before the target loads
    if args.compare:
        given = next((f"--{k}" for k in ("target", "drafter", "prompts", "bench") if getattr(args, k)), None)
        need(not given, f"--compare tables saved reports and measures nothing; drop {given}")
        return finish(compare_reports(args.compare, args.depth_buckets), args, print_report)
    need(args.target, "--target is required (or --compare REPORT.json ... to table saved reports)")
    device, sampling = dflash.pick_device(args.device), sampling_args(args)
    need(not (args.tree_budget and PROMPT_LOOKUP in args.drafter),
         "--tree_budget: prompt-lookup has no distribution to grow a tree; drop its --drafter")
    check_modes(args.mode, sampling is not None, args.tree_budget, args.bench is not None)
    need(args.json or not args.dump_drafts, "--dump_drafts writes into the --json report; pass --json OUT too")
    if args.json:
        check_output_file(args.json, "--json")
    bench = None
    if args.bench is not None:
        for flag, bad in (("--prompts", args.prompts), ("--mode loop", args.mode == "loop"), ("--limit", args.limit),
                          ("--dump_drafts", args.dump_drafts)):
            need(not bad, f"--bench measures its own prompts with the exact method; drop {flag}")
        bench = load_bench(args.bench, args.bench_dir, args.max_samples)  # bad datasets fail before the target loads
    need(bench is not None or not (args.bench_dir or args.max_samples), "--bench_dir and --max_samples go with --bench")
    target = dflash.load_target(args.target, device, dflash.DTYPES[args.dtype], args.trust_remote_code)
    attention = "dense" if args.mode == "loop" or (args.attention == "auto" and device.type != "cuda") else \
        "flex" if args.attention == "auto" else args.attention  # the loop drafts one block of a new length a step
    drafters = load_drafters(args.drafter, target, target.lm_head.weight.dtype, not args.no_prompt_lookup, attention,
                             args.allow_other_target)
    kw = dict(progress=not args.no_progress and sys.stderr.isatty(), tree_budgets=args.tree_budget,
              depth_buckets=args.depth_buckets)  # a redirected log gets the table, not bar redraws
    if bench is not None:
        return finish(evaluate_bench(target, drafters, bench, args.max_new_tokens or 2048, args.block_size,
                                     args.enable_thinking, **kw), args, print_bench)
    prompts = load_prompts(args.prompts, target.tokenizer, args.enable_thinking, target.vocab_size)
    return finish(evaluate_drafters(target, drafters, prompts[:args.limit or None], args.max_new_tokens or 256,
                                    args.block_size, args.mode, args.dump_drafts, sampling=sampling,
                                    enable_thinking=args.enable_thinking, **kw), args, print_report)

def finish(report, args, show):
    """The report shown, written to --json and its histograms drawn to --plot, as asked."""
    show(report)
    if args.json:
        print(f"wrote {write_json(report, args.json)}")
    if args.plot:
        print(f"wrote {dflash.import_tool('plot', '--plot').plot_histograms(report, args.plot)}")
    return report

def main(argv=None):
    return dflash.run_main(run, get_parser().parse_args(argv))

if __name__ == "__main__":
    main()
