"""Draft-OPD (the on-policy stage's default objective, dflash_tools/onpolicy.py) against SFT on the demo's tiny
target: paired per-prompt differences with bootstrap intervals, so that the bench can decide.

    python dflash_tools/onpolicy_bench.py --work out/opd            # set-up, the arms, table and plot
    python dflash_tools/onpolicy_bench.py --work out/opd --report   # the table and plot of finished runs
    # a given target and its SFT drafter (e.g. dflash_tools/recipe.py's): its data, NEW and held-out prompts
    python dflash_tools/onpolicy_bench.py --work out/opd_smol --target TARGET --sft runs/smol/sft --data train.jsonl \
        --new prompts_new.jsonl --heldout prompts_heldout.jsonl --arms A,B0,P,C0 --steps 40 --batch 2 --tokens 32

1. set-up, once: the demo's target, its regenerated data (2048 stdlib prompts x 64 greedy tokens) and the demo's
   SFT drafters (dflash.py --demo's flags: DFlash, and DFlash2 with --dflash2), each to the end of its cosine
   schedule; NEW training prompts (stdlib training files, none beginning as an SFT prompt does) with their greedy
   64-token continuations, captured once (a greedy rollout's text does not depend on the drafter: only its walk
   does); HELDOUT held-out prompts (held-out files) x 128 greedy tokens with the target's features; and the
   target's mean top-1 probability on that held-out text;
2. arms, each from the SFT checkpoint, STEPS updates of BATCH sequences, AdamW at LR with 5% linear warmup then
   cosine decay to 0 (dflash.lr_at), the same for every arm:
   A   continued SFT on the old data (random anchors), B0 SFT on the new sequences (random anchors: the authors'
   control), P Draft-OPD on the new prompts (the stage's defaults: walked blocks, fkl2 + k3 at offsets m+1..,
   0.8^(offset-1), the rejected drafts' p from the verification pass), C0 the previous stage's best arm (walked
   blocks, CE only) on the new prompts; Ps P with its teacher sharpened to T = 0.25 (this target is flat: its mean
   top-1 probability on held-out greedy text is 0.30; 0.82 at T = 0.25); with --arms also Pc, P with CE on the
   committed tokens (C0 plus the k3 term on the rejected drafts);
3. per run: each held-out prompt's tau (eval.py's greedy walk) at the start, mid-run and the end, P(draft k
   accepted), the seconds and FLOPs of its updates; the report: the paired per-prompt differences (B0 - A, P - B0,
   P - A, P - C0, C0 - B0, Ps - B0) of the final tau, averaged over seeds, with bootstrap 95% intervals that
   resample the prompts and the seeds; B0 - A is the positive control (no interval away from 0 there: the bench has
   no power).

With --target and --sft the set-up builds nothing: the arms start from the given SFT drafter(s) (one a variant;
DFlash or DFlash2, by their config), arm A continues on --data (the SFT run's training file, less the SFT run's own
held-out split: its --eval_fraction and --seed, read from the checkpoint), and the new and held-out sequences are
the target's greedy continuations (batched, left-padded) of --new's prompts (those equal to an SFT prompt dropped)
and --heldout's, through its chat template; the SFT drafter is evaluated once, and every run starts from that.
<work>/bench.json records the paths and sizes the runs read.

FLOPs ~ 2 * params * tokens: target forward tokens (the hooked passes, the verification pass, SFT's passes) at the
target's non-embedding parameters plus its lm_head, drafter forward tokens (blocks x B, the walk's drafting included)
at the drafter's (without DFlash2's codebooks) plus the lm_head, drafter backward tokens at twice that.

The README's figures: this project's 2-core AMD EPYC (torch 2.13), two runs at a time with one thread each, the
defaults, then --arms Pc --variants dflash: SFT 10 min, new sequences and held-out set 2 min, the 22 runs 29 min.
SmolLM2-135M-Instruct (onpolicy_bench_smollm2.json and .png), from recipe.py's DFlash drafter, on the same machine
shared with other jobs (load average 7-12): --arms A,B0,P,C0 --steps 16 --batch 2 --tokens 32 --lr 1e-3
--heldout_prompts 16 --heldout_tokens 48 --jobs 4, --heldout 24 prompts of the recipe's held-out files: set-up 9 min,
the 8 runs 19 min (P 58 s an update)."""
import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dflash  # noqa: E402
import eval as tau_eval  # noqa: E402
from dflash_tools import demo, onpolicy  # noqa: E402

