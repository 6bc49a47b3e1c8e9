"""The on-policy stage against continued SFT at equal compute, on the demo's tiny target (dflash_tools/onpolicy.py).

    python dflash_tools/onpolicy_bench.py --work out/opbench            # build, SFT, all arms, table and plot
    python dflash_tools/onpolicy_bench.py --work out/opbench --report   # the table and plot of finished runs

1. the demo's target (tiny_target.py, 300 pretraining steps; on CUDA when there is one), its regenerated data and
   the demo's SFT drafters (dflash.py --demo's flags: DFlash, and DFlash2 with --dflash2), each from scratch;
2. held-out prompts (the demo's 24), their greedy 64-token continuations and two T = 1 samples each, and the
   target's features over them, computed once and shared by every run;
3. arms, from the SFT checkpoint, each run until the same compute budget, evaluated at fractions of it:
   A continued SFT on the same data; B SFT on rollout sequences (the target's T = 1 continuations of the step's
   prompts, seeded as the on-policy arms'); C on-policy blocks (T = 1 rollouts) with CE only; D the full objective;
   with --arms, C0 and D0: C and D from greedy rollouts (the serving walk of greedy decoding), E0: D0 without its
   reverse KL on the rejected drafts;
4. a JSON per run, the README table (held-out tau greedy, at T = 1, P(draft k accepted) greedy; mean and spread
   over seeds) and the plot of tau against compute.

Compute is counted as FLOPs ~ 2 * params * tokens: target forward tokens (generation, the hooked passes, the SFT
passes) at the target's non-embedding parameters plus its lm_head, drafter forward tokens (blocks x B, the rollout's
drafting included) at the drafter's parameters (without DFlash2's codebooks, which are lookups) plus the lm_head,
and drafter backward tokens at twice that.

The README's figures: this project's 2-core AMD EPYC (torch 2.13, transformers 5.24), everything on the CPU, the
runs two or three at a time with one thread each: --seeds 3 --budget_sft_steps 48, then --arms C0,D0 and E0
(build 3 min, the two SFT runs 15 min, the 42 runs 35 min)."""
import argparse
import glob
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dflash  # noqa: E402
from dflash_tools import demo, onpolicy, sampling as sampler  # noqa: E402

ARMS = {"A": "continued SFT", "B": "SFT on rollout sequences", "C": "on-policy blocks, CE only", "D": "full objective",
        "C0": "C, greedy rollouts", "D0": "D, greedy rollouts", "E0": "D0 without the rejected term"}
# (C0, D0, E0: --arms; B at T = 0 would be A's data)
BATCH, ANCHORS, LR, ROLLOUT_T, TOKENS, PROMPTS = 8, 32, 3e-4, 1.0, 64, demo.DEMO_PROMPTS
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
LAYER_IDS = [int(x) for x in demo.DEMO_FLAGS[demo.DEMO_FLAGS.index("--target_layer_ids") + 1].split(",")]


# -----------------------------------------------------------------------------
# Set-up: target, data, SFT drafters, the held-out set

def build_target(cache):
    """The demo's target (tiny_target.build_tiny_target's recipe), pretrained on CUDA when there is one."""
    from dflash_tools import tiny_target as tt
    out = os.path.join(cache, "tiny_qwen35")
    if os.path.exists(os.path.join(out, "DONE")) or not torch.cuda.is_available():
        return tt.build_tiny_target(cache, demo.DEMO_PRETRAIN_STEPS)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    train_files, heldout_files = tt.stdlib_split()
    tokenizer = tt.train_tokenizer([tt._read(f) for f in train_files])
    tokens = tt._encode_files(tokenizer, train_files)
    model = tt.Qwen3_5ForCausalLM(tt.tiny_config(tokenizer)).cuda()
    stats = tt.pretrain(model, tokens.cuda(), demo.DEMO_PRETRAIN_STEPS)
    model.cpu().save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "train_stats.json"), "w") as f:
        json.dump(stats, f)
    open(os.path.join(out, "DONE"), "w").close()
    return out


