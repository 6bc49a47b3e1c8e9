"""Capture once, train many: the target's features on disk, and training from them without the target's layers.

One training step takes from the target only a pure function of the sample: the context features concat_t h[t] of
target_layer_ids and the labels y (the target's greedy tokens). `capture` runs the target once over --data and stores
both; `dflash.py --features DIR` then trains with only the target's embedding, lm_head and tokenizer loaded (read alone
from its safetensors, or its GGUF, by tensor name), the same losses as online training (captured in fp32 on the CPU:
bitwise on a dense target; a hybrid Gated-DeltaNet target's chunked scan rounds differently padded: ~4e-9 apart).

    python dflash_tools/features.py capture --target T --data D --out FEATS --target_layer_ids 1,16,31,46,61
    torchrun --nproc_per_node=8 dflash_tools/features.py capture ...        # samples split over the ranks
    python dflash.py --target T --data D --features FEATS --out runs/a ...  # trains from FEATS, no target layers
    python dflash.py ... --features FEATS --capture_missing                 # hybrid: captures what FEATS lacks
    python dflash_tools/features.py bench     # a step from features against online: the demo's target, a mid shape
    python dflash_tools/features.py bench --target T --dtypes fp32  # on T (a GGUF too), the recipe-like geometry;
        # also the drafter step's FLOP/s against this machine's fp32 matmul rate (2048^3, torch's threads)

The format (version 1), a directory:
  manifest.json   format, version; target: its record as checkpoints keep it (dflash.target_record: name, fingerprint,
                  probe: the embedding's); layers_digest: weights_digest of the target's safetensors, every tensor
                  (null: a target without safetensors); hidden_size, num_target_layers, vocab_size; tokenizer and
                  chat_template: sha256 of the tokenizer's JSON and of its template; target_layer_ids with their
                  convention (layer t: the residual stream after decoder layer t, hidden_states[t + 1], before the
                  final norm: dflash.capture_hidden);
                  dtype (bf16 | fp32 | int8), final (whether f is stored); pad_id; num_samples, num_tokens, complete;
                  data and eval_data: their digests (dflash.path_digest); max_len, enable_thinking; walk: the held-out
                  walk's seed, eval_fraction, prompts and tokens; flags: the capture's command line.
  rankRRR/        one folder per capturing rank, its files its own: sNNNNNNNN.safetensors per sample N of --data
                  (then --eval_data), wNNNNN.safetensors per held-out walk prompt, and index.jsonl (one line per file:
                  name, key, n tokens, kind; a walk file's prompt key). A sample file holds input_ids int32 [S],
                  loss_mask uint8 [S], labels int32 [S] (y[j] = argmax lm_head(f[j-1]), y[0] = -1), features
                  [S, m*D] (int8: plus scales fp32 [S, m], one per token and layer, x = q * scale), final [S, D] with
                  --store_final; a walk file input_ids (prompt + the target's greedy continuation), prompt_len,
                  features. Every file is written aside, synced and renamed: a killed capture leaves no file a reader
                  would trust; a rerun captures what is missing. Training checks every file's header against its
                  size and the shapes above before its first step (Features.check: no tensor read).
Disk per token: m * D * (2 bf16 | 4 fp32 | 1 int8 + 4/D) + 9 bytes (labels, tokens, mask), + D * 2|4 with f.
A training batch row is found by its key, the sha1 of its tokens without trailing pad tokens: the same lookup serves
the loss, the held-out loss and the walk, whatever the shuffle, and a row that is in no capture is refused.

The target a capture was made from: the record's fingerprint covers the embedding alone (as checkpoints keep it), so
layers_digest covers every tensor the target's safetensors hold (decoder layers, norms, lm_head, any tower): each
tensor's name, dtype and shape, and the bytes of 64 of its entries (8 rows evenly spaced along its first dimension,
the first 8 entries of each), read at their offsets in the files (never a whole tensor) by the capture and again by
training, which refuses another target's capture (a fine-tune of the same base) in one line. It sees what changes a
tensor's sampled rows (a fine-tune changes nearly every entry), not one edited entry. Its cost on a 27B target
(~1,100 tensors with its vision tower, 54 GB in bf16): the headers (a few MB) and ~9k reads of 16 bytes, under 40 MB
of 4 KiB pages (a few hundred MB at most with the kernel's readahead); SmolLM2-135M (272 tensors, 0.54 GB): 50 ms.
A loss needing the target's distribution (not its greedy labels) needs f: capture with --store_final.
Other trainers' dumps (SpecForge, speculators): dflash_tools/dumps.py reads them behind the same reader interface,
open_features(path, layer_ids) -> .manifest, len(), .sample(i) -> input_ids, loss_mask, features, labels (or None);
optional .tokens(i): sample i's input_ids alone (a dump is indexed by its tokens without reading its features).
"""
import argparse
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from contextlib import suppress

import torch
import torch.nn as nn
from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this folder's scripts import dflash.py from the repository root

import dflash  # noqa: E402
from dflash import need  # noqa: E402
from dflash_tools.formats import SAFETENSORS_BYTES, safetensors_header  # noqa: E402

FORMAT, VERSION, MANIFEST, INDEX = "dflash-features", 1, "manifest.json", "index.jsonl"
CONVENTION = "h[t]: the residual stream after decoder layer t (hidden_states[t + 1]), before the final norm"
STORE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}
FILE_OVERHEAD = 600  # bytes of a sample file beyond its tensors: the safetensors header, an index line
NAME = re.compile(r"^[sw]\d+\.safetensors$")


# -----------------------------------------------------------------------------
# Keys, hashes, sizes

def sha(text):
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tokenizer_hash(tok):  # the tokenizer's whole JSON (a fast one), else its vocabulary
    if tok is None:
        return "none"
    backend = getattr(tok, "backend_tokenizer", None)
    return sha(backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items())))


def template_hash(tok):
    return sha(getattr(tok, "chat_template", None) or "") if getattr(tok, "chat_template", None) else "none"


def pad_of(tok):  # the pad id training pads rows with (dflash.train's Batches)
    return getattr(tok, "pad_token_id", None) or 0


def row_key(ids, pad):
    """(key, n): the sha1 of the tokens up to the last one that is not pad, and that length."""
    ids = torch.as_tensor(ids, dtype=torch.long).cpu()
    real = (ids != pad).nonzero()
    n = int(real[-1]) + 1 if len(real) else 0
    return hashlib.sha1(ids[:n].numpy().tobytes()).hexdigest(), n


DIGEST_ROWS = DIGEST_VALUES = 8  # a tensor's sample in weights_digest: rows along its first dimension, values a row


@functools.lru_cache(maxsize=4)
def weights_digest(name):
    """A sha256 (16 hex digits) of every tensor of target name's safetensors: its name, dtype, shape and the bytes of
    a sample of its entries (DIGEST_ROWS rows along the first dimension, the first DIGEST_VALUES entries of each), read
    at their offsets; None for a target without safetensors."""
    try:
        files = weight_files(name)
    except dflash.DFlashError:
        return None
    parts = {}
    for path in sorted(set(files.values())):
        tensors, data = safetensors_header(path)
        with open(path, "rb") as f:
            for k, t in tensors.items():
                shape, (start, end) = t["shape"], t["data_offsets"]
                size = SAFETENSORS_BYTES.get(t["dtype"], 1)
                row = (end - start) // max(shape[0], 1) if shape else end - start  # bytes a row along dimension 0
                rows = sorted({round(i * (shape[0] - 1) / (DIGEST_ROWS - 1)) for i in range(DIGEST_ROWS)}) \
                    if shape and shape[0] else [0]
                sample = b"".join(os.pread(f.fileno(), min(row, DIGEST_VALUES * size), data + start + r * row)
                                  for r in rows)
                parts[k] = f"{k} {t['dtype']} {shape}".encode() + sample
    return hashlib.sha256(b"".join(parts[k] for k in sorted(parts))).hexdigest()[:16]


