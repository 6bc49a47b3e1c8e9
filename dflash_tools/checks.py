"""Checks of what enters dflash.py and eval.py from outside, each failing as one DFlashError line: list flags, the
paths a run writes, checkpoints and weight files that may be truncated or garbage, the previous complete checkpoint
to fall back to. Imports nothing of the project but DFlashError."""
import argparse
import json
import os
import re
import zipfile

import torch

from dflash_tools.plumbing import DFlashError, check_writable

LAYER_TYPES = {"sliding": "sliding_attention", "full": "full_attention"}


def layer_type_list(s):
    """--layer_types: comma-separated sliding|full (or their config names) -> the config names."""
    types = [LAYER_TYPES.get(t.strip(), t.strip()) for t in s.split(",")]
    bad = next((t for t in types if t not in LAYER_TYPES.values()), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{s!r}: unknown layer type {bad!r}; give a comma-separated list of "
                                         f"sliding|full, one per drafter layer")
    return types


def check_output_file(path, flag):
    """A file the run will write (replacing it if it exists): refuse a directory in its place or a location that
    cannot be written, before anything is loaded."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise DFlashError(f"{flag} {path!r} is a directory; give a file path")
    check_writable(path, flag, os.path.dirname(os.path.abspath(path)))


# -----------------------------------------------------------------------------
# Files that may be truncated or garbage: cheap structural checks (no weights are read)

def json_problem(path):
    """None if path holds a JSON object, else what is wrong with it."""
    if not os.path.isfile(path):
        return "is missing"
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        return f"is not valid JSON ({str(e)[:100]})"
    return None if isinstance(d, dict) else "is not a JSON object"


def safetensors_problem(path):
    """None if path has a safetensors header whose tensors all fit in the file, else what is wrong with it."""
    if not os.path.isfile(path):
        return "is missing"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                return f"is truncated or garbage (a header of {n} bytes in a file of {size})"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "is garbage (its header is not a safetensors header)"
    if not isinstance(end, int) or 8 + n + end > size:
        return f"is truncated ({size} bytes; its header describes {8 + n + end})"
    return None


def torch_file_problem(path):
    """None if path is a complete torch.save zip archive (its central directory, at the end, is readable)."""
    if not os.path.isfile(path):
        return "is missing"
    try:
        with zipfile.ZipFile(path) as z:
            z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return f"is truncated or garbage ({e})"
    return None


def checkpoint_problem(d):
    """None if d is a complete step_N checkpoint (config.json, train_state.pt, model.safetensors all intact)."""
    if not os.path.isdir(d):
        return "it does not exist"
    for name, problem in (("config.json", json_problem), ("train_state.pt", torch_file_problem),
                          ("model.safetensors", safetensors_problem)):
        why = problem(os.path.join(d, name))
        if why:
            return f"its {name} {why}"
    return None


def step_of(name):
    m = re.fullmatch(r"step_(\d+)", os.path.basename(os.path.normpath(name)))
    return int(m[1]) if m else None


def previous_checkpoint(out, below=None):
    """The complete step_N directory of out with the highest N < below (any N when below is None), or None."""
    try:
        names = os.listdir(out)
    except OSError:
        return None
    steps = sorted(((step_of(n), n) for n in names if step_of(n) is not None), reverse=True)
    for n, name in steps:
        if (below is None or n < below) and checkpoint_problem(os.path.join(out, name)) is None:
            return os.path.join(out, name)
    return None


def fallback_hint(out, corrupt=None):
    """What to do when a checkpoint of out is corrupt: point latest at the previous complete one, if any."""
    prev = previous_checkpoint(out, step_of(corrupt) if corrupt else None)
    latest = os.path.join(out, "latest")
    if prev:
        return f"the previous complete checkpoint is {prev}: point {latest} at it (echo {os.path.basename(prev)} > " \
               f"{latest}) and resume"
    return f"there is no earlier complete checkpoint in {out}: drop --resume (or use a new --out) to start anew"


# -----------------------------------------------------------------------------
# The run directory and --resume

def check_run_dir(out, resume):
    """--out beyond check_writable_dir: nothing but files where the run writes latest and metrics.jsonl; with
    resume, the checkpoint <out>/latest names, checked complete before anything is loaded. Returns it (or None)."""
    if not out:
        raise DFlashError("--out is empty; give a directory")
    for name in ("latest", "metrics.jsonl"):
        p = os.path.join(out, name)
        if os.path.exists(p) and not os.path.isfile(p):
            raise DFlashError(f"--out {out!r}: {p} is in the way (not a file); remove it or give another --out")
    if not resume:
        return None
    latest = os.path.join(out, "latest")
    if not os.path.isfile(latest):
        raise DFlashError(f"--resume: no checkpoint in {out!r} (no {latest}); drop --resume to start")
    try:
        with open(latest, "rb") as f:
            name = f.read(4096).decode().strip()
    except (OSError, UnicodeDecodeError):
        name = ""
    if not name or not name.isprintable():
        raise DFlashError(f"--resume: {latest} is corrupt (it does not name a checkpoint directory); "
                          f"{fallback_hint(out)}")
    d = os.path.join(out, name)
    why = checkpoint_problem(d)
    if why:
        raise DFlashError(f"--resume: {latest} names {d}, which is incomplete or corrupt: {why}; "
                          f"{fallback_hint(out, d)}")
    return d


def read_train_state_file(resume_dir):
    """train_state.pt of a checkpoint: a dict with the keys resuming needs, or one line naming the fallback."""
    path = os.path.join(resume_dir, "train_state.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        why = None if isinstance(state, dict) and {"step", "optimizer", "rng", "global_batch"} <= set(state) else \
            "not a training state: keys step, optimizer, rng, global_batch expected"
    except Exception as e:  # truncated zip, garbage pickle, unpicklable types: all one line
        why = (str(e).splitlines() or [type(e).__name__])[0][:200]
    if why:
        raise DFlashError(f"{path}: cannot read the training state ({why}); the file is corrupt; "
                          f"{fallback_hint(os.path.dirname(os.path.normpath(resume_dir)), resume_dir)}")
    return state


# -----------------------------------------------------------------------------
# The target's files

def target_load_errors():
    """What from_pretrained raises for a missing, corrupt or unsupported target: caught, then target_load_error()."""
    from safetensors import SafetensorError
    return OSError, ValueError, TypeError, SafetensorError


def index_problem(path):
    """None if path is a safetensors index with a weight_map of tensor names to file names, else what is wrong."""
    why = json_problem(path)
    if why:
        return why
    with open(path, "rb") as f:
        weight_map = json.loads(f.read()).get("weight_map")
    ok = isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    return None if ok else "has no weight_map of tensor names to shard files"


def target_load_error(name, e):
    """One line for a target that cannot be loaded, naming its corrupt weight file or index when it is local. A
    TypeError with no corrupt file behind it is a bug, not bad input: it is returned as is (a traceback)."""
    problems = []
    if os.path.isdir(name):
        for f in sorted(os.listdir(name)):
            path = os.path.join(name, f)
            why = safetensors_problem(path) if f.endswith(".safetensors") else \
                index_problem(path) if f.endswith(".safetensors.index.json") else None
            problems += [f"{path} {why}"] if why else []
    if problems:
        return DFlashError(f"cannot load target {name!r}: {problems[0]}")
    if isinstance(e, TypeError):
        return e
    return DFlashError(f"cannot load target {name!r}: {(str(e).splitlines() or [type(e).__name__])[0]}")


# -----------------------------------------------------------------------------
# A drafter's config.json: valid JSON may still hold nonsense values

POSITIVE_INT_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "head_dim", "vocab_size", "block_size", "num_target_layers",
                       "max_position_embeddings")


def check_config_fields(kw, where):
    """The DFlashConfig fields read from a config.json (config_fields()), each of the type and sign it must have."""
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def need(ok, field, what):
        if not ok:
            raise DFlashError(f"{where}: {field} must be {what}, got {kw[field]!r}; the config is corrupt")
    for field in POSITIVE_INT_FIELDS:
        need(is_int(kw[field]) and kw[field] > 0, field, "a positive integer")
    need(kw["head_dim"] % 2 == 0, "head_dim", "even (RoPE rotates pairs)")
    need(is_int(kw["mask_token_id"]) and kw["mask_token_id"] >= 0, "mask_token_id", "a token id (an integer >= 0)")
    need(kw["sliding_window"] is None or (is_int(kw["sliding_window"]) and kw["sliding_window"] >= 0),
         "sliding_window", "null or an integer >= 0")
    for field in ("rms_norm_eps", "rope_theta"):
        v = kw[field]
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"), field,
             "a positive finite number")
    need(isinstance(kw["target_layer_ids"], list) and all(is_int(t) for t in kw["target_layer_ids"]),
         "target_layer_ids", "a list of integers")
    need(isinstance(kw["layer_types"], list) and all(isinstance(t, str) for t in kw["layer_types"]), "layer_types",
         "a list of layer type names")
    need(isinstance(kw["attention_bias"], bool), "attention_bias", "true or false")
    need(kw["is_causal"] is None or isinstance(kw["is_causal"], bool), "is_causal", "null, true or false")
    need(kw["rope_scaling"] is None or isinstance(kw["rope_scaling"], dict), "rope_scaling", "null or an object")
    return kw
