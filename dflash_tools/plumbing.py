"""Plumbing for dflash.py and eval.py that is not the method: one-line errors, flag ranges, writable paths,
devices, files that may be corrupt, atomic directories, SIGTERM. Imports nothing of the project."""
import argparse
import itertools
import json
import math
import os
import shutil
import signal
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist


class DFlashError(Exception):
    """Bad input or a bad checkpoint: printed as one `error:` line (no traceback) by run_main()."""


def run_main(fn, args):
    """Run fn(args) as a command: bad input (a DFlashError) is one `error:` line on stderr and exit code 2, with the
    traceback only under --debug or DFLASH_DEBUG=1. Shared by dflash.py, eval.py and the demo."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # no weight-loading bars: stderr is for errors and our own progress
    try:
        return fn(args)
    except DFlashError as e:
        if args.debug or os.environ.get("DFLASH_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def ranged(kind, lo=None, hi=None, open_lo=False):
    """An argparse type: a finite int/float in [lo, hi] (lo excluded if open_lo); its range is `.text`."""
    text = f"{'(' if open_lo else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"

    def parse(s):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not math.isfinite(v) or (lo is not None and (v < lo or (open_lo and v == lo))) or (hi is not None
                                                                                              and v > hi):
            raise argparse.ArgumentTypeError(f"{s} is outside its valid range {text}")
        return v

    parse.text = text
    return parse


def int_list(s):
    try:
        return [int(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a comma-separated list of integers") from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse, with flag errors as one `error:` line and exit code 2 like every other input error."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)

    def add(self, group, name, kind, default, help, lo=None, hi=None, open_lo=False):
        t = ranged(kind, lo, hi, open_lo)
        group.add_argument(name, type=t, default=default, help=f"{help}; valid {t.text}")


def check_writable_dir(path, flag):
    """A directory the run will write into: refuse a file in its place or a location that cannot be written,
    before anything is loaded."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DFlashError(f"{flag} {path!r} is a file, not a directory; give a directory")
    check_writable(path, flag, path)


def check_writable(path, flag, start):
    """Refuse a path that cannot be created or written: the nearest existing directory at or above start (the path
    itself for a directory, its parent for a file) must be writable."""
    parent = start
    while not os.path.exists(parent):
        parent = os.path.dirname(os.path.abspath(parent))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise DFlashError(f"{flag} {path!r} cannot be written ({parent!r} is not a writable directory)")


def pick_device(flag, local_rank=0):
    """--device, or cuda:LOCAL_RANK when CUDA is there, else cpu; a device that is not there is one error line."""
    try:
        device = torch.device(flag or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise DFlashError(f"--device {flag!r} is not a device name (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DFlashError(f"--device {flag!r}: only cpu and cuda devices are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count():
            raise DFlashError(f"--device {device} is not available here ({torch.cuda.device_count()} CUDA devices"
                              f"{'' if torch.cuda.is_available() else '; this torch build has no CUDA'})")
        torch.cuda.set_device(device)
    return device


def read_json(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path}: not valid JSON ({e}); the {what} is corrupt") from None
    except UnicodeDecodeError as e:
        raise DFlashError(f"{path}: not UTF-8 text ({e.reason}); the {what} is corrupt") from None
    except OSError as e:
        raise DFlashError(f"cannot read {path}: {e}") from None


def read_jsonl(path, what, hint=""):
    """Yield ("file:line", record) for each non-blank line; every problem is one error naming file and line."""
    if not os.path.isfile(path):
        raise DFlashError(f"{what} file {path!r} does not exist{hint}")
    try:
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield f"{path}:{lineno}", json.loads(line.decode("utf-8"))
                    except json.JSONDecodeError as e:
                        raise DFlashError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                    except UnicodeDecodeError as e:
                        raise DFlashError(f"{path}:{lineno}: not UTF-8 text ({e.reason}); not a JSONL file?") from None
    except OSError as e:
        raise DFlashError(f"cannot read {what} file {path!r}: {e.strerror}") from None


@contextmanager
def atomic_dir(path):
    """Yield a temporary directory that replaces `path` only once everything in it is written: a crash never
    leaves a partial directory at `path` (between the two renames the old copy waits at <path>.old<pid>)."""
    path = path.rstrip("/")
    tmp, old = f"{path}.tmp{os.getpid()}", f"{path}.old{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


class StopFlag:
    """SIGTERM/SIGINT ask the loop to finish the current step, save and exit; a second signal kills."""

    def __init__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame):
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True


def peak_memory_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def config_fields(d, where):
    """The DFlashConfig fields of a z-lab or our config.json (a Qwen3 config plus the DFlash fields): the DFlash
    fields from dflash_config first, then the top level; RoPE from rope_parameters (transformers 5) or rope_theta +
    rope_scaling (transformers 4). Refuses what the drafter cannot run rather than falling back silently."""
    dc = d.get("dflash_config") or {}
    get = lambda k, default=None: dc[k] if k in dc else d.get(k, default)  # noqa: E731
    rope = d.get("rope_parameters") or {}
    if rope and "rope_theta" not in rope and all(isinstance(v, dict) for v in rope.values()):
        raise DFlashError(f"{where}: per-layer-type rope_parameters are not supported")
    scaling = d.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"} or None
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise DFlashError(f"{where}: partial_rotary_factor != 1 is not supported by the drafter (plain RoPE "
                              f"over the full head_dim)")
        scaling = None
    num_target, ids = get("num_target_layers"), get("target_layer_ids")
    if num_target is None:
        raise DFlashError(f"{where}: num_target_layers is missing; set it to the target's number of decoder layers"
                          + ("" if ids else " (target_layer_ids cannot be derived without it)"))
    if get("mask_token_id") is None:
        raise DFlashError(f"{where}: mask_token_id is missing (expected in dflash_config)")
    try:
        n, heads = d["num_hidden_layers"], d["num_attention_heads"]
        return dict(
            hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"], num_hidden_layers=n,
            num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or d["hidden_size"] // heads, vocab_size=d["vocab_size"],
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 1e4))),
            rope_scaling=scaling, max_position_embeddings=d.get("max_position_embeddings", 32768),
            attention_bias=d.get("attention_bias", False), block_size=get("block_size", 16),
            mask_token_id=get("mask_token_id"), num_target_layers=num_target, target_layer_ids=list(ids or []),
            layer_types=list(d.get("layer_types") or ["full_attention"] * n),
            sliding_window=d.get("sliding_window"), is_causal=d.get("is_causal"))
    except KeyError as e:
        raise DFlashError(f"{where}: required field {e.args[0]!r} is missing") from None
    except (TypeError, ValueError) as e:
        raise DFlashError(f"{where}: a field has the wrong type ({e})") from None