def sft(target_path, data, out, dflash2):
    """The demo's SFT run (its flags), on CUDA with dense attention and no compile when there is CUDA."""
    if os.path.exists(os.path.join(out, "latest")):
        return dflash.latest_checkpoint(out)
    dev = ["--attention", "dense", "--compile", "off", "--dtype", "fp32"] if torch.cuda.is_available() else []
    dflash.main(["--target", target_path, "--data", data, *demo.DEMO_FLAGS, *dev, *(["--dflash2"] if dflash2 else []),
                 "--eval_walk_prompts", "0", "--out", out])
    return dflash.latest_checkpoint(out)


@torch.no_grad()
def held_out_set(target, target_path, path):
    """The demo's held-out prompts, their greedy continuations and 2 samples at T = 1, each with the target's
    features, final hidden states and (sampled) the truth probabilities: what every evaluation walks."""
    import eval as ev
    from dflash_tools.tiny_target import heldout_prompts
    if os.path.exists(path):
        return torch.load(path, weights_only=True)
    prompts, eos, items = heldout_prompts(target_path, num_prompts=PROMPTS), target.eos_ids(), []
    s = ev.Sampling(1.0)
    for i, p in enumerate(prompts):
        for j in range(3):  # j = 0: greedy; 1, 2: T = 1
            g = torch.Generator().manual_seed(dflash.mix_seed(7, i, j))
            cont = dflash.greedy_continuation(target, p, TOKENS, eos) if j == 0 else sampler.sampled_continuation(
                target, p, TOKENS, eos, s, g)
            ids = torch.tensor([p + cont])
            feats, final = dflash.target_features(target, ids, LAYER_IDS)
            items.append({"prompt": torch.tensor(p), "cont": torch.tensor(cont), "features": feats[0], "j": j,
                          "p_truth": sampler.truth_probs(target, final, len(p), cont, s) if j else torch.ones(1),
                          "seed": dflash.mix_seed(7, i, j, 1)})
    torch.save(items, path)
    return items


@torch.no_grad()
def evaluate(drafter, target, items):
    """Pooled tau greedy and at T = 1 (eval.py's walk, dflash.walk_continuation: DFlash's argmax along the sampled
    continuation; a rule that samples its block, DFlash2's selector, by sampling.sampled_lengths), and P(draft k
    accepted) greedy, k = 1..B-1."""
    drafter.eval()
    lengths = {0: [], 1: []}
    for it in items:
        p, cont = it["prompt"].tolist(), it["cont"].tolist()
        T = 1.0 if it["j"] else 0.0
        walks, _, more = dflash.walk_continuation(drafter, target, p, cont, features=it["features"][None],
                                                  temperature=T)
        ls = walks["tau"]
        if T and "q" in more:
            ls = sampler.sampled_lengths(cont, it["p_truth"], more["q"], torch.Generator().manual_seed(it["seed"]))
        lengths[min(it["j"], 1)] += ls
    drafter.train()
    g = lengths[0]
    return {"tau_greedy": sum(g) / len(g), "tau_t1": sum(lengths[1]) / len(lengths[1]),
            "depth": [c / len(g) for c in dflash.acceptance_counts(g, drafter.cfg.block_size)[1]]}


# -----------------------------------------------------------------------------
# One run: an arm from the SFT checkpoint until the compute budget

def flops_per_token(target, drafter):
    pt = sum(p.numel() for n, p in target.model.named_parameters() if "embed" not in n)
    pd = sum(p.numel() for n, p in drafter.named_parameters() if "codebook" not in n) + target.lm_head.weight.numel()
    return 2 * pt, 2 * pd


def budget_of(target, drafter, sft_steps):
    """sft_steps steps of arm A: the target's tokens of a batch (48-token prompts), its anchors' blocks fwd and bwd."""
    ft, fd = flops_per_token(target, drafter)
    return sft_steps * (ft * BATCH * (48 + TOKENS) + fd * 3 * BATCH * ANCHORS * drafter.cfg.block_size)