def bytes_per_token(m, D, dtype, final=False):
    size = {"bf16": 2, "fp32": 4, "int8": 1}[dtype]
    return m * D * size + (4 * m if dtype == "int8" else 0) + 9 + (D * (2 if dtype == "bf16" else 4) if final else 0)


def quantize(x, m):
    """int8 with one scale per token and layer: x (S, m*D) -> q int8 (S, m*D), scales fp32 (S, m)."""
    x = x.float().unflatten(-1, (m, -1))
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / scale).round().clamp(-127, 127).to(torch.int8).flatten(-2), scale.squeeze(-1)


def dequantize(q, scales):
    return (q.float().unflatten(-1, (scales.shape[-1], -1)) * scales[..., None]).flatten(-2)


# -----------------------------------------------------------------------------
# Files: written aside, synced, renamed; a full disk leaves no partial file

def write_file(path, tensors, metadata):
    from safetensors.torch import save
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        data = save({k: v.contiguous() for k, v in tensors.items()}, metadata)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with suppress(OSError):
            os.remove(tmp)
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise dflash.DFlashError(f"{path}: {'the disk is full' if full else e.strerror} (the partial file is removed);"
                                 f" {'free space' if full else 'fix it'} and rerun: the capture continues") from None


def append_index(d, name, meta):
    with open(os.path.join(d, INDEX), "a") as f:
        f.write(json.dumps({"name": name, **meta}) + "\n")


def read_index(d):
    """{name: {key, n, kind[, prompt]}} of a rank folder: its index lines (a torn last line ignored), and for a file
    the index lacks (killed between the rename and the line) its header's metadata."""
    from safetensors import safe_open
    out, p = {}, os.path.join(d, INDEX)
    lines = open(p).read().split("\n") if os.path.isfile(p) else []
    for k, line in enumerate(lines):
        try:
            r = json.loads(line) if line.strip() else None
        except ValueError:
            need(k >= len(lines) - 2, f"{p}:{k + 1}: not a JSON line; the index is corrupt: remove {d} and recapture")
            continue
        if r:
            out[r.pop("name")] = r
    for name in os.listdir(d):
        if NAME.match(name) and name not in out:
            try:
                with safe_open(os.path.join(d, name), "pt") as f:
                    meta = f.metadata()
                out[name] = {**meta, "n": int(meta["n"])}
            except Exception as e:
                raise dflash.DFlashError(f"{os.path.join(d, name)}: unreadable ({dflash.first_line(e)}); remove it "
                                         f"and rerun the capture (it captures what is missing)") from None
    return {k: v for k, v in out.items() if os.path.isfile(os.path.join(d, k))}


def rank_dirs(root):
    return sorted(os.path.join(root, d) for d in os.listdir(root) if re.fullmatch(r"rank\d+", d)
                  and os.path.isdir(os.path.join(root, d))) if os.path.isdir(root) else []


# -----------------------------------------------------------------------------
# Our format's reader (the reader interface; dflash_tools/dumps.py has the same for other trainers' dumps)

class Features:
    """A capture directory: .manifest, len() samples, .sample(i) (i: the data's sample order), .find(row) -> the
    file of a token row, .read(path) -> its tensors (features of the requested layer ids, in the target's dtype)."""

    def __init__(self, path, layer_ids=None):
        self.path, f = path, os.path.join(path, MANIFEST)
        self.manifest = m = dflash.read_json(f, "features manifest")
        need(isinstance(m, dict) and m.get("format") == FORMAT, f"{f}: not a {FORMAT} manifest; give a capture of "
             f"dflash_tools/features.py")
        need(m.get("version") == VERSION, f"{f}: format version {m.get('version')}, this reads {VERSION}; recapture")
        have = m["target_layer_ids"]
        layer_ids = have if layer_ids is None else list(layer_ids)
        lack = [t for t in layer_ids if t not in have]
        need(not lack, f"--features {path} holds layers {have}, the drafter reads {layer_ids}: no layer "
             f"{', '.join(map(str, lack))}; pass --target_layer_ids {','.join(map(str, usable(m)))} (or some of "
             f"them), or capture with --target_layer_ids {','.join(map(str, layer_ids))} into a new --out")
        D, self.layer_ids = m["hidden_size"], layer_ids
        self.columns = torch.cat([torch.arange(have.index(t) * D, (have.index(t) + 1) * D) for t in layer_ids])
        self.refresh()

    def refresh(self):
        """Index every rank folder's files: key -> [(n, path)], and the samples in data order."""
        self.keys, self.prompts, samples = {}, {}, {}
        for d in rank_dirs(self.path):
            for name, r in read_index(d).items():
                p = os.path.join(d, name)
                self.keys.setdefault(r["key"], []).append((r["n"], r["kind"] == "sample", p))
                if r["kind"] == "sample":
                    samples[int(name[1:-12])] = p
                else:
                    self.prompts[r["prompt"]] = p
        self.order = [samples[i] for i in sorted(samples)]

    def __len__(self):
        return len(self.order)

    def add(self, key, n, p, sample=True):  # a file written since (--capture_missing)
        self.keys.setdefault(key, []).append((n, sample, p))

    def find(self, key, S):
        """(n, file) of the longest capture with this key that fits S tokens, a sample's before a walk's (a walk holds
        no labels; the same tokens as a sample where the data is the target's own greedy continuations)."""
        fits = [(n, sample, p) for n, sample, p in self.keys.get(key, ()) if n <= S]
        return max(fits)[::2] if fits else None

    def read(self, p, dtype=torch.float32):
        from safetensors import safe_open
        try:
            with safe_open(p, "pt") as f:
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # truncated, garbage, gone
            raise dflash.DFlashError(f"{p}: unreadable ({dflash.first_line(e)}); remove it and rerun the capture "
                                     f"(it captures what is missing)") from None
        x = t["features"]
        x = dequantize(x, t["scales"]) if x.dtype == torch.int8 else x
        ok = x.dim() == 2 and x.shape[0] == len(t["input_ids"]) and x.shape[1] >= self.columns.max() + 1
        need(ok, f"{p}: features of shape {tuple(x.shape)} for {len(t['input_ids'])} tokens; the file is corrupt: "
             f"remove it and rerun the capture")
        return {"input_ids": t["input_ids"].long(), "loss_mask": t["loss_mask"].bool() if "loss_mask" in t else None,
                "features": x[:, self.columns].to(dtype), "labels": t["labels"].long() if "labels" in t else None,
                "final": t["final"].to(dtype) if "final" in t else None, "prompt_len": t.get("prompt_len")}

    def sample(self, i):
        return self.read(self.order[i])

    def check(self):
        """Every file's safetensors header against its size and the shapes the manifest and index give, before a step
        (no tensor read): a truncated or damaged file refused in one line, naming it, before anything is written."""
        m = self.manifest
        D, k = m["hidden_size"], len(m["target_layer_ids"])
        files = [hit for hits in self.keys.values() for hit in hits]
        for n, sample, p in tqdm(files, desc="checking the capture's files", disable=len(files) < 20000):
            try:
                shapes = {name: t["shape"] for name, t in safetensors_header(p)[0].items()}
            except (OSError, ValueError) as e:  # truncated, garbage, gone
                raise dflash.DFlashError(f"{p}: unreadable ({dflash.first_line(e)}); remove it and rerun the capture "
                                         f"(it captures what is missing)") from None
            want = {"input_ids": [n], "features": [n, k * D], **({"scales": [n, k]} if m["dtype"] == "int8" else {}),
                    **({"loss_mask": [n], "labels": [n], **({"final": [n, D]} if m["final"] else {})} if sample else
                       {"prompt_len": [1]})}
            bad = [f"{name} {shapes.get(name, 'missing')}, not {shape}" for name, shape in want.items()
                   if shapes.get(name) != shape]
            need(not bad, f"{p}: {'; '.join(bad)} (the capture's manifest and index); the file is corrupt: remove it "
                 f"and rerun the capture (it captures what is missing)")


