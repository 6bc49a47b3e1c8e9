"""
Long-context benchmark: peak memory and time of one training step against the sequence length, at fixed anchors.

    python -m dflash_tools.bench_long                       # CPU: 1k, 2k, 4k, ... until a step passes the limits
    python -m dflash_tools.bench_long --lengths 1024,4096 --anchors 64 --json long.json
    python -m dflash_tools.bench_long --flex                # CUDA: the compiled flex attention at the training length
    python -m dflash_tools.bench_long --write_prompts long.jsonl --target .cache/<tiny target>  # eval.py's depth

CPU (the dense path, two_part_attention over context spans): a tiny random Qwen3.5-hybrid target (3 Gated DeltaNet
+ 1 full-attention layer, hidden 128) and the demo's drafter shape (2 layers, sliding 2048 + full, 4 heads of 32,
B = 16), fp32, anchors drawn uniformly over the whole sequence. Per length it measures, separately:
  target    the grad-free target forward (captured features, greedy labels);
  drafter   the drafter's forward, chunked CE and backward from those features;
each as wall time and peak resident memory above the phase's start (/proc/self/status VmHWM after clear_refs, with
glibc's mmap threshold fixed at 64 KiB so freed buffers leave the resident set), and the drafter's bytes saved for
backward (saved_tensors_hooks: exact, allocator-free). The growth of each against the length ratio is the result.

--flex (one GPU; dflash_tools/bench_gpu.sh runs it): flex_attention forward + backward, compiled, with the DFlash
block mask at the Qwen3-8B drafter shape (32 query heads, 8 kv heads, head_dim 128, 512 anchors, B = 16, bf16) at
each --flex_lengths (default 4,096: training's 3,072 tokens padded; anchors over the first 3/4, as there), once with
enable_gqa=True and once with K/V repeated to the 32 query heads: which one the training path (dflash.Attention,
enable_gqa=True today) should keep. Lines print as they finish (a timeout keeps what was measured).
"""
import argparse
import ctypes
import gc
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script too: dflash.py is in the repository root

import torch  # noqa: E402

import dflash  # noqa: E402

MMAP_THRESHOLD = "65536"  # every buffer over 64 KiB its own mapping, unmapped when freed: the RSS follows live memory
VOCAB = 4096


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def status_kb(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def start_phase():
    """Drop what is free, reset the resident high-water mark; returns the resident bytes now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    return status_kb("VmRSS") * 1024


def phase_peak(base):
    return status_kb("VmHWM") * 1024 - base


def tiny_target(max_positions):
    """A random tiny Qwen3.5 hybrid (the demo target's shape), positions up to max_positions, as a dflash Target."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    config = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, max_position_embeddings=max_positions, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    model = Qwen3_5ForCausalLM(config).eval().requires_grad_(False)
    return dflash.Target(model, dflash.find_decoder(model), model.get_input_embeddings(),
                         model.get_output_embeddings(), None, "tiny-qwen3.5-random")


def drafter_cfg(B=16):
    return dflash.DFlashConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, rope_theta=10000.0,
                               max_position_embeddings=1 << 20, block_size=B, mask_token_id=VOCAB - 1,
                               target_layer_ids=[0, 1, 2], num_target_layers=4,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=2048)


def saved_bytes():
    """A saved_tensors_hooks context counting the bytes of the distinct storages autograd keeps for backward."""
    seen, total = set(), [0]

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total[0] += key[1]
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def measure(target, drafter, S, N, seed=0):
    """One training step at length S with N anchors: the target phase, then the drafter phase (see the docstring)."""
    cfg, B = drafter.cfg, drafter.cfg.block_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB - 1, (1, S), generator=g)
    mask = torch.ones(S, dtype=torch.long)
    anchors, valid = dflash.sample_anchors(mask, N, g)  # uniform over the whole sequence, as in training
    anchors, valid = anchors[None], valid[None]
    base = start_phase()
    t0 = time.perf_counter()
    context, final = dflash.target_features(target, ids, cfg.target_layer_ids)
    labels = dflash.greedy_labels(final, target.lm_head)
    t_target, m_target = time.perf_counter() - t0, phase_peak(base)
    del final
    y = dflash.block_labels(labels, anchors, B)
    w = dflash.loss_weights(anchors, valid, mask[None], B, 4.0)
    base = start_phase()
    t0 = time.perf_counter()
    hooks, saved = saved_bytes()
    with hooks:
        x = dflash.embed_blocks(target, dflash.block_input_ids(ids, anchors, B, cfg.mask_token_id))
        hidden = drafter(context, x, anchors, valid)
        ce_w, _ = dflash.weighted_ce(hidden, target.lm_head, y, w)
    (ce_w / w.sum()).backward()
    t_drafter, m_drafter = time.perf_counter() - t0, phase_peak(base)
    drafter.zero_grad(set_to_none=True)
    return {"length": S, "anchors": N, "target_s": t_target, "target_peak_mb": m_target / 2**20,
            "drafter_s": t_drafter, "drafter_peak_mb": m_drafter / 2**20, "drafter_saved_mb": saved[0] / 2**20}