ARMS = {"A": "continued SFT, old data", "B0": "SFT, new sequences", "P": "Draft-OPD, new prompts",
        "C0": "walked blocks, CE only, new prompts", "Ps": "P, teacher sharpened to T = 0.25",
        "Pc": "P with CE on the committed tokens"}
PAIRS = (("B0", "A"), ("P", "B0"), ("P", "A"), ("P", "C0"), ("C0", "B0"), ("Ps", "B0"), ("Pc", "C0"))
STEPS, BATCH, ANCHORS, LR, TOKENS, HELDOUT, HELDOUT_TOKENS = 200, 4, 16, 3e-4, 64, 96, 128
FRACTIONS = (0.5, 1.0)
LAYER_IDS = [int(x) for x in demo.DEMO_FLAGS[demo.DEMO_FLAGS.index("--target_layer_ids") + 1].split(",")]


# -----------------------------------------------------------------------------
# Set-up: target, data, SFT drafters, the new sequences, the held-out set

def spec(work):
    """What the runs read: the tiny demo target's paths under work and this module's sizes, overridden by
    <work>/bench.json (main writes it: a given target's paths, the sizes given by flags)."""
    cache = os.path.join(work, "cache")
    out = {"target": os.path.join(cache, "tiny_qwen35"), "old": os.path.join(cache, "demo_data.jsonl"),
           "new": os.path.join(cache, "new.jsonl"), "sft": {v: os.path.join(work, f"sft_{v}")
                                                            for v in ("dflash", "dflash2")},
           "max_len": 128, "eval_fraction": 0.05, "split_seed": 0, "batch": BATCH, "tokens": TOKENS, "lr": LR,
           "fractions": list(FRACTIONS)}
    path = os.path.join(work, "bench.json")
    return {**out, **json.load(open(path))} if os.path.exists(path) else out


def checkpoint_dir(path):
    """A run's directory (its latest checkpoint) or a checkpoint or drafter directory itself."""
    return dflash.latest_checkpoint(path) if os.path.exists(os.path.join(path, "latest")) else path


def variant_of(drafter):
    return "dflash2" if type(drafter).__module__.endswith("dflash2") else "dflash"


@torch.no_grad()
def greedy_batch(target, prompts, num_tokens, batch=32):
    """The target's greedy continuations of prompts (each to its first eos, which it keeps), batch at a time,
    left-padded (recipe.py's regeneration: a near-tie may break otherwise than one at a time would)."""
    from dflash_tools.recipe import generate_batch
    out = []
    for i in range(0, len(prompts), batch):
        out += generate_batch(target, prompts[i:i + batch], num_tokens)
        print(f"greedy continuations: {len(out)}/{len(prompts)}", flush=True)
    return out


def build_target(cache):
    """The demo's target (tiny_target.build_tiny_target's recipe, cached)."""
    from dflash_tools import tiny_target as tt
    return tt.build_tiny_target(cache, demo.DEMO_PRETRAIN_STEPS)


def sft(target_path, data, out, dflash2):
    """The demo's SFT run (its flags)."""
    if os.path.exists(os.path.join(out, "latest")):
        return dflash.latest_checkpoint(out)
    dflash.main(["--target", target_path, "--data", data, *demo.DEMO_FLAGS, *(["--dflash2"] if dflash2 else []),
                 "--eval_walk_prompts", "0", "--out", out])
    return dflash.latest_checkpoint(out)