def usable(m):  # the layers of a capture a drafter may read, in order (never the last: see Capture.open)
    return sorted({t for t in m["target_layer_ids"] if t < m["num_target_layers"] - 1})


def open_features(path, layer_ids=None, target_record=None, dump_kw=None):
    """Our capture if path holds our manifest, else another trainer's dump (dflash_tools/dumps.py's open_dump, given
    dump_kw: dump_layer_ids, target_config, lm_head, norm, labels, data)."""
    need(os.path.isdir(path), f"--features {path!r} is not a directory; give a capture of dflash_tools/features.py")
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return Features(path, layer_ids)
    try:
        from dflash_tools import dumps
    except ImportError:
        raise dflash.DFlashError(f"--features {path}: no {MANIFEST} (not a capture of dflash_tools/features.py), "
                                 f"and dflash_tools/dumps.py, which reads other trainers' dumps, is missing") from None
    return dumps.open_dump(path, layer_ids, **(dump_kw or {}))


# -----------------------------------------------------------------------------
# The target without its layers: embedding and lm_head read alone by tensor name; the rest from the capture

def weight_files(name):
    """{tensor name: file} of a target's safetensors (one file or an index), local or downloaded once; of a GGUF's."""
    if os.path.exists(name) and not os.path.isfile(os.path.join(name, "config.json")):  # as dflash.load_target
        return dflash.import_tool("gguf_target", f"target {name!r} (no config.json: a GGUF?)").weight_files(name)
    path = name
    if not os.path.isdir(name):
        from huggingface_hub import snapshot_download
        path = snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        m = dflash.read_json(index, "safetensors index").get("weight_map") or {}
        return {k: os.path.join(path, v) for k, v in m.items()}
    single = os.path.join(path, "model.safetensors")
    need(os.path.isfile(single), f"target {name!r}: no model.safetensors (nor an index); --features reads the "
         f"embedding and lm_head from safetensors")
    from safetensors import safe_open
    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def read_tensor(files, module_name, what, name):
    """The tensor of module_name's weight: its own name, else the one name ending like it (checkpoint prefixes)."""
    want = f"{module_name}.weight"
    tail = ".".join(want.split(".")[-2:])  # embed_tokens.weight, lm_head.weight
    hits = [want] if want in files else [k for k in files if k == tail or k.endswith("." + tail)]
    if not hits:
        return None
    need(len(hits) == 1, f"target {name!r}: {len(hits)} tensors could be its {what} ({', '.join(hits[:3])})")
    return get_tensor(files[hits[0]], hits[0])


def get_tensor(file, key):  # one tensor of a safetensors file, or of a GGUF (dequantised as transformers loads it)
    if file.endswith(".gguf"):
        return dflash.import_tool("gguf_target", f"the GGUF {file!r}").tensor(file, key)
    from safetensors import safe_open
    with safe_open(file, "pt") as f:
        return f.get_tensor(key)


class Stub:  # the model's config and generation config, and a generate that reads the captured continuations
    def __init__(self, meta, generate):
        self.config, self.generation_config, self.generate = meta.config, meta.generation_config, generate


class FeatureTarget:
    """What training needs of a target, with the features read from a capture: embed, lm_head, tokenizer, model
    (config, generation_config, generate from the captured walk), features(input_ids, layer_ids, labels, final).
    capture: --capture_missing's Capture, beside the whole target (a row the capture lacks is captured, written)."""
    sharded = False

    def __init__(self, meta, embed, lm_head, store, name, capture=None):
        self.model, self.name, self.tokenizer = Stub(meta.model, self.generate), name, meta.tokenizer
        self.embed, self.lm_head, self.store, self.capture = embed, lm_head, store, capture
        self.num_layers, (self.vocab_size, self.hidden_size) = meta.num_layers, lm_head.weight.shape
        self.pad, self.layers = pad_of(meta.tokenizer), meta.layers  # (meta layers: sizes, never weights)
        self.source = getattr(meta, "source", {})  # a GGUF target's file and hash, for its record

    eos_ids = dflash.Target.eos_ids

    @property
    def walk_source(self):  # how the held-out walk's continuations are had: read from the capture, not generated
        return "reading the captured" + (" (generating the missing)" if self.capture is not None else "")

    def row(self, ids):
        """(n, tensors) of one token row: its capture, or (online) captured now; (0, None) for an all-pad row."""
        key, n = row_key(ids, self.pad)
        hit = self.store.find(key, len(ids)) if n else (0, None)
        if hit is None and self.capture is not None:
            self.store.add(key, *self.capture.missing(key))
            hit = self.store.find(key, len(ids))
        need(hit is not None, f"--features {self.store.path}: a batch sample of {n} tokens ({ids[:6].tolist()}...) "
             f"is in no captured file: its tokens disagree with the capture's data; recapture from this --data")
        if hit[1] is None:
            return 0, None
        t = self.store.read(hit[1], self.embed.weight.dtype)
        need(torch.equal(t["input_ids"], ids[:hit[0]].cpu()), f"{hit[1]}: its tokens disagree with the batch's "
             f"(a corrupt file or a hash collision); remove it and rerun the capture")
        return hit[0], t

    def features(self, input_ids, layer_ids, labels=True, final=False):
        """dflash.Target.features from the capture: context, the labels (as captured, or greedy from a stored f), f."""
        context, stored = self.stored(input_ids, layer_ids)
        f = None if stored.dtype == torch.long else stored  # the labels alone, or f (--store_final)
        y = (stored if f is None else dflash.greedy_labels(f, self.lm_head)) if labels else None
        return context, y, f if final else None

    @torch.no_grad()
    def stored(self, input_ids, layer_ids):
        """target_features from the capture: context (b, S, m*D), and the labels (b, S) long (or f with --store_final;
        positions past a sample's end: 0 and -1, never visible nor weighted)."""
        b, S = input_ids.shape
        need(list(layer_ids) == self.store.layer_ids, f"--features: layers {list(layer_ids)} asked, "
             f"{self.store.layer_ids} opened")
        dev, dtype = self.lm_head.weight.device, self.embed.weight.dtype
        context = torch.zeros(b, S, len(layer_ids) * self.hidden_size, dtype=dtype)
        labels, final = torch.full((b, S), -1, dtype=torch.long), None
        for r in range(b):
            n, t = self.row(input_ids[r])
            if t is None:
                continue
            context[r, :n] = t["features"]
            if t["final"] is not None:
                final = torch.zeros(b, S, self.hidden_size, dtype=dtype) if final is None else final
                final[r, :n] = t["final"]
            elif t["labels"] is not None:  # (a walk file has none: the walk reads features only)
                labels[r, :n] = t["labels"]
        return context.to(dev), (labels if final is None else final).to(dev)

    def generate(self, ids, max_new_tokens=None, **kw):  # the held-out walk's greedy continuation, as captured
        key, _ = row_key(ids[0], -1)
        p = self.store.prompts.get(key) if hasattr(self.store, "prompts") else None
        if p is None and self.capture is not None:  # --capture_missing: generated, captured now
            out = self.capture.generate(ids, max_new_tokens, **kw)
            self.store.add(row_key(out[0], self.pad)[0], out.shape[1], self.capture.last, sample=False)
            return out
        need(p is not None, f"--features {self.store.path}: a held-out walk prompt is not captured (other --seed, "
             f"--eval_fraction, --eval_data or --eval_walk_prompts than the capture's); pass the capture's, "
             f"--eval_walk_prompts 0, or --capture_missing")
        t = self.store.read(p)
        walk = self.store.manifest.get("walk") or {}
        need(walk.get("tokens") == max_new_tokens, f"--features: the held-out walk was captured with "
             f"--eval_walk_tokens {walk.get('tokens')}, this run asks {max_new_tokens}; pass --eval_walk_tokens "
             f"{walk.get('tokens')}")
        return t["input_ids"][None].to(ids.device)