def run_one(work, variant, arm, seed, budget, results=None):
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    import eval as ev
    target = dflash.load_target(os.path.join(work, "cache", "tiny_qwen35"))
    items = torch.load(os.path.join(work, "heldout.pt"), weights_only=True)
    ckpt = dflash.latest_checkpoint(os.path.join(work, f"sft_{variant}"))
    drafter = dflash.load_drafter(ckpt).train()
    cfg = drafter.cfg
    samples = dflash.load_samples(os.path.join(work, "cache", "demo_data.jsonl"), target.tokenizer, 128,
                                  say=lambda *a: None, eos_ids=target.eos_ids(), vocab_size=target.vocab_size)
    train, _ = dflash.split_eval(samples, 0.05, 0)  # the SFT run's own split: its held-out rows stay out
    batches = dflash.Batches(train, BATCH, 1, 0, 1, seed, 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    ft, fd = flops_per_token(target, drafter)
    kw = dict(gamma=4.0, noise_std=0.02, labels="target", raw_model=drafter)
    args = argparse.Namespace(**{k: None for k in onpolicy.DEFAULTS}, seed=seed, out=None)
    args.onpolicy_temperature, args.onpolicy_tokens = 0.0 if arm.endswith("0") else ROLLOUT_T, TOKENS
    if arm.startswith("E"):
        args.onpolicy_rejected = "none"
    if arm.startswith("C"):
        args.onpolicy_accepted, args.onpolicy_rejected, args.onpolicy_sft_weight = "ce", "none", 0.0
    state, spent, step, t0 = {}, 0.0, 0, time.time()
    curve = [{"compute": 0.0, "step": 0, **evaluate(drafter, target, items)}]
    marks = [f * budget for f in FRACTIONS]
    while marks:
        mb = batches.get(step, 0)
        if arm in ("A", "B"):
            tokens = 0
            if arm == "B":  # the rollout sequences: the target's T = 1 continuations of the step's prompts
                rows = []
                for r, p in onpolicy.prompts_of(mb):
                    g = torch.Generator().manual_seed(dflash.mix_seed(seed, step, mb["keys"][r]))
                    c = sampler.sampled_continuation(target, p, TOKENS, target.eos_ids(), ev.Sampling(ROLLOUT_T), g)
                    rows.append((p + c, [0] * len(p) + [1] * len(c)))
                    tokens += len(p) + len(c) - 1
                mb = dflash.collate(rows, 0, [mb["keys"][r] for r, _ in onpolicy.prompts_of(mb)])
            a, v = dflash.batch_anchors(mb, ANCHORS)
            dflash.train_step(drafter, opt, target, cfg, [mb], LR, ANCHORS, 1.0, 1, progress=(step, 10 ** 6), **kw)
            n = int(v.sum()) * cfg.block_size
            spent += ft * (tokens + mb["tokens"]) + fd * 3 * n
        else:
            total, _, _ = dflash.train_step(drafter, opt, target, cfg, [mb], LR, ANCHORS, 1.0, 1,
                                            stage=onpolicy.Stage(args, state), progress=(step, 10 ** 6), **kw)
            spent += (ft * total["target_tokens"] + fd * (total["drafter_fwd_tokens"]
                                                          + 2 * total["drafter_bwd_tokens"])).item()
        step += 1
        if spent >= marks[0]:
            marks.pop(0)
            curve.append({"compute": spent, "step": step, "seconds": time.time() - t0,
                          **evaluate(drafter, target, items)})
    result = {"variant": variant, "arm": arm, "seed": seed, "budget": budget, "curve": curve,
              "flops_per_token": [ft, fd]}
    with open(os.path.join(results or work, "runs", f"{variant}_{arm}_{seed}.json"), "w") as f:
        json.dump(result, f)


# -----------------------------------------------------------------------------
# The report: README table and plot

def report(work, png):
    runs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "runs", "*.json")))]
    if not runs:
        raise SystemExit(f"error: no finished runs in {os.path.join(work, 'runs')}")
    B = len(runs[0]["curve"][0]["depth"]) + 1
    lines = [f"| drafter | arm | seeds | steps | τ greedy | τ T=1 | P(draft k accepted) greedy, k = 1..{B - 1} |",
             "|---|---|---|---|---|---|---|"]
    stat = lambda xs: (sum(xs) / len(xs), (max(xs) - min(xs)) / 2 if len(xs) > 1 else 0.0)  # noqa: E731
    for variant in ("dflash", "dflash2"):
        start = [r for r in runs if r["variant"] == variant]
        if not start:
            continue
        s0 = start[0]["curve"][0]
        lines.append(f"| {variant} | SFT checkpoint | - | 0 | {s0['tau_greedy']:.3f} | {s0['tau_t1']:.3f} | "
                     + " ".join(f"{x:.3f}" for x in s0["depth"]) + " |")
        for arm in ARMS:
            rs = [r for r in start if r["arm"] == arm]
            if not rs:
                continue
            last = [r["curve"][-1] for r in rs]
            g, t = stat([c["tau_greedy"] for c in last]), stat([c["tau_t1"] for c in last])
            depth = [stat([c["depth"][k] for c in last])[0] for k in range(len(last[0]["depth"]))]
            lines.append(f"| {variant} | {arm}: {ARMS[arm]} | {len(rs)} | {round(stat([c['step'] for c in last])[0])} "
                         f"| {g[0]:.3f} ± {g[1]:.3f} | {t[0]:.3f} ± {t[1]:.3f} | "
                         + " ".join(f"{x:.3f}" for x in depth) + " |")
    # the README's table: one row per arm, both drafters side by side, P(draft k accepted) at 3 depths
    ks = sorted({0, (B - 2) // 2, B - 2})  # of the B - 1 offsets: the first, the middle and the last
    head = "P(k acc.) k=" + ",".join(str(k + 1) for k in ks)
    short = [f"| arm | DFlash τ greedy | τ T=1 | {head} | DFlash2 τ greedy | τ T=1 | {head} |",
             "|---|---|---|---|---|---|---|"]
    for arm in ("SFT", *ARMS):
        cells = []
        for variant in ("dflash", "dflash2"):
            rs = [r for r in runs if r["variant"] == variant and (arm == "SFT" or r["arm"] == arm)]
            last = [r["curve"][0] for r in rs[:1]] if arm == "SFT" else [r["curve"][-1] for r in rs]
            if not last:
                cells += ["-"] * 3
                continue
            g, t = stat([c["tau_greedy"] for c in last]), stat([c["tau_t1"] for c in last])
            pm = lambda x: f"{x[0]:.3f}" + (f" ± {x[1]:.3f}" if len(last) > 1 else "")  # noqa: E731
            cells += [pm(g), pm(t), " ".join(f"{stat([c['depth'][k] for c in last])[0]:.2f}" for k in ks)]
        name = "SFT checkpoint" if arm == "SFT" else f"{arm} {ARMS[arm]}"
        short.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n\n" + "\n".join(short)
    print(table)
    with open(os.path.join(work, "table.md"), "w") as f:
        f.write(table + "\n")
    from dflash_tools.plot import pyplot
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "tau_greedy", "held-out τ, greedy"), (axes[1], "tau_t1", "held-out τ, T = 1")):
        for variant, style in (("dflash", "-"), ("dflash2", "--")):
            for arm, color in zip(ARMS, ("C0", "C1", "C2", "C3", "C4", "C5", "C6")):
                rs = [r for r in runs if r["variant"] == variant and r["arm"] == arm]
                if not rs:
                    continue
                n = min(len(r["curve"]) for r in rs)
                x = [sum(r["curve"][i]["compute"] for r in rs) / len(rs) / 1e9 for i in range(n)]
                y = [[r["curve"][i][key] for r in rs] for i in range(n)]
                ax.plot(x, [sum(v) / len(v) for v in y], style, color=color, label=f"{variant} {arm}")
                ax.fill_between(x, [min(v) for v in y], [max(v) for v in y], color=color, alpha=0.12)
        ax.set_xlabel("compute (GFLOPs: target and drafter tokens x 2 x params)")
        ax.set_title(title)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png} and {os.path.join(work, 'table.md')}")