def new_sequences(target_path, old, path, n):
    """n new prompts with their greedy continuations (make_regenerated_data's, another seed), none beginning as a
    prompt of the SFT data (old) does."""
    from dflash_tools.tiny_target import make_regenerated_data
    if os.path.exists(path):
        return path
    raw = make_regenerated_data(target_path, path + ".raw", num_samples=n + n // 4, seed=1)
    first = lambda row: tuple(row["input_ids"][:min(8, row["loss_mask"].index(1))])  # noqa: E731 (its prompt's)
    seen = {first(json.loads(line)) for line in open(old)}
    rows = [row for row in map(json.loads, open(raw)) if first(row) not in seen][:n]
    dflash.need(len(rows) == n, f"only {len(rows)} new prompts of {n}; cut more")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def new_sequences_from(target, prompts_file, old, path, n, num_tokens, max_len):
    """n prompts of prompts_file (none equal to a prompt of the SFT data old) with the target's greedy
    continuations, as {input_ids, loss_mask} lines."""
    if os.path.exists(path):
        return path
    seen = {tuple(p) for p in dflash.walk_prompts(dflash.load_samples(
        old, target.tokenizer, 1 << 30, say=lambda *a: None, eos_ids=target.eos_ids()), 1 << 30)}
    prompts = [p for p in tau_eval.load_prompts(prompts_file, target.tokenizer) if tuple(p) not in seen]
    prompts = [p for p in prompts if len(p) + 2 <= max_len][:n]
    dflash.need(len(prompts) == n, f"{prompts_file}: {len(prompts)} new prompts (not an SFT prompt, under --max_len) "
                f"of the {n} the arms need; give more, or fewer --steps or --batch")
    rows = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)}
            for p, c in zip(prompts, greedy_batch(target, prompts, num_tokens))]
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)
    return path


@torch.no_grad()
def held_out_set(target, target_path, path, prompts=None, layer_ids=None):
    """HELDOUT held-out prompts (the tiny target's held-out stdlib files, or prompts), their greedy continuations, the
    target's features; and the target's mean top-1 probability over the continuation's positions (how peaked the
    teacher is)."""
    from dflash_tools.tiny_target import heldout_prompts
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    items, top1 = [], []
    if prompts is None:
        prompts = heldout_prompts(target_path, num_prompts=HELDOUT)
        conts = [dflash.greedy_continuation(target, p, HELDOUT_TOKENS, target.eos_ids()) for p in prompts]
    else:
        prompts = prompts[:HELDOUT]
        conts = greedy_batch(target, prompts, HELDOUT_TOKENS)
    for p, cont in zip(prompts, conts):
        feats, final = dflash.target_features(target, torch.tensor([p + cont]), layer_ids or LAYER_IDS)
        top1.append(target.lm_head(final[0, len(p) - 1:-1]).softmax(-1).max(-1).values)
        items.append({"prompt": torch.tensor(p), "cont": torch.tensor(cont), "features": feats[0]})
    top1 = torch.cat(top1)
    out = {"items": items, "top1": top1.mean().item(), "top1_median": top1.median().item(),
           "tokens": HELDOUT_TOKENS, "target": str(target_path)}
    torch.save(out, path)
    return out


@torch.no_grad()
def evaluate(drafter, target, items):
    """Each prompt's tau (eval.py's greedy walk) and the pooled P(draft k accepted), k = 1..B-1."""
    drafter.eval()
    taus, lengths = [], []
    for it in items:
        walks, _, _ = dflash.walk_continuation(drafter, target, it["prompt"].tolist(), it["cont"].tolist(),
                                               features=it["features"][None])
        taus.append(sum(walks["tau"]) / len(walks["tau"]))
        lengths += walks["tau"]
    drafter.train()
    depth = dflash.acceptance_counts(lengths, drafter.cfg.block_size)[1]
    return {"tau": sum(taus) / len(taus), "taus": taus, "depth": [c / len(lengths) for c in depth]}


# -----------------------------------------------------------------------------
# One run: an arm from the SFT checkpoint, STEPS updates

def flops_per_token(target, drafter):
    pt = sum(p.numel() for n, p in target.model.named_parameters() if "embed" not in n)
    pd = sum(p.numel() for n, p in drafter.named_parameters() if "codebook" not in n) + target.lm_head.weight.numel()
    return 2 * pt + 2 * target.lm_head.weight.numel(), 2 * pd


def stage_args(arm, seed, tokens=None):
    """The on-policy arms' flags: the stage's defaults (P), its CE-only arm (C0), P sharpened (Ps)."""
    args = argparse.Namespace(**{k: None for k in onpolicy.DEFAULTS}, seed=seed, out=None)
    args.onpolicy_tokens = tokens or TOKENS
    if arm == "C0":
        args.onpolicy_accepted, args.onpolicy_rejected = "ce", "none"
    if arm == "Ps":
        args.onpolicy_teacher_temperature = 0.25
    if arm == "Pc":
        args.onpolicy_accepted = "ce"
    return args