def load_embedding_and_head(args, meta, device):
    """The target's embedding and lm_head alone (tied: one tensor), in the run's target dtype."""
    files = weight_files(args.target)
    dtype = dflash.DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    names = {m: n for n, m in meta.model.named_modules()}
    e = read_tensor(files, names[meta.embed], "embedding", args.target)
    need(e is not None, f"target {args.target!r}: no embedding tensor ({names[meta.embed]}.weight) in its safetensors")
    embed = nn.Embedding.from_pretrained(e.to(device, dtype), freeze=True)
    h = read_tensor(files, names[meta.lm_head], "lm_head", args.target)
    tied = meta.lm_head.weight is meta.embed.weight or h is None
    need(h is not None or getattr(meta.model.config.get_text_config(), "tie_word_embeddings", False),
         f"target {args.target!r}: no lm_head tensor in its safetensors and the embeddings are not tied")
    head = nn.Linear(*reversed(e.shape), bias=False, device="meta")
    head.weight = embed.weight if tied else nn.Parameter(h.to(device, dtype), requires_grad=False)
    return embed, head


def final_norm(args, meta, device):
    """The target's final norm (its own module: Gemma's adds 1), its weight read alone; None if none is stored."""
    files, want = weight_files(args.target), {mod: name for name, mod in meta.model.named_modules()}.get(meta.norm, "?")
    hits = [f"{want}.weight"] if f"{want}.weight" in files else [  # else the one final norm under a prefix
        k for k in files if k.endswith(".norm.weight") and ".layers." not in k and "visual" not in k]
    if len(hits) != 1:
        return None  # (a dump whose labels need it says so)
    w = get_tensor(files[hits[0]], hits[0])
    norm = meta.norm.to_empty(device=device)
    with torch.no_grad():
        norm.weight.copy_(w)
    return norm.to(dflash.DTYPES[args.dtype] or (torch.bfloat16 if device.type == "cuda" else torch.float32))


def check_manifest(m, args, meta, path, digest):
    """One line per mismatch between a capture and this run, each naming the fix."""
    D, L, tok = meta.hidden_size, meta.num_layers, meta.tokenizer
    fix = "recapture with this run's target, or pass the --target it was captured from"
    got = (m.get("hidden_size"), m.get("num_target_layers"), m.get("vocab_size"))
    need(got == (D, L, meta.vocab_size), f"--features {path} is of a target with hidden {got[0]}, {got[1]} layers, "
         f"vocab {got[2]}; --target {args.target} has {D}, {L}, {meta.vocab_size}: {fix}")
    need(m.get("tokenizer") == tokenizer_hash(tok), f"--features {path} was captured with another tokenizer "
         f"({m.get('tokenizer')}, this target's {tokenizer_hash(tok)}); {fix}")
    need(m.get("chat_template") == template_hash(tok), f"--features {path} was captured with another chat template "
         f"({m.get('chat_template')}, this target's {template_hash(tok)}); {fix}")
    for k in ("max_len", "enable_thinking"):
        need(m.get(k) == getattr(args, k), f"--features {path} was captured with {as_flag(k, m.get(k))}, this run "
             f"has {as_flag(k, getattr(args, k))}; pass {as_flag(k, m.get(k))}, or recapture")
    digest = digest or dflash.path_digest(args.data)
    need(m.get("data") == digest, f"--features {path} was captured from other data than --data {args.data} (sha256 "
         f"{str((m.get('data') or {}).get('sha256'))[:12]}, this {digest['sha256'][:12]}); pass that --data or "
         f"recapture")
    if args.eval_data:
        need(m.get("eval_data") == dflash.path_digest(args.eval_data), f"--features {path} holds no capture of "
             f"--eval_data {args.eval_data}; recapture with it, or drop --eval_data")
    w = m.get("walk") or {}
    same = {"seed": args.seed, "eval_fraction": dflash.eval_fraction(args), "eval_walk_tokens": args.eval_walk_tokens}
    bad = [k for k, v in same.items() if w.get(k.removeprefix("eval_walk_")) != v] + (
        ["eval_walk_prompts"] if w.get("prompts", 0) < args.eval_walk_prompts else [])
    flags = " ".join(f"--{k} {w.get(k.removeprefix('eval_walk_'))}" for k in bad)
    need(not (args.eval_walk_prompts and bad) or args.capture_missing, f"--features {path}: its held-out walk was "
         f"captured with {flags}; pass {flags}, or --eval_walk_prompts 0, or --capture_missing")


def as_flag(k, v):  # the command line that gives flag --k the value v (enable_thinking: either way, or neither)
    if k != "enable_thinking":
        return f"--{k} {v}"
    return {True: "--enable_thinking", False: "--no-enable_thinking"}.get(v, "neither --enable_thinking nor "
                                                                             "--no-enable_thinking")


def load_target(args, run, world, device):
    """dflash.py --features: the FeatureTarget of a capture (--capture_missing: beside the whole target, which
    captures the rows the capture lacks)."""
    need(not args.shard_target, "--features loads no target layers: nothing to shard; drop --shard_target")
    need(not (run.stage and getattr(run.stage.Stage, "runs_target", True)), f"--stage {args.stage} runs the target "
         f"itself (its Stage.runs_target), --features loads none of its layers; drop one")
    meta = dflash.load_target(args.target, "meta", dflash.DTYPES[args.dtype], args.trust_remote_code)
    embed, head = load_embedding_and_head(args, meta, device)
    record = dflash.target_record(FeatureTarget(meta, embed, head, None, args.target))
    ids, f = run.cfg.target_layer_ids, os.path.join(args.features, MANIFEST)
    fresh = args.capture_missing and not os.path.isfile(f)  # hybrid from nothing: the capture below makes it
    foreign = not fresh and not os.path.isfile(f)  # another trainer's dump: its labels may need the final norm
    store = None if fresh else open_features(args.features, ids, record, dict(
        dump_layer_ids=getattr(args, "dump_layer_ids", None), target_config=meta.model.config, lm_head=head,
        norm=final_norm(args, meta, device) if foreign else None, labels=args.labels == "target",
        data=getattr(args, "dump_data", None)))
    if isinstance(store, Features):
        m = store.manifest
        need(m["target"]["fingerprint"] == record["fingerprint"], f"--features {args.features} was captured from "
             f"target {m['target']['target']!r} ({m['target']['fingerprint']}), not {args.target!r} "
             f"({record['fingerprint']}); recapture with this target, or pass the --target it was captured from")
        check_layers(m, args)
        check_manifest(m, args, meta, args.features, run.data_digest)
        need(m.get("complete") or args.capture_missing, f"--features {args.features} is incomplete ({len(store)} "
             f"samples of {m.get('num_samples')}): rerun its capture (it continues), or add --capture_missing")
        store.check()
    elif store is not None:  # another trainer's dump: looked up by its tokens
        need(not args.capture_missing, "--capture_missing writes our format only; give a capture directory")
        need(not args.eval_walk_prompts, f"--features {args.features} holds no held-out walks (the target's greedy "
             f"continuations); pass --eval_walk_prompts 0, or capture with dflash_tools/features.py")
        store = Indexed(store, args.features, pad_of(meta.tokenizer), ids, args.max_len)
        need(args.labels == "data" or not len(store.reader) or store.reader.sample(0)["labels"] is not None,
             f"--features {args.features} holds no target labels (the greedy tokens --labels target trains on); "
             f"pass --labels data (data regenerated by the target), or capture with dflash_tools/features.py")
    capture = None
    if args.capture_missing:
        online = dflash.load_target(args.target, device, dflash.DTYPES[args.dtype], args.trust_remote_code)
        capture = Capture(args, online, args.features, rank_of(), world, record, say=lambda *a: None)
        if store is not None:  # continue it as it was made
            capture.dtype, capture.final = store.manifest["dtype"], store.manifest["final"]
        capture.open(store.manifest["target_layer_ids"] if store is not None else ids)
        store = Features(args.features, ids)
    need(not getattr(dflash.loss_of(args), "target_logits", False) or (isinstance(store, Features) and
         store.manifest.get("final")), f"--loss {args.loss} needs the target's distribution, f, which --features "
         f"{args.features} does not hold; capture with --store_final (our format), or train online")
    if rank_of() == 0:
        print(reading_line(args.features, store, ids, capture is not None))
    return FeatureTarget(meta, embed, head, store, args.target, capture=capture)


