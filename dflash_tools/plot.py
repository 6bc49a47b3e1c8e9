"""
Pictures of a training run and of a tau measurement (matplotlib, optional: `pip install matplotlib`).

    python -m dflash_tools.plot runs/q3-8b                  # -> runs/q3-8b/metrics.png
    python -m dflash_tools.plot runs/q3-8b --out run.png
    python -m dflash_tools.plot --mask mask.png             # the attention visibility rule, drawn and printed

A run's picture is drawn from <out>/metrics.jsonl alone (what dflash.py logs at every --log_every step and every
held-out evaluation): training and held-out loss; the tau estimate (training and held out) beside the walked tau
(the exact walk eval.py does) and the tree's; acceptance by block offset at the last held-out evaluation (the
walk's P(draft k accepted), beside the estimate's accuracy at each offset); the learning rate. eval.py --plot FILE.png draws each drafter's
acceptance-length histogram side by side (plot_histograms). --mask draws dflash.make_mask_mod itself, evaluated
over every (block query, key) for two anchors, a bidirectional full layer beside a causal sliding one, and prints the
same as the text picture above make_mask_mod in dflash.py (mask_picture).
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script too: dflash.py is in the repository root

import torch  # noqa: E402

import dflash  # noqa: E402
from dflash import DFlashError  # noqa: E402

# The visibility example: S context positions, blocks of B tokens at these anchors, the sliding layer's window W;
# the two layers drawn: (title, causal, window)
MASK_S, MASK_B, MASK_ANCHORS, MASK_W = 8, 4, (2, 5), 3
MASK_LAYERS = (("bidirectional full layer", False, None), (f"causal sliding layer, W={MASK_W}", True, MASK_W))
# (record key, label) of the curves on each panel
LOSS_CURVES = (("loss", "training loss"), ("eval_loss", "held-out loss"))
TAU_CURVES = (("tau", "training tau estimate"), ("eval_tau", "held-out tau estimate"),
              ("eval_walk_tau", "walked tau (held out, exact)"), ("eval_walk_tree_tau", "tree tau (held out)"))


def pyplot():
    """matplotlib.pyplot on the file-only backend (no display needed), or one error line saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise DFlashError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_metrics(out):
    """The records of <out>/metrics.jsonl (or of a metrics.jsonl path given directly), in file order; a torn last
    line (a killed run's) is left out."""
    path = os.path.join(out, "metrics.jsonl") if os.path.isdir(out) else out
    hint = "; give a run's --out directory (it holds metrics.jsonl)" if not os.path.isdir(out) else ""
    records = []
    try:
        for _, r in dflash.read_jsonl(path, "metrics", hint):
            records.append(r)
    except DFlashError as e:  # a killed run's torn last line is dropped (a resume drops it too); an earlier one is not
        if not str(e).startswith(f"{path}:"):
            raise
        with open(path, "rb") as f:
            last = max((i for i, line in enumerate(f, 1) if line.strip()), default=0)
        if not str(e).startswith(f"{path}:{last}: not "):
            raise
    dflash.need(records, f"{path} is empty: the run has logged nothing yet")
    return records


def curve(records, key):
    """(steps, values) of one logged quantity, in step order; a step logged twice (a run resumed from an earlier
    checkpoint without cutting the log) keeps its last value."""
    last = {r["step"]: r[key] for r in records if isinstance(r, dict) and r.get(key) is not None and "step" in r}
    steps = sorted(last)
    return steps, [last[s] for s in steps]


def last_offsets(records):
    """The last held-out evaluation's figures by block offset: (step, {label: values}) with the walk's acceptance
    P(draft k accepted) (exact, as eval.py reports it) and the estimate's accuracy at each offset; the last training
    step's accuracy when there was no held-out evaluation; None if nothing was logged."""
    for keys in ((("eval_walk_acceptance", "acceptance (walk, exact)"), ("eval_acc", "accuracy at offset k (estimate)")),
                 (("acc", "accuracy at offset k (training)"),)):
        steps, _ = curve(records, keys[-1][0])
        if steps:
            at = next(r for r in reversed(records) if r.get("step") == steps[-1] and r.get(keys[-1][0]) is not None)
            return steps[-1], {label: at[k] for k, label in keys if at.get(k) is not None}
    return None


def plot_run(out, path=None):
    """Draw a run's metrics.jsonl into path (default <out>/metrics.png); returns the path written."""
    records = read_metrics(out)
    path = path or os.path.join(out if os.path.isdir(out) else os.path.dirname(out) or ".", "metrics.png")
    fig = draw_run(records, os.path.basename(os.path.abspath(out)))
    save(fig, path)
    pyplot().close(fig)
    return path


