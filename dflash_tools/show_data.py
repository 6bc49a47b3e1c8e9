"""--show_data N: the first N encoded samples of --data with their loss spans in [[...]], then exit (nothing is
written). dflash.py imports this module only under that flag."""
import itertools
import sys

import dflash


def show_data(samples, tokenizer, n, file=None):  # n samples, loss spans in [[...]], what each gives
    decode = tokenizer.decode if tokenizer is not None else (lambda t: " ".join(map(str, t)))
    for i, (ids, mask) in enumerate(samples[:n]):
        runs = [(m, [t for t, _ in run]) for m, run in itertools.groupby(zip(ids, mask), key=lambda x: x[1])]
        print(f"--- sample {i}: {len(ids)} tokens, {sum(mask)} loss tokens, {len(dflash.anchor_candidates(mask))} "
              f"usable anchors\n" + "".join(f"[[{decode(t)}]]" if m else decode(t) for m, t in runs),
              file=file or sys.stdout)


def main(args):
    """The loss masks of --data as training encodes them, before anything is spent on training (rank 0 prints)."""
    dflash.need(args.target and args.data, "--show_data needs --target and --data (it writes nothing: no --out)")
    rank, world, device = dflash.setup_distributed(args.device)
    target, _ = dflash.load_run_target(args, dflash.RunSetup(), world, device)
    say = print if rank == 0 else (lambda *a: None)
    samples = dflash.load_samples(args.data, target.tokenizer, args.max_len, say, args.enable_thinking,
                                  target.eos_ids(), target.vocab_size)
    if rank == 0:
        show_data(samples, target.tokenizer, args.show_data)