def yarn_rope(dim, base, s, max_position_embeddings):
    """Yarn RoPE as Hugging Face computes it: interpolate the low frequencies by `factor`, keep the high ones, and
    scale cos/sin by the attention factor. Returns inverse frequencies (dim/2,) and that factor."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    original_max = s.get("original_max_position_embeddings") or max_position_embeddings
    factor = s.get("factor") or max_position_embeddings / original_max
    mscale = lambda scale, m=1.0: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attention_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in original_max
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    return (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * (1 - ramp), float(attention_factor)


def check_ids(ids, vocab_size, where):
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise DFlashError(f"{where}: input_ids must be a list of integers")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None) if vocab_size else None
    if bad is not None:
        raise DFlashError(f"{where}: token id {bad} is outside the target's vocabulary [0, {vocab_size})")
    return ids


def mix_seed(*keys):
    """A 63-bit seed from a tuple of ints: randomness keyed by (seed, epoch, sample) rather than by rank, so any
    split of the global batch over ranks and micro-steps draws the same anchors and noise."""
    h = 1469598103934665603
    for k in keys:
        h = ((h ^ (int(k) & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def template_kwargs(tokenizer, enable_thinking):
    """Pass enable_thinking through only when it is set and the chat template reads it (training and eval alike)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return {"enable_thinking": enable_thinking} if enable_thinking is not None and "enable_thinking" in template else {}