def sft_eval(work, variant, drafter, target, items):
    """The SFT drafter's held-out evaluation, once for every run (setup writes it; else each run evaluates)."""
    path = os.path.join(work, f"sft_eval_{variant}.json")
    if os.path.exists(path):
        return json.load(open(path))
    out = evaluate(drafter, target, items)
    with open(path + f".tmp{os.getpid()}", "w") as f:
        json.dump(out, f)
    os.replace(path + f".tmp{os.getpid()}", path)
    return out


def worker(work, results, jobs, steps):
    """Runs the jobs (variant, arm, seed) no other worker has claimed, one after another, the target loaded once."""
    target = dflash.load_target(spec(work)["target"])
    for v, arm, seed in jobs:
        name = os.path.join(results, "runs", f"{v}_{arm}_{seed}")
        if os.path.exists(name + ".json"):
            continue
        try:
            os.close(os.open(name + ".claim", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        t0 = time.time()
        run_one(work, v, arm, int(seed), steps, results, target)
        print(f"{v} {arm} seed {seed}: {time.time() - t0:.0f}s", flush=True)


def run_one(work, variant, arm, seed, steps, results=None, target=None):
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    s = spec(work)
    target = target or dflash.load_target(s["target"])
    items = torch.load(os.path.join(work, "heldout.pt"), weights_only=True)["items"]
    drafter = dflash.load_drafter(checkpoint_dir(s["sft"][variant])).train()
    cfg, batch, lr = drafter.cfg, s["batch"], s["lr"]
    samples = dflash.load_samples(s["old"] if arm == "A" else s["new"], target.tokenizer, s["max_len"],
                                  say=lambda *a: None, eos_ids=target.eos_ids(), vocab_size=target.vocab_size)
    if arm == "A":  # the SFT run's own split: its held-out rows stay out
        samples, _ = dflash.split_eval(samples, s["eval_fraction"], s["split_seed"])
    batches = dflash.Batches(samples, batch, 1, 0, 1, seed, 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    ft, fd = flops_per_token(target, drafter)
    kw = dict(gamma=4.0, noise_std=0.02, labels="target", raw_model=drafter)
    state, flops, seconds = {}, 0.0, 0.0
    curve = [{"step": 0, **sft_eval(work, variant, drafter, target, items)}]
    for step in range(steps):
        mb, lr_now, t0 = batches.get(step, 0), dflash.lr_at(step, steps, lr, 0.05), time.time()
        if arm in ("A", "B0"):
            _, v = dflash.batch_anchors(mb, ANCHORS)
            dflash.train_step(drafter, opt, target, cfg, [mb], lr_now, ANCHORS, 1.0, 1, progress=(step, steps), **kw)
            flops += ft * mb["tokens"] + fd * 3 * int(v.sum()) * cfg.block_size
        else:
            stage = onpolicy.Stage(stage_args(arm, seed, s["tokens"]), state)
            stage.captured = True  # the new sequences are the target's greedy continuations of their prompts
            total, _, _ = dflash.train_step(drafter, opt, target, cfg, [mb], lr_now, ANCHORS, 1.0, 1, stage=stage,
                                            progress=(step, steps), **kw)
            flops += (ft * total["target_tokens"] + fd * (total["drafter_fwd_tokens"]
                                                          + 2 * total["drafter_bwd_tokens"])).item()
        seconds += time.time() - t0
        if step == 0 or any(step + 1 == round(f * steps) for f in s["fractions"]):
            ev = {} if step == 0 and steps > 1 else evaluate(drafter, target, items)
            curve += [{"step": step + 1, "seconds": seconds, "flops": flops, **ev}] if ev else []
            print(f"{variant} {arm} seed {seed}: step {step + 1}, {seconds / (step + 1):.2f} s/update"
                  + (f", tau {ev['tau']:.3f}" if ev else ""), flush=True)
    result = {"variant": variant, "arm": arm, "seed": seed, "steps": steps, "curve": curve, "batch": batch,
              "anchors": ANCHORS, "lr": lr}
    with open(os.path.join(results or work, "runs", f"{variant}_{arm}_{seed}.json"), "w") as f:
        json.dump(result, f)


# -----------------------------------------------------------------------------
# The report: paired differences with bootstrap intervals, the README table and plot

def paired(runs_x, runs_y, resamples=10000, seed=0):
    """Mean over prompts and seeds of tau_x - tau_y per prompt (runs paired by seed) and its bootstrap 95% interval,
    resampling the seeds and the prompts."""
    seeds = sorted({r["seed"] for r in runs_x} & {r["seed"] for r in runs_y})
    x = {r["seed"]: r["curve"][-1]["taus"] for r in runs_x}
    y = {r["seed"]: r["curve"][-1]["taus"] for r in runs_y}
    d = torch.tensor([[a - b for a, b in zip(x[s], y[s])] for s in seeds], dtype=torch.float64)  # (seeds, prompts)
    g = torch.Generator().manual_seed(seed)
    si = torch.randint(0, d.shape[0], (resamples, d.shape[0]), generator=g)
    pi = torch.randint(0, d.shape[1], (resamples, d.shape[1]), generator=g)
    boot = d[si[:, :, None], pi[:, None, :]].mean((1, 2))
    lo, hi = torch.quantile(boot, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return d.mean().item(), lo, hi, len(seeds)


def report(work, png):
    runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "runs", "*.json")))]
    if not runs:
        raise SystemExit(f"error: no finished runs in {os.path.join(work, 'runs')}")
    held = torch.load(os.path.join(work, "heldout.pt"), weights_only=True)
    variants = [v for v in ("dflash", "dflash2") if any(r["variant"] == v for r in runs)]
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    of = lambda v, a: [r for r in runs if r["variant"] == v and r["arm"] == a]  # noqa: E731
    B = len(runs[0]["curve"][0]["depth"]) + 1
    ks = sorted({0, (B - 2) // 2, B - 2})
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    sec = {v: mean([r["curve"][-1]["seconds"] / r["steps"] for r in of(v, "A")]) if of(v, "A") else None
           for v in variants}
    lines = [f"Target {held.get('target', 'the demo target')}: its mean top-1 probability on the held-out greedy "
             f"text {held['top1']:.3f} (median {held['top1_median']:.3f}); {len(held['items'])} prompts x "
             f"{held.get('tokens', HELDOUT_TOKENS)} tokens.", "",
             "| arm | " + " | ".join(f"{v} τ | P(k acc.) k={','.join(str(k + 1) for k in ks)} | s/update (× A)"
                                     for v in variants) + " |", "|---" * (1 + 3 * len(variants)) + "|"]
    for arm in ("SFT", *arms):
        cells = []
        for v in variants:
            rs = of(v, arm if arm != "SFT" else arms[0])
            if not rs:
                cells += ["-"] * 3
                continue
            ends = [r["curve"][0] if arm == "SFT" else r["curve"][-1] for r in (rs[:1] if arm == "SFT" else rs)]
            depth = " ".join(f"{mean([e['depth'][k] for e in ends]):.2f}" for k in ks)
            s = mean([r["curve"][-1]["seconds"] / r["steps"] for r in rs])
            cost = "-" if arm == "SFT" else f"{s:.2f} ({s / sec[v]:.1f}×)" if sec[v] else f"{s:.2f}"
            cells += [f"{mean([e['tau'] for e in ends]):.3f}", depth, cost]
        name = "SFT checkpoint" if arm == "SFT" else f"{arm}: {ARMS[arm]}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| paired difference (final τ) | " + " | ".join(f"{v} mean [95% CI]" for v in variants) + " |",
              "|---" * (1 + len(variants)) + "|"]
    diff = {}  # (pair, variant) -> its cell
    for x, y in PAIRS:
        for v in variants:
            if of(v, x) and of(v, y):
                m, lo, hi, n = paired(of(v, x), of(v, y))
                diff[x, y, v] = f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" + ("" if lo <= 0 <= hi else " *")
        if any((x, y, v) in diff for v in variants):
            lines.append(f"| {x} − {y} | " + " | ".join(diff.get((x, y, v), "-") for v in variants) + " |")
    # the README's table: each arm's tau and cost; each pair on its first arm's row, else its second's, else a new one
    rows = {arm: [] for arm in arms}
    for x, y in PAIRS:
        if any((x, y, v) in diff for v in variants):
            free = [a for a in (x, y) if not rows[a]]
            rows[free[0] if free else x].append((x, y))
    short = ["| arm | s/update (× A) | " + " | ".join(f"{v} τ | {v} paired Δτ [95% CI]" for v in variants) + " |",
             "|---" * (2 + 2 * len(variants)) + "|"]
    for arm in arms:
        for j, pair in enumerate(rows[arm] or [None]):
            cells = []
            for v in variants:
                ends = [r["curve"][-1] for r in of(v, arm)]
                cells += [f"{mean([e['tau'] for e in ends]):.3f}" if ends and j == 0 else "",
                          f"{pair[0]} − {pair[1]}: {diff[pair + (v,)]}" if pair and pair + (v,) in diff else ""]
            s = [mean([r["curve"][-1]["seconds"] / r["steps"] for r in of(v, arm)]) for v in variants if of(v, arm)]
            cost = f"{s[0]:.2f} ({s[0] / sec[variants[0]]:.1f}×)" if j == 0 and s and sec[variants[0]] else ""
            short.append(f"| {f'{arm} {ARMS[arm]}' if j == 0 else ''} | {cost} | " + " | ".join(cells) + " |")
    seeds = sorted({r["seed"] for r in runs})
    lines.append(f"\n{len(seeds)} seeds; * the interval excludes 0. {runs[0]['steps']} updates of "
                 f"{runs[0]['batch']} sequences, LR {runs[0]['lr']:g} (5% warmup, cosine to 0).")
    table = "\n".join(lines) + "\n\n" + "\n".join(short)
    print(table)
    with open(os.path.join(work, "table.md"), "w") as f:
        f.write(table + "\n")
    from dflash_tools.plot import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(2, len(variants), figsize=(5.5 * len(variants), 7), squeeze=False)
    for col, v in enumerate(variants):
        for arm, color in zip(ARMS, ("C0", "C1", "C2", "C3", "C4", "C5")):
            rs = of(v, arm)
            if not rs:
                continue
            n = min(len(r["curve"]) for r in rs)
            x = [r["curve"][i]["step"] for r in rs[:1] for i in range(n)]
            y = [[r["curve"][i]["tau"] for r in rs] for i in range(n)]
            axes[0][col].plot(x, [mean(t) for t in y], "-o", color=color, label=f"{arm} {ARMS[arm]}", ms=3)
            axes[0][col].fill_between(x, [min(t) for t in y], [max(t) for t in y], color=color, alpha=0.15)
            depth = [mean([r["curve"][-1]["depth"][k] for r in rs]) for k in range(B - 1)]
            axes[1][col].plot(range(1, B), depth, "-o", color=color, label=arm, ms=3)
        start = next(r["curve"][0]["depth"] for r in runs if r["variant"] == v)
        axes[1][col].plot(range(1, B), start, "--", color="k", label="SFT checkpoint")
        axes[0][col].set_xlabel("updates")
        axes[0][col].set_title(f"{v}: held-out τ (greedy), mean and range of seeds")
        axes[1][col].set_xlabel("draft k")
        axes[1][col].set_title(f"{v}: P(draft k accepted) after the updates")
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png} and {os.path.join(work, 'table.md')}")