# -----------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.path.join(ROOT, "out", "opbench"))
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--budget_sft_steps", type=float, default=48, help="the compute budget, in SFT steps of A")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--arms", default="A,B,C,D", help=f"of {', '.join(ARMS)}")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--results", help="where the runs' JSON and logs go (default: --work)")
    ap.add_argument("--one", nargs=4, metavar=("VARIANT", "ARM", "SEED", "BUDGET"), help=argparse.SUPPRESS)
    ap.add_argument("--png", default=os.path.join(ROOT, "dflash_tools", "onpolicy_bench.png"))
    a = ap.parse_args()
    global TOKENS, PROMPTS
    if os.environ.get("OPBENCH_QUICK"):  # the code path in seconds (a check, not a measurement)
        TOKENS, PROMPTS = 12, 2
    if a.one:
        return run_one(a.work, a.one[0], a.one[1], int(a.one[2]), float(a.one[3]), a.results)
    results = a.results or a.work
    if a.report:
        return report(results, a.png)
    t0 = time.time()
    cache = os.path.join(a.work, "cache")
    os.makedirs(os.path.join(results, "runs"), exist_ok=True)
    target_path = build_target(cache)
    print(f"target {time.time() - t0:.0f}s", flush=True)
    from dflash_tools.tiny_target import make_regenerated_data
    data = make_regenerated_data(target_path, os.path.join(cache, "demo_data.jsonl"),
                                 num_samples=demo.DEMO_TRAIN_SAMPLES)
    print(f"data {time.time() - t0:.0f}s", flush=True)
    procs = [subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                               f"from dflash_tools import onpolicy_bench as b; b.sft({target_path!r}, {data!r}, "
                               f"{os.path.join(a.work, 'sft_' + v)!r}, {v == 'dflash2'})"],
                              stdout=open(os.path.join(results, f"sft_{v}.log"), "w"), stderr=subprocess.STDOUT)
             for v in ("dflash", "dflash2")]
    target = dflash.load_target(target_path)
    held_out_set(target, target_path, os.path.join(a.work, "heldout.pt"))
    assert all(p.wait() == 0 for p in procs), "an SFT run failed: see sft_*.log"
    print(f"SFT {time.time() - t0:.0f}s", flush=True)
    budget = budget_of(target, dflash.load_drafter(dflash.latest_checkpoint(os.path.join(a.work, "sft_dflash"))),
                       a.budget_sft_steps)
    jobs = [(v, arm, s) for s in range(a.seeds) for v in ("dflash", "dflash2") for arm in a.arms.split(",")]
    running = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    while jobs or running:
        while jobs and len(running) < a.jobs:
            v, arm, s = jobs.pop(0)
            if os.path.exists(os.path.join(results, "runs", f"{v}_{arm}_{s}.json")):
                continue
            log = open(os.path.join(results, "runs", f"{v}_{arm}_{s}.log"), "w")
            running.append(subprocess.Popen([sys.executable, __file__, "--work", a.work, "--results", results, "--one",
                                             v, arm, str(s), str(budget)], stdout=log, stderr=subprocess.STDOUT,
                                            env=env))
        time.sleep(1)
        done = [p for p in running if p.poll() is not None]
        running = [p for p in running if p.poll() is None]
        if done:
            print(f"{time.time() - t0:.0f}s: {len(done)} run(s) ended, {len(running)} running, {len(jobs)} queued",
                  flush=True)
    print(f"arms {time.time() - t0:.0f}s", flush=True)
    report(results, a.png)  # (rerun with --report where the plot needs matplotlib)


if __name__ == "__main__":
    main()