def chat_ids(tokenizer, messages, add_generation_prompt=False, **template_kwargs):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def chat_sample(messages, tokenizer, kw, eos, where):
    """(ids, mask) of a conversation, mask 1 exactly on what the target generates for each assistant turn k: from the
    end of its generation prompt through the eos token that stops generation. Turns are located inside the full
    rendering, never by rendering messages[:k+1] alone: Qwen3-style templates render the assistant turn after the
    last user message with a think block and earlier ones without."""
    def render(msgs, gen=False):
        try:
            return chat_ids(tokenizer, msgs, add_generation_prompt=gen, **kw)
        except Exception as e:  # the template's raise_exception, or a message it cannot render
            raise DFlashError(f"{where}: the chat template fails on the first {len(msgs)} messages: "
                              f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None

    def ambiguous(k, why):
        return DFlashError(f"{where}: assistant turn {k}: {why}, so its loss mask is ambiguous; split the "
                           f"conversation into one sample per assistant turn")
    full = render(messages)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    contexts = [render(messages[:k]) for k in turns] + [full]  # each must be a prefix of the full rendering
    mask = [0] * len(full)
    for i, k in enumerate(turns):
        context, gen = contexts[i], render(messages[:k], gen=True)
        if full[:len(context)] != context:
            raise ambiguous(k, "the template renders the turns before it differently inside the whole conversation")
        # what the generation prompt shares with the turn is context (an empty think block when thinking is off);
        # the rest is generated. An earlier turn rendered without that block starts at its content.
        start = next((j for j, (a, b) in enumerate(zip(gen, full)) if a != b), min(len(gen), len(full)))
        if start < len(context):
            raise ambiguous(k, "the generation prompt rewrites the conversation before it")
        # the turn ends at the first eos token, searched no further than the next assistant turn's context
        end = next((j + 1 for j in range(start, len(contexts[i + 1])) if full[j] in eos), None)
        if end is None:  # no end-of-turn token: the turn's own rendering ends it, if that is part of the whole
            own = render(messages[:k + 1])
            if full[:len(own)] != own or len(own) <= start:
                raise ambiguous(k, f"no eos token {sorted(eos)} ends it and the template renders it differently "
                                   f"as the last turn (pass the target's eos ids)")
            end = len(own)
        mask[start:end] = [1] * (end - start)
    return full, mask


def show_data(samples, tokenizer, n, file=None):
    """Print the first n samples, loss spans in [[...]], with what training gets from each (--show_data)."""
    file = file or sys.stdout
    decode = tokenizer.decode if tokenizer is not None else (lambda t: " ".join(map(str, t)))
    for i, (ids, mask) in enumerate(samples[:n]):
        runs = [(m, [t for t, _ in run]) for m, run in itertools.groupby(zip(ids, mask), key=lambda x: x[1])]
        anchors = sum(a and b for a, b in zip(mask, mask[1:]))
        print(f"--- sample {i}: {len(ids)} tokens, {sum(mask)} loss tokens, {anchors} usable anchors", file=file)
        print("".join(f"[[{decode(t)}]]" if m else decode(t) for m, t in runs), file=file)


def latest_checkpoint(out):
    """<out>/latest names the newest complete checkpoint; None if there is none."""
    p = os.path.join(out, "latest")
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        d = os.path.join(out, f.read().strip())
    return d if os.path.isfile(os.path.join(d, "train_state.pt")) else None


def read_safetensors(path):
    """All tensors of a directory's model.safetensors, or of the shards its model.safetensors.index.json names."""
    from safetensors.torch import load_file
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    elif os.path.isfile(index):
        d = read_json(index, "safetensors index")
        weight_map = d.get("weight_map") if isinstance(d, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DFlashError(f"{index}: no weight_map of tensor names to shard files; the checkpoint is corrupt")
        files = sorted(set(weight_map.values()))
    else:
        raise DFlashError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json")
    tensors = {}
    for name in files:
        try:
            tensors.update(load_file(os.path.join(path, name)))
        except Exception as e:  # safetensors raises its own (Rust) errors for truncated or garbage files
            raise DFlashError(f"{os.path.join(path, name)}: not a readable safetensors file "
                              f"({str(e).splitlines()[0][:200]}); the checkpoint is corrupt") from None
    return tensors


def write_latest(out, name):
    """<out>/latest := name, atomically (written aside, synced, then renamed): it never names a partial checkpoint."""
    tmp = os.path.join(out, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, "latest"))


def setup_distributed(device_flag):
    """The same script under `python` (one process) and `torchrun` (DDP: gloo on CPU, nccl on CUDA)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(device_flag, int(os.environ.get("LOCAL_RANK", 0)))
    if world > 1 and not dist.is_initialized():  # the demo may have started it
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


def all_reduce_sum(stats, world):
    if world > 1:
        for v in stats.values():
            dist.all_reduce(v, op=dist.ReduceOp.SUM)
    return stats


def add_stats(total, stats):
    return {k: total[k] + v for k, v in stats.items()} if total else dict(stats)


def split_eval(samples, eval_fraction, seed):
    """A deterministic held-out split (the same on every rank): (train, eval)."""
    n_eval = int(len(samples) * eval_fraction)
    if eval_fraction > 0 and n_eval == 0 and len(samples) > 1:
        n_eval = 1
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    return [samples[i] for i in order[n_eval:]], [samples[i] for i in order[:n_eval]]


def check_tensors(tensors, expected, path, why=None):
    """Every expected tensor present with its exact shape, nothing else (a strict load names the first problem).
    why: {name: the reason for its shape}, said first when that tensor's shape is wrong."""
    for name, reason in (why or {}).items():
        if name in tensors and tuple(tensors[name].shape) != expected[name]:
            raise DFlashError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)} but {reason} needs "
                              f"{expected[name]}")
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DFlashError(f"{path}: missing tensor {missing[0]}{more}")
    if unexpected:
        raise DFlashError(f"{path}: unexpected tensor {unexpected[0]} (embedding and lm_head belong to the target; "
                          f"keys carry no 'model.' prefix)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise DFlashError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")


def load_tokenizer(name, trust_remote_code=False):
    """The target's tokenizer, or None when it has none (a target without one still works with pre-tokenized data;
    transformers 5 returns an empty stand-in when the directory has no tokenizer files)."""
    from transformers import AutoTokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None
    return tokenizer if len(tokenizer) > max(1, len(tokenizer.all_special_ids)) else None
