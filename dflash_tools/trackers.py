"""Trackers (--report_to): every metrics.jsonl record also goes to TensorBoard and/or Weights & Biases, from
rank 0. dflash.py imports this module only when --report_to names one."""
import importlib
import json
import os
from dataclasses import asdict

from dflash import DFlashError, check_writable_dir, first_line

TRACKERS = ("tensorboard", "wandb")  # --report_to names, each the package it needs

def check_trackers(names, out):
    """Each tracker's package imports and its directory in out (tensorboard/, wandb/) can be written, before any
    weights load (TensorBoard's writer thread would fail with a traceback); else one line naming it and the fix."""
    for name in names:
        try:
            importlib.import_module("torch.utils.tensorboard" if name == "tensorboard" else "wandb")
        except ImportError:
            raise DFlashError(f"--report_to {name} needs the {name} package: pip install {name}") from None
        check_writable_dir(os.path.join(out, name), f"--report_to {name}: {os.path.join(out, name)}",
                           fix="make it writable, or give another --out")

def scalars(record):
    """A metrics record -> {name: number}: lists become name/k per block offset k = 1.. (acc/1 is acc[0]), and what
    is not a number (None, the measurement settings) is left out; the step is the tracker's own axis."""
    out = {}
    for k, v in record.items():
        if k == "step":
            continue
        for name, x in ([(f"{k}/{i + 1}", x) for i, x in enumerate(v)] if isinstance(v, list) else [(k, v)]):
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                out[name] = x
    return out

class Trackers:
    """Rank 0's trackers. A resumed run continues the same curves: TensorBoard writes into <out>/tensorboard again,
    purging any event after the checkpoint's step (a run killed after its last checkpoint logged steps that are
    logged again); W&B continues the run whose id the checkpoint saved (train_state's "wandb_id")."""

    def __init__(self, names, args, run):  # the run's config (its flags, the drafter's) is logged with it
        self.tb = self.wandb = None
        out, state, config = args.out, run.state, {"args": vars(args), "drafter": asdict(run.cfg)}
        step = state["step"] if state else -1
        if names:
            os.makedirs(out, exist_ok=True)
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter
            try:
                self.tb = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=step + 1)
            except OSError as e:  # <out>/tensorboard in the way, or not writable
                raise DFlashError(f"--report_to tensorboard: {os.path.join(out, 'tensorboard')} cannot be written "
                                  f"({e.strerror}); remove what is in the way or give another --out") from None
            self.tb.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", step + 1)
        if "wandb" in names:
            import wandb
            run_id = (state or {}).get("wandb_id")  # None: a new run, its id chosen by wandb
            try:
                self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "dflash"), dir=out, id=run_id,
                                        resume="allow", name=os.path.basename(os.path.abspath(out)), config=config)
            except Exception as e:  # not logged in, no network: one line, before any weights load
                raise DFlashError(f"--report_to wandb: wandb.init failed ({first_line(e)}); run `wandb login`, or "
                                  f"set WANDB_MODE=offline to write the run locally") from None

    @property
    def wandb_id(self):
        return self.wandb.id if self.wandb else None

    def log(self, record):
        values = scalars(record)
        if self.tb:
            for k, v in values.items():
                self.tb.add_scalar(k, v, record["step"])
            self.tb.flush()  # on disk as metrics.jsonl is, should the run be killed
        if self.wandb:
            self.wandb.log(values, step=record["step"])

    def close(self):
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