def run_cpu(args):
    lengths = args.lengths or [1024 << i for i in range(12)]
    target = tiny_target(max(lengths) + 1)
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(drafter_cfg()).train()
    measure(target, drafter, lengths[0], args.anchors)  # warm up (first-call allocations, thread pools)
    print(f"machine: {machine()}")
    print(f"tiny random Qwen3.5-hybrid target (4 layers, hidden 128), drafter 2 layers (sliding 2048 + full), "
          f"B 16, {args.anchors} anchors, fp32, dense path; peak = resident high-water above the phase's start")
    print(f"{'length':>7}  {'target s':>9}  {'target MB':>9}  {'drafter s':>9}  {'drafter MB':>10}  "
          f"{'saved MB':>9}  growth vs the first length (length x | time x | peak x | saved x)")
    rows = []
    for S in lengths:
        r = measure(target, drafter, S, args.anchors)
        rows.append(r)
        first = rows[0]
        x = S / first["length"]
        growth = (f"{x:>5.0f}x | target {r['target_s'] / first['target_s']:.1f}x time "
                  f"{r['target_peak_mb'] / max(first['target_peak_mb'], 1e-9):.1f}x peak | drafter "
                  f"{r['drafter_s'] / first['drafter_s']:.1f}x time "
                  f"{r['drafter_peak_mb'] / max(first['drafter_peak_mb'], 1e-9):.1f}x peak "
                  f"{r['drafter_saved_mb'] / first['drafter_saved_mb']:.1f}x saved")
        print(f"{S:>7}  {r['target_s']:>9.2f}  {r['target_peak_mb']:>9.0f}  {r['drafter_s']:>9.2f}  "
              f"{r['drafter_peak_mb']:>10.0f}  {r['drafter_saved_mb']:>9.0f}  {growth}", flush=True)
        step_s, peak_mb = r["target_s"] + r["drafter_s"], max(r["target_peak_mb"], r["drafter_peak_mb"])
        if step_s > args.max_step_s or peak_mb > args.max_peak_mb:
            print(f"stopped after {S}: the step took {step_s:.1f} s, peaked {peak_mb:.0f} MB (limits --max_step_s "
                  f"{args.max_step_s:g}, --max_peak_mb {args.max_peak_mb:g}); the next length would pass them")
            break
    return {"machine": machine(), "mode": "cpu", "rows": rows}