# -----------------------------------------------------------------------------

def setup(work, results, num_new=STEPS * BATCH):
    """The target, both SFT drafters (two processes), the new sequences, the held-out set and the SFT drafters'
    evaluation on it, each built once."""
    from dflash_tools.tiny_target import make_regenerated_data
    t0, cache = time.time(), os.path.join(work, "cache")
    target_path = build_target(cache)
    data = make_regenerated_data(target_path, os.path.join(cache, "demo_data.jsonl"),
                                 num_samples=demo.DEMO_TRAIN_SAMPLES)
    print(f"target and data {time.time() - t0:.0f}s", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = (f"import sys; sys.path.insert(0, {ROOT!r}); import torch; torch.set_num_threads(1); "
            f"from dflash_tools import onpolicy_bench as b; b.sft({target_path!r}, {data!r}, ")
    procs = [subprocess.Popen([sys.executable, "-c", code + f"{os.path.join(work, 'sft_' + v)!r}, {v == 'dflash2'})"],
                              stdout=open(os.path.join(results, f"sft_{v}.log"), "w"), stderr=subprocess.STDOUT,
                              env=env) for v in ("dflash", "dflash2")]
    dflash.need(all(p.wait() == 0 for p in procs), f"an SFT run failed: see {results}/sft_*.log")
    print(f"SFT {time.time() - t0:.0f}s", flush=True)
    torch.set_num_threads(2)
    new_sequences(target_path, data, os.path.join(cache, "new.jsonl"), num_new)
    target = dflash.load_target(target_path)
    held = held_out_set(target, target_path, os.path.join(work, "heldout.pt"))
    print(f"new sequences and held-out set {time.time() - t0:.0f}s; the target's mean top-1 probability on the "
          f"held-out greedy text {held['top1']:.3f}", flush=True)
    for v in ("dflash", "dflash2"):
        sft_eval(work, v, dflash.load_drafter(checkpoint_dir(os.path.join(work, f"sft_{v}"))), target, held["items"])


@torch.no_grad()
def local_copy(target, name, path):
    """A GGUF target (no config.json) as an fp32 safetensors directory at path, its logits checked the same, for the
    workers: each GGUF load converts the tokenizer again (a minute on a busy 2-core machine). Others: name."""
    if os.path.isfile(os.path.join(name, "config.json")) or not os.path.exists(name):
        return name
    if not os.path.exists(os.path.join(path, "config.json")):
        from safetensors.torch import save_model
        os.makedirs(path, exist_ok=True)
        target.model.generation_config.save_pretrained(path)
        target.tokenizer.save_pretrained(path)
        save_model(target.model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        target.model.config.save_pretrained(path)  # last: a directory with config.json is complete
    ids = torch.tensor([target.tokenizer("def f(x):\n    return x")["input_ids"]])
    copy = dflash.load_target(path)
    dflash.need(torch.allclose(copy.model(input_ids=ids).logits, target.model(input_ids=ids).logits, atol=1e-4),
                f"{path}: the copy of {name} gives other logits; remove it")
    return path


def setup_given(a, work, results):
    """A given target and SFT drafter(s): bench.json, the new sequences, the held-out set, the SFT evaluation."""
    t0 = time.time()
    torch.set_num_threads(2)
    target = dflash.load_target(a.target)
    local = local_copy(target, a.target, os.path.join(work, "target"))
    print(f"target {time.time() - t0:.0f}s", flush=True)
    drafters = [dflash.load_drafter(checkpoint_dir(d)).eval() for d in a.sft]
    sft = {variant_of(d): path for d, path in zip(drafters, a.sft)}
    dflash.need(len(sft) == len(a.sft), "--sft: two drafters of one variant; give one DFlash and/or one DFlash2")
    ids = {tuple(d.cfg.target_layer_ids) for d in drafters}
    dflash.need(len(ids) == 1, "--sft: the drafters read different target layers; give drafters of one capture")
    args = dflash.read_train_state(checkpoint_dir(a.sft[0])).get("args", {}) \
        if os.path.exists(os.path.join(checkpoint_dir(a.sft[0]), "train_state.pt")) else {}
    s = {"target": local, "sft": sft, "old": a.data, "new": os.path.join(work, "new.jsonl"),
         "max_len": a.max_len, "eval_fraction": dflash.eval_fraction(argparse.Namespace(eval_fraction=args.get(
             "eval_fraction"))), "split_seed": args.get("seed") or 0, "batch": a.batch, "tokens": a.tokens, "lr": a.lr,
         "fractions": a.fractions, "steps": a.steps}
    with open(os.path.join(work, "bench.json"), "w") as f:
        json.dump(s, f, indent=1)
    new_sequences_from(target, a.new, a.data, s["new"], a.steps * a.batch, a.tokens, a.max_len)
    print(f"new sequences {time.time() - t0:.0f}s", flush=True)
    prompts = tau_eval.load_prompts(a.heldout, target.tokenizer)
    held = held_out_set(target, a.target, os.path.join(work, "heldout.pt"), prompts, list(ids.pop()))
    print(f"held-out set {time.time() - t0:.0f}s; the target's mean top-1 probability on the held-out greedy text "
          f"{held['top1']:.3f}", flush=True)
    for d in drafters:
        ev = sft_eval(work, variant_of(d), d, target, held["items"])
        print(f"{variant_of(d)} SFT drafter: held-out tau {ev['tau']:.3f} ({time.time() - t0:.0f}s)", flush=True)
    return list(sft)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "out", "opd"))
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=STEPS, help="updates per arm")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, one thread each")
    ap.add_argument("--arms", default="A,B0,P,C0,Ps", help=f"of {', '.join(ARMS)}")
    ap.add_argument("--variants", default="dflash,dflash2")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--results", help="where the runs' JSON and logs go (default: --work)")
    g = ap.add_argument_group("a given target (default: the demo's tiny target, built)")
    g.add_argument("--target", help="the target (anything dflash.py's --target takes)")
    g.add_argument("--sft", nargs="+", help="its SFT drafter(s): a run's --out, a step_N or a drafter directory")
    g.add_argument("--data", help="the SFT run's training data (arm A continues on it)")
    g.add_argument("--new", help="NEW prompts, none an SFT prompt (arms B0, P, C0, ...)")
    g.add_argument("--heldout", help="held-out prompts (the first --heldout_prompts)")
    g.add_argument("--heldout_prompts", type=int, default=HELDOUT)
    g.add_argument("--heldout_tokens", type=int, default=HELDOUT_TOKENS)
    g.add_argument("--batch", type=int, default=BATCH, help="sequences an update")
    g.add_argument("--tokens", type=int, default=TOKENS, help="greedy tokens of each new sequence (rollout)")
    g.add_argument("--lr", type=float, default=LR)
    g.add_argument("--max_len", type=int, default=128, help="tokens of a training sample, at most")
    g.add_argument("--fractions", type=lambda x: [float(f) for f in x.split(",")], default=list(FRACTIONS),
                   help="evaluate at these fractions of the updates")
    ap.add_argument("--worker", nargs=2, metavar=("JOBS", "STEPS"), help=argparse.SUPPRESS)
    ap.add_argument("--png", default=os.path.join(ROOT, "dflash_tools", "onpolicy_bench.png"))
    a = ap.parse_args()
    bad = [x for x in a.arms.split(",") if x not in ARMS]
    dflash.need(not bad, f"--arms {','.join(bad)}: not an arm; choose from {', '.join(ARMS)}")
    given = [f for f in ("target", "sft", "data", "new", "heldout") if getattr(a, f)]
    dflash.need(len(given) in (0, 5), f"--{', --'.join(given)}: a given target needs all of --target, --sft, --data, "
                "--new and --heldout")
    results = a.results or a.work
    if a.worker:
        return worker(a.work, results, [j.split(":") for j in a.worker[0].split(",")], int(a.worker[1]))
    if a.report:
        return report(results, a.png)
    t0 = time.time()
    os.makedirs(os.path.join(results, "runs"), exist_ok=True)
    globals().update(HELDOUT=a.heldout_prompts, HELDOUT_TOKENS=a.heldout_tokens)  # held_out_set's sizes
    if not given:  # the demo target's paths; the sizes given
        with open(os.path.join(a.work, "bench.json"), "w") as f:
            json.dump({k: getattr(a, k) for k in ("batch", "tokens", "lr", "fractions", "max_len")}, f)
    variants = setup_given(a, a.work, results) if given else setup(a.work, results, a.steps * a.batch) \
        or a.variants.split(",")
    costly = {"P": 0, "Ps": 0, "Pc": 1, "C0": 2}  # the costliest runs first: the workers end together
    jobs = [f"{v}:{arm}:{s}" for arm in sorted(a.arms.split(","), key=lambda x: costly.get(x, 3))
            for s in range(a.seeds) for v in variants]
    for j in jobs:  # a claim of an earlier, stopped bench: its run starts again
        name = os.path.join(results, "runs", j.replace(":", "_"))
        if os.path.exists(name + ".claim") and not os.path.exists(name + ".json"):
            os.remove(name + ".claim")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, __file__, "--work", a.work, "--results", results, "--worker",
                               ",".join(jobs), str(a.steps)], env=env, stderr=subprocess.STDOUT,
                              stdout=open(os.path.join(results, "runs", f"worker_{k}.log"), "w"))
             for k in range(a.jobs)]
    dflash.need(all(p.wait() == 0 for p in procs), f"a worker failed: see {results}/runs/worker_*.log")
    print(f"arms {time.time() - t0:.0f}s", flush=True)
    report(results, a.png)


if __name__ == "__main__":
    dflash.run_main(lambda _: main(), None)