def draw_run(records, title=""):
    """The figure of a run's records: loss, tau, accuracy by block offset, lr (axes in that order)."""
    plt = pyplot()
    fig, ((ax_loss, ax_tau), (ax_acc, ax_lr)) = plt.subplots(2, 2, figsize=(11, 7))
    for ax, curves, name in ((ax_loss, LOSS_CURVES, "loss (weighted CE)"),
                             (ax_tau, TAU_CURVES, "tau: tokens per verification step")):
        for key, label in curves:
            steps, values = curve(records, key)
            if steps:
                ax.plot(steps, values, "-" if key in ("loss", "tau") else "o-", label=label, ms=3)
        ax.set(title=name, xlabel="step")
        if ax.lines:
            ax.legend(fontsize=8)
    offsets = last_offsets(records)
    if offsets:
        step, figures = offsets
        for i, (label, values) in enumerate(figures.items()):
            k = range(1, len(values) + 1)
            if i == 0:
                ax_acc.bar(k, values, color="tab:green", label=label)
            else:
                ax_acc.plot(k, values, "o", color="black", label=label)
        ax_acc.set(title=f"by block offset k (step {step})", xlabel="offset k", ylim=(0, 1), xticks=k)
        ax_acc.legend(fontsize=8)
    steps, lr = curve(records, "lr")
    ax_lr.plot(steps, lr, color="tab:purple")
    ax_lr.set(title="learning rate", xlabel="step")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    for ax in (ax_loss, ax_tau, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def histogram_shares(result):
    """z-lab's acceptance-length histogram of one drafter's result: the share of verification steps with acceptance
    length b = accepted drafts + 1, for b = 0..B (b = 0 never happens: the target's own token always counts)."""
    steps = max(result["steps"], 1)
    return [0.0] + [n / steps for n in result["histogram"]]


def plot_histograms(report, path):
    """eval.py's report -> path (eval.py --plot); returns the path written."""
    fig = draw_histograms(report)
    save(fig, path)
    pyplot().close(fig)
    return path


def draw_histograms(report):
    """Each drafter's acceptance-length histogram (share of steps, b = 0..B) side by side, titled with its tau and
    the measurement settings. A --bench report draws its benchmarks' turns pooled per drafter."""
    results = report_results(report)
    plt = pyplot()
    rows = 2 if any(r.get("depth") for r in results) else 1  # the second row: tau by context depth
    fig, axes = plt.subplots(rows, len(results), figsize=(3.2 * len(results) + 0.8, 3.4 * rows), sharey="row",
                             squeeze=False)
    if rows == 2:
        draw_depth(axes[1], results)
    for ax, r in zip(axes[0], results):
        shares = histogram_shares(r)
        ax.bar(range(len(shares)), [100 * s for s in shares], color="tab:blue")
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        ax.set(title=f"{r['drafter']}\ntau {tau} ({r['steps']} steps)", xlabel="acceptance length",
               xticks=range(0, len(shares), max(1, len(shares) // 8)))
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("% of verification steps")
    m = report.get("measured") or next(iter(report.get("benchmarks", {}).values()), {}).get("measured") or {}
    if m:
        fig.suptitle(", ".join(f"{k} {v}" for k, v in m.items()), fontsize=8)
    fig.tight_layout()
    return fig


def draw_depth(axes, results):
    """Each drafter's tau per context-depth bucket (eval.py's "depth"), its steps over each bar."""
    for ax, r in zip(axes, results):
        buckets = r.get("depth", [])
        x = range(len(buckets))
        ax.bar(x, [d["tau"] for d in buckets], color="tab:orange")
        for i, d in zip(x, buckets):
            ax.annotate(f"{d['steps']}", (i, d["tau"]), ha="center", va="bottom", fontsize=7)
        ax.set(title="tau by context depth (steps)", xlabel="anchor position", xticks=list(x),
               xticklabels=[d["depth"] for d in buckets])
        ax.tick_params(axis="x", labelsize=7)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("tau")


def report_results(report):
    """The per-drafter results of a report; a --bench report's benchmarks pooled per drafter (histograms summed)."""
    if "results" in report:
        return report["results"]
    pooled = {}
    for rep in report["benchmarks"].values():
        for r in rep["results"]:
            p = pooled.setdefault(r["drafter"], {"drafter": r["drafter"], "histogram": [0] * len(r["histogram"]),
                                                 "steps": 0, "lengths": 0})
            p["histogram"] = [a + b for a, b in zip(p["histogram"], r["histogram"])]
            p["steps"] += r["steps"]
            p["lengths"] += sum(n * (L + 1) for L, n in enumerate(r["histogram"]))
    for p in pooled.values():
        p["tau"] = p.pop("lengths") / p["steps"] if p["steps"] else None
    return list(pooled.values())


def mask_matrix(causal, window, S=MASK_S, B=MASK_B, anchors=MASK_ANCHORS):
    """dflash.make_mask_mod evaluated at every block query (n*B + i: offset i of block n) and every key of
    [S context positions ; the N blocks of B tokens], as flex_attention sees it: (N*B, S + N*B) bool."""
    from torch.nn.attention.flex_attention import create_mask
    a = torch.tensor([anchors])
    mod = dflash.make_mask_mod(a, torch.ones_like(a, dtype=torch.bool), S, B, causal, window)
    return create_mask(mod, 1, 1, len(anchors) * B, S + len(anchors) * B)[0, 0]


def key_groups(S=MASK_S, B=MASK_B, anchors=MASK_ANCHORS):
    """(name, key positions) of the key groups: the context 0..S-1, then block n's a_n..a_n+B-1."""
    return [("context", list(range(S)))] + [(f"block {n}", list(range(a, a + B))) for n, a in enumerate(anchors)]


def mask_picture(S=MASK_S, B=MASK_B, anchors=MASK_ANCHORS):
    """The text picture of MASK_LAYERS' masks (x: visible), one row per block query, keys grouped as key_groups."""
    groups, mats = key_groups(S, B, anchors), [mask_matrix(c, w, S, B, anchors) for _, c, w in MASK_LAYERS]
    widths = [max(len(name), len(pos)) + 2 for name, pos in groups]

    def cells(texts):  # one layer's columns: the groups' texts, each padded to its width
        return "| " + "".join(t.ljust(w) for t, w in zip(texts, widths))
    split = [sum(len(p) for _, p in groups[:g]) for g in range(len(groups) + 1)]
    lines = ["x: visible".ljust(16) + "".join(cells([title]).ljust(sum(widths) + 2) for title, _, _ in MASK_LAYERS),
             " " * 16 + cells([name for name, _ in groups]) * len(mats),
             "key position".ljust(16) + cells(["".join(str(p % 10) for p in pos) for _, pos in groups]) * len(mats)]
    for q in range(len(anchors) * B):
        n, i = divmod(q, B)
        label = (f"block {n}" if i == 0 else "").ljust(8) + f"i={i} @{anchors[n] + i}".ljust(8)
        row = ["".join("x" if v else "." for v in m[q].tolist()) for m in mats]
        lines.append(label + "".join(cells([r[lo:hi] for lo, hi in zip(split, split[1:])]) for r in row))
    return [line.rstrip() for line in lines]


def plot_mask(path):
    """Draw MASK_LAYERS' masks side by side into path; returns the path written."""
    fig = draw_mask()
    save(fig, path)
    pyplot().close(fig)
    return path


def draw_mask(S=MASK_S, B=MASK_B, anchors=MASK_ANCHORS):
    """Each layer's dense mask, queries (rows) x [context ; blocks] (columns), the key groups split and named."""
    plt = pyplot()
    groups, nq = key_groups(S, B, anchors), len(anchors) * B
    fig, axes = plt.subplots(1, len(MASK_LAYERS), figsize=(11, 3.9))
    for ax, (title, causal, window) in zip(axes, MASK_LAYERS):
        ax.imshow(mask_matrix(causal, window, S, B, anchors).float().numpy(), cmap="Blues", vmin=-0.15, vmax=1.1)
        start = 0
        for name, pos in groups:
            ax.axvline(start - 0.5, color="black", lw=1.5)
            ax.text(start + len(pos) / 2 - 0.5, -0.9, name, ha="center", va="bottom", fontsize=9)
            start += len(pos)
        for n in range(1, len(anchors)):
            ax.axhline(n * B - 0.5, color="black", lw=1.5)
        ax.set_xticks(range(start), [str(p) for _, pos in groups for p in pos], fontsize=8)
        ax.set_yticks(range(nq), [f"block {q // B}, i={q % B} @{anchors[q // B] + q % B}" for q in range(nq)],
                      fontsize=8)
        ax.set_xticks([x - 0.5 for x in range(start + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(nq + 1)], minor=True)
        ax.grid(which="minor", color="white", lw=0.8)
        ax.tick_params(which="minor", length=0)
        ax.set_title(title, pad=22)
        ax.set_xlabel("key position (dark: visible)")
    fig.suptitle(f"which keys a block query sees: {S} context positions, blocks of B={B} at anchors "
                 f"{' and '.join(map(str, anchors))} (query i of a block sits at position a+i)", fontsize=10)
    fig.tight_layout()
    return fig


def save(fig, path):
    """fig -> path (a PNG, or any format matplotlib knows by the suffix), its directory made; one error line if not."""
    dflash.need(not os.path.isdir(path), f"cannot write the plot {path!r}: it is a directory; give a file path "
                f"such as {os.path.join(path, 'metrics.png')}")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
    except (OSError, ValueError) as e:
        raise DFlashError(f"cannot write the plot {path!r}: {getattr(e, 'strerror', None) or e}") from None


def get_parser():
    p = dflash.ArgumentParser(description="Draw a training run's curves from its metrics.jsonl, or the mask rule.")
    p.add_argument("run", metavar="OUT", nargs="?", help="the run's --out directory (or its metrics.jsonl)")
    p.add_argument("--out", default=None, help="the picture to write (default: OUT/metrics.png)")
    p.add_argument("--mask", metavar="PNG", default=None, help="draw (and print) the attention visibility rule")
    return p


def main(argv=None):
    def run(args):
        dflash.need(bool(args.run) != bool(args.mask), "give a run's OUT directory, or --mask PNG (one of the two)")
        if args.mask:
            print("\n".join(mask_picture()))
            print(f"wrote {plot_mask(args.mask)}")
        else:
            print(f"wrote {plot_run(args.run, args.out)}")
    return dflash.run_main(run, get_parser().parse_args(argv))


if __name__ == "__main__":
    main()