def check_layers(m, args):
    """The capture's target against --target beyond the embedding: every tensor's sample (weights_digest)."""
    if "layers_digest" not in m:  # a capture made before the digest: the embedding's fingerprint alone was checked
        if rank_of() == 0:
            print(f"note: --features {args.features} predates the layers' digest: only the target's embedding is "
                  f"checked against --target {args.target}", file=sys.stderr)
        return
    now = weights_digest(args.target)
    need(None in (m["layers_digest"], now) or m["layers_digest"] == now, f"--features {args.features} was captured "
         f"from a target whose weights differ from --target {args.target!r} beyond the embedding (layers digest "
         f"{m['layers_digest']}, this target's {now}: a fine-tune of the same base?); recapture with this target, or "
         f"pass the --target it was captured from")


def reading_line(path, store, ids, hybrid):
    """The line that says a run trains from features: the directory, dtype, layers, samples (and walks)."""
    m, n = store.manifest, len(getattr(store, "reader", store))  # (a plug-in reader's manifest may say less)
    kind = f"{m['kind']} dump, " if m.get("kind") else ""
    walks = f", {len(store.prompts)} held-out walks" if store.prompts else ""
    layers = "the target captures what is missing (--capture_missing)" if hybrid else "the target's layers not loaded"
    return (f"features: training from {path} ({kind}{m.get('dtype', 'dtype unsaid')}, layers {ids} of "
            f"{m.get('available_layer_ids', m['target_layer_ids'])}, {n:,} of {m.get('num_samples', n):,} samples"
            f"{walks}); {layers}")


class Indexed:
    """Another trainer's dump (the reader interface) made searchable by tokens: every sample's tokens, read once."""

    def __init__(self, reader, path, pad, layer_ids, max_len=None):
        self.reader, self.path, self.manifest, self.prompts, self.keys = reader, path, reader.manifest, {}, {}
        self.layer_ids = list(layer_ids)
        skipped = longest = 0
        tokens = getattr(reader, "tokens", None)  # a sample's tokens alone (dumps.py's): no features read twice
        for i in tqdm(range(len(reader)), desc="indexing the dump", disable=len(reader) < 1000):
            ids = tokens(i) if tokens else (reader.sample(i) or {}).get("input_ids")
            if ids is None:  # a sample the reader skips (non-finite): counted, and a batch holding it is refused
                skipped += 1
                continue
            key, n = row_key(ids, pad)
            self.keys.setdefault(key, []).append((n, True, i))
            longest = max(longest, n)
        need(not max_len or longest <= max_len, f"--features {path}: its longest row has {longest:,} tokens, past "
             f"--max_len {max_len} (training cuts --data's rows there, and a cut row is in no dump); pass --max_len "
             f"{longest} or more")
        if skipped:
            print(f"note: --features {path}: {skipped} of {len(reader)} samples skipped (non-finite features)",
                  file=sys.stderr)

    find = Features.find

    def read(self, i, dtype=torch.float32):
        t = self.reader.sample(i)
        need(t is not None, f"--features {self.path}: a batch holds its sample {i}, whose features are not finite "
             f"(the reader skipped it, named above); drop that sample from --data, or capture it again")
        return {**t, "features": t["features"].to(dtype), "final": None}


def rank_of():
    return dflash.dist.get_rank() if dflash.dist.is_available() and dflash.dist.is_initialized() else 0


# -----------------------------------------------------------------------------
# The capture