def run_flex(args):
    """Compiled flex_attention forward + backward at the Qwen3-8B drafter shape, enable_gqa vs K/V repeated."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    cuda = args.flex_device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--flex: no CUDA device; nothing measured")
        return {"machine": machine(), "mode": "flex", "rows": []}
    dev, h, hk, hd, B, N = torch.device(args.flex_device), 32, 8, 128, 16, args.flex_anchors
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    print(f"machine: {torch.cuda.get_device_name(dev) if cuda else machine()}; torch {torch.__version__}")
    print(f"flex_attention fwd+bwd, compiled, one drafter layer at the Qwen3-8B drafter shape ({h} heads, {hk} kv "
          f"heads, head_dim {hd}, {N} anchors, B {B}, bf16 on CUDA), the full layer's mask")
    flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention  # (cpu: an eager smoke run)
    rows = []
    for S in args.flex_lengths:
        g = torch.Generator().manual_seed(0)
        anchors, valid = dflash.sample_anchors(torch.ones(S * 3 // 4, dtype=torch.long), N, g)  # real tokens: 3/4
        anchors, valid = anchors[None].to(dev), valid[None].to(dev)
        for window in [None] + ([2048] if args.flex_sliding else []):
            mod = dflash.make_mask_mod(anchors, valid, S, B, window is not None, window)
            mask = create_block_mask(mod, 1, None, N * B, S + N * B, device=dev)
            for gqa in (True, False):
                dt = torch.bfloat16 if cuda else torch.float32
                q = torch.randn(1, h, N * B, hd, device=dev, dtype=dt, requires_grad=cuda)  # (CPU flex: no backward)
                k = torch.randn(1, hk, S + N * B, hd, device=dev, dtype=dt, requires_grad=cuda)
                v = torch.randn_like(k, requires_grad=cuda)

                def step():
                    kk, vv = (k, v) if gqa else (k.repeat_interleave(h // hk, 1), v.repeat_interleave(h // hk, 1))
                    out = flex(q, kk, vv, block_mask=mask, enable_gqa=gqa).float().sum()
                    if cuda:
                        out.backward()
                t0 = time.perf_counter()
                step()  # compiles
                sync()
                compile_s = time.perf_counter() - t0
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(5):
                    sync()
                    t0 = time.perf_counter()
                    step()
                    sync()
                    times.append(time.perf_counter() - t0)
                r = {"length": S, "window": window, "enable_gqa": gqa, "ms": 1e3 * sorted(times)[2],
                     "compile_s": compile_s, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0}
                rows.append(r)
                print(f"  length {S:>6}  {'sliding 2048' if window else 'full':<12}  "
                      f"{'enable_gqa=True ' if gqa else 'K/V repeated   '}  {r['ms']:8.2f} ms fwd+bwd (median of "
                      f"5)  peak {r['peak_gb']:.2f} GB  (compile {compile_s:.0f} s)", flush=True)
                q = k = v = None  # freed before the next length
    for S in args.flex_lengths:
        for window in [None] + ([2048] if args.flex_sliding else []):
            pair = {r["enable_gqa"]: r["ms"] for r in rows if r["length"] == S and r["window"] == window}
            if len(pair) == 2:
                keep = "keep enable_gqa" if pair[True] <= pair[False] else "repeat K/V in dflash.Attention"
                print(f"  length {S}, {'sliding' if window else 'full'}: enable_gqa / repeated K/V = "
                      f"{pair[True] / pair[False]:.2f}x ({keep})")
    return {"machine": machine(), "mode": "flex", "rows": rows}


def write_prompts(args):
    """--write_prompts: long-document prompts for eval.py's depth report, from the demo's tiny target (its tokenizer):
    held-out stdlib files (never in its pretraining or the drafter's data) cut to each of --prompt_lengths tokens,
    --prompts_per_length of each, as {"input_ids": [...]} lines."""
    from dflash_tools.tiny_target import heldout_prompts
    dflash.need(args.target, "--write_prompts needs --target, the demo's tiny target directory (.cache/...)")
    with open(args.write_prompts, "w") as f:
        for i, n in enumerate(args.prompt_lengths):
            for ids in heldout_prompts(args.target, args.prompts_per_length, n, seed=100 + i):
                f.write(json.dumps({"input_ids": ids}) + "\n")
    print(f"wrote {args.write_prompts}: {args.prompts_per_length} prompts of each of {args.prompt_lengths} tokens")
    return {"mode": "prompts", "rows": []}


def int_list(s):
    return [int(x) for x in s.split(",")]


def main(argv=None, reexec=False):
    """reexec (the command line): start again with glibc's mmap threshold fixed, so the resident set follows live
    memory; in-process callers get the allocator as it is (their peaks are rougher)."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--lengths", type=int_list, default=None, help="CPU: lengths (default 1k, 2k, 4k, ... until a "
                   "limit)")
    p.add_argument("--anchors", type=int, default=64, help="CPU: anchors per step (fixed over the lengths)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--max_step_s", type=float, default=120.0, help="CPU: stop after a step longer than this")
    p.add_argument("--max_peak_mb", type=float, default=4096.0, help="CPU: stop after a phase peaking above this")
    p.add_argument("--flex", action="store_true", help="time the compiled flex attention on CUDA instead")
    p.add_argument("--flex_lengths", type=int_list, default=[4096], help="--flex: padded lengths, e.g. 4096,32768")
    p.add_argument("--flex_anchors", type=int, default=512)
    p.add_argument("--flex_sliding", action="store_true", help="--flex: also the sliding-2048 mask (more compiles)")
    p.add_argument("--flex_device", default="cuda", help="--flex: cpu runs it eagerly at small sizes (a smoke test)")
    p.add_argument("--write_prompts", default=None, help="write long-document prompts for eval.py here instead "
                   "(needs --target)")
    p.add_argument("--target", default=None, help="--write_prompts: the demo's tiny target directory")
    p.add_argument("--prompt_lengths", type=int_list, default=[48, 256, 512, 1024, 1900])
    p.add_argument("--prompts_per_length", type=int, default=6)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    if args.write_prompts:
        return write_prompts(args)
    if reexec and not args.flex and os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD and \
            sys.platform == "linux":
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}  # glibc reads it at start: start again
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run_flex(args) if args.flex else run_cpu(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main(reexec=True)