class Capture:
    """Writes a capture: the manifest, then each sample (and held-out walk prompt) as its own file, this rank's in
    its own folder. `missing` captures one row on demand (--capture_missing)."""

    def __init__(self, args, target, out, rank, world, record, say=print):
        self.args, self.target, self.out, self.rank, self.world, self.say = args, target, out, rank, world, say
        self.record, self.dir = record, os.path.join(out, f"rank{rank:03d}")
        self.dtype = getattr(args, "features_dtype", None) or ("bf16" if target.lm_head.weight.is_cuda else "fp32")
        self.final, self.data = getattr(args, "store_final", False), None
        self.forward_s, self.tokens = 0.0, 0

    def samples(self):
        """The data's samples as training reads them (then --eval_data's), and the held-out walk's prompts."""
        a, t = self.args, self.target
        if self.data is not None:
            return self.data, self.prompts
        kw = dict(say=lambda *x: None, enable_thinking=a.enable_thinking, eos_ids=t.eos_ids(), vocab_size=t.vocab_size)
        data = dflash.load_samples(a.data, t.tokenizer, a.max_len, **kw)
        held = dflash.load_samples(a.eval_data, t.tokenizer, a.max_len, **kw) if a.eval_data else []
        evals = held or dflash.split_eval(data, dflash.eval_fraction(a), a.seed)[1]
        return data + held, dflash.walk_prompts(evals, a.eval_walk_prompts)

    def manifest(self, samples, prompts):
        a, t = self.args, self.target
        return {"format": FORMAT, "version": VERSION, "target": self.record, "layers_digest": weights_digest(a.target),
                "hidden_size": t.hidden_size, "num_target_layers": t.num_layers, "vocab_size": t.vocab_size,
                "tokenizer": tokenizer_hash(t.tokenizer), "chat_template": template_hash(t.tokenizer),
                "target_layer_ids": self.layer_ids, "layer_convention": CONVENTION, "dtype": self.dtype,
                "final": self.final, "pad_id": pad_of(t.tokenizer), "num_samples": len(samples),
                "num_tokens": sum(len(ids) for ids, _ in samples), "complete": False,
                "data": dflash.path_digest(a.data),
                "eval_data": dflash.path_digest(a.eval_data) if a.eval_data else None,
                "max_len": a.max_len, "enable_thinking": a.enable_thinking,
                "walk": {"seed": a.seed, "eval_fraction": dflash.eval_fraction(a), "prompts": len(prompts),
                         "tokens": a.eval_walk_tokens},
                "flags": {k: v for k, v in vars(a).items() if isinstance(v, (str, int, float, bool, list, type(None)))}}

    def open(self, layer_ids=None):
        """Read the data, write (or check) the manifest, clear killed writes; -> what is left to capture."""
        a, t = self.args, self.target
        self.layer_ids = check_layer_ids(list(layer_ids or a.target_layer_ids or capture_layers(t.num_layers)),
                                         t.num_layers)
        self.data, self.prompts = self.samples()
        self.pad = pad_of(t.tokenizer)
        self.keys = {row_key(ids, self.pad)[0]: i for i, (ids, _) in enumerate(self.data)}
        new = self.manifest(self.data, self.prompts)
        f = os.path.join(self.out, MANIFEST)
        if os.path.isfile(f):
            old = dflash.read_json(f, "features manifest")
            keys = ("target_layer_ids", "dtype", "final", "tokenizer", "chat_template", "data", "eval_data", "max_len",
                    "enable_thinking", "walk", "hidden_size", "num_target_layers", "layers_digest")
            diff = [k for k in keys if old.get(k, new[k]) != new[k]] + (  # (a key an older capture lacks: not compared)
                [] if old.get("target", {}).get("fingerprint") == self.record["fingerprint"] else ["target"])
            k = diff[0] if diff else None
            need(not diff, f"--out {self.out} holds a capture made with another {', '.join(diff)} ({old.get(k)}, now "
                 f"{new.get(k) if k != 'target' else self.record['fingerprint']}); give a new --out, or the same flags"
                 f" to continue it")
        elif self.rank == 0:
            os.makedirs(self.out, exist_ok=True)
            dflash.write_atomic(f, json.dumps(new, indent=1))
        barrier(self.world)
        os.makedirs(self.dir, exist_ok=True)
        for name in os.listdir(self.dir):  # killed writes of this rank (their files were never renamed)
            if ".tmp" in name:
                os.remove(os.path.join(self.dir, name))
        done = {n for d in rank_dirs(self.out) for n in os.listdir(d) if NAME.match(n)}
        todo = [i for i in range(self.rank, len(self.data), self.world) if f"s{i:08d}.safetensors" not in done]
        walk = [k for k in range(self.rank, len(self.prompts), self.world) if f"w{k:05d}.safetensors" not in done]
        return sorted(todo, key=lambda i: -len(self.data[i][0])), walk  # the longest first: less padding, OOM at once

    def features(self, rows):
        """One target pass over a batch of token lists (right-padded: a dense target's rows do not depend on it on
        the CPU) -> the tensors to store, per row; the forward's time counted alone."""
        t, dev = self.target, self.target.lm_head.weight.device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        x = dflash.collate([(ids, [0] * len(ids)) for ids in rows], self.pad)["input_ids"].to(dev)
        context, final = dflash.target_features(t, x, self.layer_ids)
        labels = dflash.greedy_labels(final, t.lm_head)
        sync()
        self.forward_s, self.tokens = self.forward_s + time.perf_counter() - t0, self.tokens + sum(map(len, rows))
        outs = []
        for r, ids in enumerate(rows):
            n = len(ids)
            out = {"input_ids": x[r, :n].int().cpu(), "labels": labels[r, :n].int().cpu()}
            if self.dtype == "int8":
                out["features"], out["scales"] = (v.cpu() for v in quantize(context[r, :n], len(self.layer_ids)))
            else:
                out["features"] = context[r, :n].to("cpu", STORE_DTYPES[self.dtype])
            if self.final:
                out["final"] = final[r, :n].to("cpu", torch.float32 if self.dtype == "fp32" else torch.bfloat16)
            outs.append(out)
        return outs

    def write(self, name, tensors, ids, kind, prompt=None):
        meta = {"key": row_key(ids, self.pad)[0], "n": len(ids), "kind": kind, **({"prompt": prompt} if prompt else {})}
        write_file(os.path.join(self.dir, name), tensors, {k: str(v) for k, v in meta.items()})
        append_index(self.dir, name, meta)

    def sample(self, *idx):
        for i, out in zip(idx, self.features([self.data[i][0] for i in idx])):
            ids, mask = self.data[i]
            out["loss_mask"] = torch.tensor(mask, dtype=torch.uint8)
            self.write(f"s{i:08d}.safetensors", out, ids, "sample")

    def walk(self, k):
        p = self.prompts[k]
        s = dflash.greedy_continuation(self.target, p, self.args.eval_walk_tokens, self.target.eos_ids())
        out = self.features([p + s])[0]
        out = {"input_ids": out["input_ids"], "features": out["features"], "prompt_len": torch.tensor([len(p)]),
               **({"scales": out["scales"]} if "scales" in out else {})}
        self.write(f"w{k:05d}.safetensors", out, p + s, "walk", row_key(p, -1)[0])
        self.last = os.path.join(self.dir, f"w{k:05d}.safetensors")
        return s

    def missing(self, key):
        """--capture_missing: (tokens, file) of a batch row this rank has not seen: another rank's file, or captured
        now into this rank's folder."""
        i = self.keys.get(key)
        need(i is not None, f"--capture_missing: a batch sample is not in --data {self.args.data}")
        name = f"s{i:08d}.safetensors"
        done = [os.path.join(d, name) for d in rank_dirs(self.out) if os.path.isfile(os.path.join(d, name))]
        if not done:
            self.sample(i)
        return len(self.data[i][0]), done[0] if done else os.path.join(self.dir, name)

    def generate(self, ids, max_new_tokens, **kw):  # --capture_missing: a walk prompt, generated and captured now
        p = ids[0].tolist()
        k = next((k for k, q in enumerate(self.prompts) if q == p), None)
        need(k is not None, "--capture_missing: a held-out walk prompt is not one of --data's held-out prompts")
        return torch.tensor([p + self.walk(k)], device=ids.device)

    def finish(self):
        """Rank 0, after every rank: the manifest's counts, complete when every sample and walk prompt is there."""
        f = os.path.join(self.out, MANIFEST)
        m = dflash.read_json(f, "features manifest")
        names = {n for d in rank_dirs(self.out) for n in read_index(d)}
        have = sum(f"s{i:08d}.safetensors" in names for i in range(len(self.data)))
        walked = sum(f"w{k:05d}.safetensors" in names for k in range(len(self.prompts)))
        m["complete"] = have == len(self.data) and walked == len(self.prompts)
        dflash.write_atomic(f, json.dumps(m, indent=1))
        return m["complete"], have


def capture_layers(L):  # the default: those a 5-layer drafter reads by default (training's), each layer once
    return dflash.valid_target_layer_ids(L, 5)


def check_layer_ids(ids, L):  # layers a drafter can read (not the last: SGLang cannot capture it), each once
    bad = [i for i in ids if not 0 <= i < L - 1]
    need(not bad, f"--target_layer_ids {bad}: a drafter reads the target's layers 0..{L - 2} (not its last, which "
         f"SGLang cannot capture); give layers in that range")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    need(not twice, f"--target_layer_ids {ids} store layer(s) {twice} twice; give each layer once")
    return ids


def barrier(world):
    if world > 1:
        dflash.dist.barrier()


def capture(args):
    """The capture command: sizes and disk first (a refusal in one line), then this rank's missing files."""
    rank, world, device = dflash.setup_distributed(args.device)
    say = print if rank == 0 else (lambda *a: None)
    meta = dflash.load_target(args.target, "meta", dflash.DTYPES[args.dtype], args.trust_remote_code)
    need(os.path.isfile(args.data) or os.path.isdir(args.data), f"--data {args.data!r} does not exist; give a file")
    dflash.check_writable_dir(args.out, "--out", fix="give a writable directory for the capture")
    cap = Capture(args, meta, args.out, rank, world, None, say)
    cap.record = {"target": args.target, "fingerprint": None}  # the real record once the weights load
    ids = check_layer_ids(list(args.target_layer_ids or capture_layers(meta.num_layers)), meta.num_layers)
    cap.layer_ids = ids
    cap.data, cap.prompts = cap.samples()
    m, D = len(ids), meta.hidden_size
    bpt = bytes_per_token(m, D, args.features_dtype, args.store_final)
    tokens = sum(len(x) for x, _ in cap.data)
    walk_tokens = sum(len(p) + args.eval_walk_tokens for p in cap.prompts)
    have = sum(os.path.getsize(os.path.join(d, n)) for d in rank_dirs(args.out) for n in os.listdir(d)
               if NAME.match(n))
    needed = max((tokens + walk_tokens) * bpt + (len(cap.data) + len(cap.prompts)) * FILE_OVERHEAD - have, 0)
    os.makedirs(args.out, exist_ok=True)
    disk = shutil.disk_usage(args.out)
    say(f"features: {bpt:,} bytes/token ({m} layers {ids} x D {D} x {args.features_dtype}, + labels, tokens, mask"
        f"{', + f' if args.store_final else ''}); {len(cap.data):,} samples, {tokens:,} tokens + {len(cap.prompts)} "
        f"walk prompts: {(tokens + walk_tokens) * bpt / 1e9:.3f} GB, {needed / 1e9:.3f} GB still to write; disk "
        f"{disk.total / 1e9:.1f} GB, {disk.free / 1e9:.1f} GB free")
    need(needed <= disk.free, f"--out {args.out}: the capture needs {needed / 1e9:.2f} GB more, the disk has "
         f"{disk.free / 1e9:.2f} GB free; free space, give another --out, or --features_dtype int8 (half of bf16)")
    target = dflash.load_target(args.target, device, dflash.DTYPES[args.dtype], args.trust_remote_code)
    cap.target, cap.record = target, dflash.target_record(target)
    todo, walk = cap.open(ids)
    t0, quiet, share = time.perf_counter(), rank != 0 and world > 1, f" (rank 0's share of {world})" * (world > 1)
    with tqdm(total=len(todo), desc=f"capture: samples{share}", unit="sample", disable=quiet or not todo) as bar:
        for k in range(0, len(todo), args.batch_size):
            cap.sample(*todo[k:k + args.batch_size])
            bar.update(len(todo[k:k + args.batch_size]))
            bar.set_postfix_str(f"{cap.tokens:,} tokens")
    generated = 0
    with tqdm(total=len(walk), desc=f"capture: held-out walk prompts, the target generating up to "
              f"{args.eval_walk_tokens} tokens each{share}", unit="prompt", disable=quiet or not walk) as bar:
        for k in walk:
            generated += len(cap.walk(k))
            bar.update(1)
            bar.set_postfix_str(f"{generated:,} tokens generated")
    wall = time.perf_counter() - t0
    stats = torch.tensor([cap.tokens, wall, cap.forward_s], dtype=torch.float64)
    if world > 1:
        dflash.dist.all_reduce(stats)
        barrier(world)
    tok, wall, fwd = stats.tolist()
    if rank == 0:
        complete, have = cap.finish()
        say(f"captured {int(tok):,} tokens in {wall / world:.1f}s per rank: {tok / max(wall, 1e-9) * world:,.0f} "
            f"tokens/s; the target's forward alone {tok / max(fwd, 1e-9) * world:,.0f} tokens/s (capture at "
            f"{fwd / max(wall, 1e-9):.0%} of it); {have} of {len(cap.data)} samples"
            f"{'' if complete else ' (incomplete: rerun to continue)'} in {args.out}")
    if world > 1:
        dflash.dist.destroy_process_group()


# -----------------------------------------------------------------------------
# The bench: a step from features against an online step, side by side on the same batches

MID = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=16,
           num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)  # a mid shape, random weights
MID_FLAGS = ["--num_draft_layers", "2", "--target_layer_ids", "1,4,6", "--block_size", "16", "--num_anchors", "32",
             "--max_len", "256", "--batch_size", "2", "--grad_accum", "1", "--mask_token_id", "31999"]


def mid_target(d):
    """A random Qwen3 of the MID shape and 16 random samples of 256 tokens (half prompt) in d."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**MID)).save_pretrained(os.path.join(d, "mid"))
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(d, "mid.jsonl"), "w") as f:
        for _ in range(16):
            ids = torch.randint(0, MID["vocab_size"] - 1, (256,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 128 + [1] * 128}) + "\n")
    return os.path.join(d, "mid"), os.path.join(d, "mid.jsonl")


def step_flops(cfg, micro, num_anchors, gamma):
    """The useful matmul FLOPs of one drafter training step (forward + backward) over micro: bench.drafter_flops per
    row (2 x params x tokens forward, 4 x backward; the frozen lm_head 4 x D x V per weighted token; attention over
    the visible pairs alone), at the anchors train_step draws (batch_anchors: a function of the batch)."""
    from dflash_tools import bench as b
    total = 0
    for mb in micro:
        a, v = dflash.batch_anchors(mb, num_anchors)
        w, S = dflash.loss_weights(a, v, mb["loss_mask"], cfg.block_size, gamma), mb["input_ids"].shape[1]
        for r in range(len(a)):
            pairs = b.visible_pairs(cfg, a[r:r + 1], v[r:r + 1], S)
            total += sum(b.drafter_flops(cfg, S, a.shape[1], int((w[r] > 0).sum()), pairs).values())
    return total


def time_steps(argv, steps, dtype="fp32", say=print):
    """(online s/step, features s/step, the target's forward s/step, bytes on disk a token, cfg, the target, the
    step's FLOPs {useful: step_flops, executed: torch's FlopCounterMode over one features step}) for dflash.py flags
    argv (--target, --data, the drafter and batch): a capture first, then both steps alternately on the same
    batches."""
    from torch.utils.flop_counter import FlopCounterMode
    import copy
    import tempfile
    args = dflash.get_parser().parse_args(argv + ["--noise_std", "0.02", "--eval_walk_prompts", "0"])
    online = dflash.load_target(args.target)
    given = {k: getattr(args, k) for k in dflash.DRAFTER_FLAGS if getattr(args, k) is not None}
    cfg = dflash.new_drafter_config(online, **given, say=lambda *a: None, max_len=args.max_len)
    with tempfile.TemporaryDirectory() as d:
        features_dir = os.path.join(d, "f")
        main(["capture", "--target", args.target, "--data", args.data, "--out", features_dir, "--max_len",
              str(args.max_len), "--target_layer_ids", ",".join(map(str, cfg.target_layer_ids)), "--features_dtype",
              dtype, "--eval_walk_prompts", "0"])
        m = dflash.read_json(os.path.join(features_dir, MANIFEST), "manifest")
        disk = sum(os.path.getsize(os.path.join(r, n)) for r in rank_dirs(features_dir) for n in os.listdir(r))
        args.features, args.capture_missing = features_dir, False
        stored = load_target(args, dflash.RunSetup(cfg=cfg, data_digest=dflash.path_digest(args.data)), 1,
                             torch.device("cpu"))
        samples = dflash.load_samples(args.data, online.tokenizer, args.max_len, say=lambda *a: None)
        batches = dflash.Batches(samples, args.batch_size, args.grad_accum, 0, 1, args.seed, pad_of(online.tokenizer))
        run = dflash.RunSetup(cfg=cfg)
        drafter, model, opt, kw = dflash.build_drafter(args, run, online, 1, torch.device("cpu"), say=lambda *a: None)
        twin = copy.deepcopy(drafter)
        pairs = {"online": (online, model, opt), "features": (stored, twin, torch.optim.AdamW(
            twin.parameters(), lr=args.lr, betas=(0.9, 0.95)))}
        times, useful = {k: [] for k in (*pairs, "forward")}, []
        for step in range(steps + 1):  # step 0: warm-up, not counted
            micro = [batches.get(step, i) for i in range(args.grad_accum)]
            useful.append(step_flops(cfg, micro, dflash.num_anchors(args), args.gamma))
            for name, (target, mdl, o) in pairs.items():
                t0 = time.perf_counter()
                dflash.train_step(mdl, o, target, cfg, micro, args.lr, dflash.num_anchors(args), args.grad_clip, 1,
                                  **{**kw, "raw_model": mdl})
                times[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for mb in micro:
                dflash.greedy_labels(dflash.target_features(online, mb["input_ids"], cfg.target_layer_ids)[1],
                                     online.lm_head)
            times["forward"].append(time.perf_counter() - t0)
        with FlopCounterMode(display=False) as counter:  # the first batch's step once more, untimed
            dflash.train_step(twin, pairs["features"][2], stored, cfg, [batches.get(0, i) for i in range(
                args.grad_accum)], args.lr, dflash.num_anchors(args), args.grad_clip, 1, **{**kw, "raw_model": twin})
    med = {k: sorted(v[1:])[len(v[1:]) // 2] for k, v in times.items()}
    flops = {"useful": sum(useful[1:]) / steps, "executed_ratio": counter.get_total_flops() / useful[0]}
    return med["online"], med["features"], med["forward"], disk / m["num_tokens"], cfg, online, flops


def random_samples(path, n, length, vocab, seed=0):
    """n samples of `length` random ids below vocab - 1 (the last id: the mask token), the second half the loss's."""
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ids = torch.randint(0, vocab - 1, (length,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * (length // 2) + [1] * (length - length // 2)}) +
                    "\n")
    return path


def target_bench(args):
    """bench --target T: on T (a GGUF too), a step from a capture against online at the drafter geometry the flags
    give, the target forward's share of the online step, and the drafter step's FLOP/s against this machine's fp32
    matmul rate."""
    import tempfile
    from dflash_tools import bench as b
    torch.manual_seed(0)
    print(f"machine: {b.machine()}")
    n = args.matmul_size
    rate = b.matmul_rate("cpu", n, 4, torch.float32)
    print(f"fp32 matmul {n}^3 on {torch.get_num_threads()} threads: {rate / 1e9:,.1f} GFLOP/s (best of 4 runs of 4)")
    meta = dflash.load_target(args.target, "meta")
    with tempfile.TemporaryDirectory() as d:
        data = random_samples(os.path.join(d, "data.jsonl"), args.samples, args.max_len, meta.vocab_size)
        argv = ["--target", args.target, "--data", data, "--num_draft_layers", str(args.num_draft_layers),
                "--block_size", str(args.block_size), "--num_anchors", str(args.num_anchors), "--max_len",
                str(args.max_len), "--batch_size", str(args.batch_size), "--grad_accum", "1", "--mask_token_id",
                str(meta.vocab_size - 1)]
        on, feat, fwd, _, cfg, t, flops = time_steps(argv, args.steps, args.dtypes[0])
    tokens = args.batch_size * args.max_len
    print(f"target {args.target}: {t.num_layers} layers, D {t.hidden_size}, V {t.vocab_size}; drafter "
          f"{b.describe(cfg)}; batch {args.batch_size} x {args.max_len} tokens, {args.num_anchors} anchors, features "
          f"{args.dtypes[0]}")
    print(f"step (s, median of {args.steps}): online {on:.4g}, from the capture {feat:.4g}: {on / feat:.2f}x; the "
          f"target's forward {fwd:.4g} s, {fwd / on:.0%} of the online step ({tokens / fwd:,.0f} tokens/s)")
    useful, executed = flops["useful"], flops["useful"] * flops["executed_ratio"]
    print(f"drafter step: {useful / 1e9:.3g} GFLOP useful (bench.drafter_flops: 6 x params x tokens, the frozen "
          f"lm_head 4 x D x V a weighted token, attention over visible pairs), {executed / 1e9:.3g} executed (torch "
          f"FlopCounterMode: masked work included); from the capture {useful / feat / 1e9:.3g} GFLOP/s useful, "
          f"{executed / feat / 1e9:.3g} executed: {executed / feat / rate:.0%} of the matmul rate")


def bench(args):
    """Step time from features against online on the demo's target (its cache, when built) and the MID shape; with
    --target, target_bench on that target."""
    if args.target:
        return target_bench(args)
    import tempfile
    from dflash_tools import demo
    torch.manual_seed(0)
    rows, cache = [], os.path.join(demo.CACHE, "tiny_qwen35")
    with tempfile.TemporaryDirectory() as d:
        shapes = [("mid (random Qwen3, D 1024, 8 layers, V 32000)", [*(lambda t: ["--target", t[0], "--data", t[1]])(
            mid_target(d)), *MID_FLAGS])]
        if os.path.isfile(os.path.join(cache, "DONE")):
            shapes.insert(0, ("demo (Qwen3.5 hybrid, D 128, 4 layers, V 2048)", ["--target", cache, "--data",
                              os.path.join(demo.CACHE, "demo_data.jsonl"), *demo.DEMO_FLAGS]))
        for name, argv in shapes:
            for dtype in args.dtypes:
                on, feat, fwd, disk, cfg, t, _ = time_steps(argv, args.steps, dtype)
                formula = bytes_per_token(len(cfg.target_layer_ids), t.hidden_size, dtype)
                rows.append(f"{name:<48} {dtype:>5} {on:8.3f} {feat:8.3f} {on / feat:6.2f}x {fwd / on:7.0%} "
                            f"{disk:9.0f} {formula:8d}")
    print(f"{'shape':<48} {'dtype':>5} {'online':>8} {'features':>8} {'ratio':>7} {'target':>7} {'disk B/t':>9} "
          f"{'formula':>8}\n" + "\n".join(rows))
    print("s/step, medians; target: the target's forward share of an online step; disk: bytes a token on disk, formula "
          "m x D x dtype bytes + 9")


def add_flags(g):  # dflash.py's flags beside --features DIR
    dflash.flag(g, "--capture_missing", False, "capture what --features lacks while training", action="store_true")
    with suppress(ImportError):  # a foreign dump's own flags
        from dflash_tools import dumps
        dumps.add_flags(g)


def get_parser():
    p = dflash.ArgumentParser(description="Capture a target's features for DFlash training (then: dflash.py "
                                            "--features DIR).")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("capture", help="run the target once over --data and store its features")
    f = dflash.flag
    f(g, "--target", help="the target (as dflash.py --target)", required=True)
    f(g, "--data", help="the training data (as dflash.py --data)", required=True)
    f(g, "--out", help="the capture directory (a rerun continues it)", required=True)
    f(g, "--target_layer_ids", None, "comma list of the layers to store (default: dflash.py's for 5 drafter layers)",
      type=dflash.int_list)
    f(g, "--features_dtype", "bf16", "stored dtype: bf16, fp32 (exact on the CPU), int8 (scales per token and layer)",
      choices=list(STORE_DTYPES))
    f(g, "--store_final", False, "also store the final hidden state f (a loss needing the target's distribution)",
      action="store_true")
    f(g, "--max_len", 3072, "as dflash.py's --max_len", int, lo=2)
    f(g, "--batch_size", 8, "samples a target pass (right-padded)", int, lo=1)
    f(g, "--enable_thinking", None, "as dflash.py's", action=argparse.BooleanOptionalAction)
    f(g, "--eval_data", help="as dflash.py's --eval_data (captured too)")
    f(g, "--eval_fraction", None, "as dflash.py's (the held-out walk's prompts)", float, hi=.5)
    f(g, "--seed", 0, "as dflash.py's --seed (the held-out split)", int)
    f(g, "--eval_walk_prompts", 16, "held-out prompts whose greedy continuations are captured (0: none)", int)
    f(g, "--eval_walk_tokens", 64, "as dflash.py's", int, lo=1)
    f(g, "--dtype", "auto", "the target's dtype (auto: bf16 on CUDA, fp32 on CPU)", choices=list(dflash.DTYPES))
    f(g, "--device", None, "device (default: cuda:LOCAL_RANK if available, else cpu)")
    f(g, "--trust_remote_code", False, "allow the target's custom code", action="store_true")
    f(g, "--debug", False, "tracebacks for input errors", action="store_true")
    g = sub.add_parser("bench", help="step time from features against online, demo's target and a mid shape")
    f(g, "--steps", 4, "timed steps of each kind (after one warm-up)", int, lo=1)
    f(g, "--dtypes", ["fp32", "bf16"], "stored dtypes to time (--target: the first)", nargs="+",
      choices=list(STORE_DTYPES))
    f(g, "--target", None, "a target (as dflash.py --target, a GGUF too) to bench at the geometry below, with the "
      "drafter step's FLOP/s against this machine's fp32 matmul rate (default: the demo's target and a mid shape)")
    f(g, "--num_draft_layers", 3, "--target: drafter layers", int, lo=1)
    f(g, "--block_size", 16, "--target: block size", int, lo=2)
    f(g, "--num_anchors", 32, "--target: anchors a sample", int, lo=1)
    f(g, "--max_len", 320, "--target: tokens a sample (random ids, the second half in the loss)", int, lo=4)
    f(g, "--batch_size", 2, "--target: samples a step", int, lo=1)
    f(g, "--samples", 8, "--target: samples captured (the steps cycle through them)", int, lo=1)
    f(g, "--matmul_size", 2048, "--target: n of the n x n x n fp32 matmul timed for the machine's rate", int, lo=16)
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    return dflash.run_main(capture if args.command == "capture" else bench, args)


if __name__ == "__main__":
    main()
