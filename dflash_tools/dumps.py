"""The feature dumps other trainers write, read for `dflash.py --features DIR` when DIR is not one of ours: speculators'
(vLLM's extract_hidden_states, so a target served tensor-parallel on as many GPUs as it needs) and SpecForge's
(scripts/prepare_hidden_states.py). open_dump(DIR, ...) -> a Dump: .manifest, len(dump), dump.sample(i). Opening
reads no sample: the directory is listed, one file opened for its shapes, and each sample checked when it is read;
tokens(i), the index training builds before its first step, reads a sample's tokens and checks its file (speculators':
the safetensors header against the file's size and the row; SpecForge's: the record, read whole).

Our convention: layer t is the residual stream after decoder layer t (0-based), before the final norm; the labels are
y[j] = argmax lm_head(f[j-1]), f after the final norm. Theirs:
- speculators: DATA is prepare_data.py's save_to_disk dataset (input_ids, loss_mask per row); DATA/hidden_states/
  hs_{i}.safetensors is row i's capture: token_ids [S] and hidden_states [S, n, D] (bf16), a slot per layer id vLLM was
  launched with (launch_vllm.py --target-layer-ids, default 2, L//2, L-3; L appended), in layer order. vLLM's id k is
  the stream entering decoder layer k (id 0: the embedding's output), so id k is our layer k-1, and id L is the last
  layer's output before the final norm: labels = argmax lm_head(norm(h_L)). z-lab's ids are vLLM's minus one.
- SpecForge: OUT/rows_{a}-{a+2000}/data_{i}.ckpt (.ckpt.gz with --compress), one torch.save dict a sample: input_ids
  [S], loss_mask [S] and, for DFlash (and Domino, DSpark), hidden_states [1, S, m*D]: the draft config's
  dflash_config.target_layer_ids, already ours (SGLang captures "after layer k" before layer k+1), in layer order;
  DSpark adds target_last_hidden_states [1, S, D], after the final norm. EAGLE3's records hold aux_hidden_state
  [1, S, 3*D] (eagle_aux_hidden_state_layer_ids, ours too) and hidden_state [1, S, D] (after the final norm). A DFlash
  record holds no final state: SpecForge trains DFlash on the data's tokens, and so must we (--labels data).
Neither layout records its layer ids or its target: dump_layer_ids names the ids (in the dump's own convention), and
a Dump checks what it can: the slot count, the hidden size, the vocabulary, the tokens against the data's."""
import gzip
import io
import os
import re
import sys

import torch

from dflash import DFlashError, first_line, flag, greedy_labels, int_list, need
from dflash_tools.formats import optional_package, safetensors_header, saved_dataset

HS_FILE = re.compile(r"hs_(\d+)\.safetensors")         # speculators: one per dataset row
CKPT_FILE = re.compile(r"data_(\d+)\.ckpt(\.gz)?")      # SpecForge: one per sample
ROWS_DIR = re.compile(r"rows_\d+-\d+")                  # SpecForge: 2,000 samples a folder (--file-group-size)
REDO = "delete it and rerun the capture (it writes the files that are missing)"


def add_flags(g):  # what --features DIR needs beside it when DIR is a foreign dump (dflash_tools/features.py's flags)
    flag(g, "--dump_layer_ids", None, "a foreign dump's layer ids as its capture took them, comma list (speculators: "
         "launch_vllm.py --target-layer-ids; SpecForge: the draft config's target_layer_ids)", type=int_list)
    flag(g, "--dump_data", None, "speculators: prepare_data.py's output, when --features is a hidden_states folder "
         "kept elsewhere")


def dump_kind(path):
    """"speculators", "specforge" or None, by the names under path (no file is opened)."""
    def holds(d, pattern):
        with os.scandir(d) as it:
            return any(pattern.fullmatch(e.name) for e in it)
    if not os.path.isdir(path):
        return None
    hs = os.path.join(path, "hidden_states")
    if holds(path, HS_FILE) or (os.path.isdir(hs) and holds(hs, HS_FILE)):
        return "speculators"
    return "specforge" if holds(path, CKPT_FILE) or holds(path, ROWS_DIR) else None


def open_dump(path, layer_ids, dump_layer_ids, target_config, lm_head=None, norm=None, labels=True, data=None):
    """A Dump of the dump at path whose features are our layers layer_ids, in that order.

    dump_layer_ids: the layer ids the dump was captured with, as its tool took them (neither records them):
    speculators, those given to launch_vllm.py --target-layer-ids (the L it appends may be left out); SpecForge, the
    draft config's dflash_config.target_layer_ids (EAGLE3: eagle_aux_hidden_state_layer_ids).
    target_config: the target's (text) config, a dict or a transformers config: num_hidden_layers, hidden_size,
    vocab_size. labels: whether samples need the target's greedy labels, derived from the dump's final layer with
    lm_head (and norm, where that layer is before the final norm). data: speculators' dataset, when it is not path
    or the folder above path's hs_{i} files."""
    kind = dump_kind(path)
    need(kind, f"--features {path!r} holds neither our features nor a dump we read (speculators' hs_{{i}}.safetensors,"
         f" SpecForge's rows_*/data_{{i}}.ckpt); give a directory of one of those")
    cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    cfg = cfg.get("text_config", cfg) if isinstance(cfg, dict) else cfg  # a multimodal config.json's text model
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
    geometry = get("num_hidden_layers"), get("hidden_size"), get("vocab_size")
    need(all(isinstance(x, int) for x in geometry), "open_dump needs the target's num_hidden_layers, hidden_size and "
         "vocab_size (its config)")
    if not dump_layer_ids:
        raise DFlashError(f"--features {path!r}: {OWNER[kind]} files do not record which target layers they hold; name "
                          f"them as the capture took them ({DEFAULT_IDS[kind](geometry[0] or 0)})")
    dump = (SpeculatorsDump if kind == "speculators" else SpecForgeDump)(path, dump_layer_ids, geometry, data)
    dump.select(list(layer_ids), labels, lm_head, norm)
    return dump


OWNER = {"speculators": "speculators'", "specforge": "SpecForge's"}
DEFAULT_IDS = {
    "speculators": lambda L: f"the ids given to launch_vllm.py --target-layer-ids; its default for this {L}-layer "
                             f"target: 2 {L // 2} {L - 3} {L}",
    "specforge": lambda L: f"the draft config's dflash_config.target_layer_ids, or eagle_aux_hidden_state_layer_ids "
                           f"for EAGLE3 records (SGLang's default for this {L}-layer target: 1 {L // 2 - 1} {L - 4})",
}


class Dump:
    """A foreign dump: len(dump) samples; sample(i) -> {input_ids, loss_mask, features, labels} or None for a sample
    skipped (NaN or inf in its hidden states: counted in .skipped, {file: why}, and said on stderr once)."""
    kind, record = "", "extract_hidden_states"  # record: what the files hold (SpecForge: per training method)

    def __init__(self, path, dump_layer_ids, geometry, data):
        self.path, (self.L, self.D, self.V), self.data, self.skipped = path, geometry, data, {}
        self.files = self.list_files()
        need(self.files, f"--features {path!r}: no sample files in it yet (a capture still starting?)")
        self.slots, self.final, self.prenorm = self.layout(sorted({int(k) for k in dump_layer_ids}))
        # slots: {our layer t: its slot}; final: the final layer's slot or None; prenorm: whether it is before the norm

    def select(self, layer_ids, labels, lm_head, norm):
        have = sorted(self.slots)
        missing = [t for t in layer_ids if t not in self.slots]
        need(not missing, f"--features {self.path!r}: the drafter asks for target layer(s) {missing}, which the dump "
             f"does not hold (it holds our layers {have}: after decoder layer t); pick --target_layer_ids among "
             f"those, or capture again with them")
        need(not labels or self.final is not None, f"--features {self.path!r}: the dump holds no final hidden state, "
             f"so the target's greedy labels cannot be derived; pass --labels data (train on the data's "
             f"tokens, as SpecForge's DFlash does), or capture the final layer too")
        need(not labels or (lm_head is not None and (norm is not None or not self.prenorm)),
             "labels from a dump need the target's lm_head (and its final norm where the dump's final layer is "
             "before it)")
        self.layer_ids, self.labels, self.lm_head, self.norm = layer_ids, labels, lm_head, norm
        final = None if self.final is None else "before the final norm" if self.prenorm else "after the final norm"
        self.manifest = dict(kind=self.kind, record=self.record, target_layer_ids=layer_ids, available_layer_ids=have,
                             dump_layer_ids=self.dump_ids, final=final, hidden_size=self.D, num_samples=len(self.files),
                             dtype=str(self.dtype).removeprefix("torch."), missing=self.missing, target=None,
                             path=self.path)  # target: neither layout records the target it was made with

    def __len__(self):
        return len(self.files)

    def tokens(self, i):  # sample i's input_ids alone, for an index by tokens (no features cut, no labels derived)
        return self.read(i)[0]

    def sample(self, i):
        f = self.files[i]
        input_ids, loss_mask, stack, final = self.read(i)  # stack (S, n, D): the dump's layers, in its slot order
        S = len(input_ids)
        need(loss_mask.shape == (S,), f"{f}: loss_mask has {loss_mask.numel()} entries for {S} tokens; {REDO}")
        bad = input_ids[(input_ids < 0) | (input_ids >= self.V)] if self.V else input_ids[:0]
        if len(bad):
            raise DFlashError(f"{f}: token id {int(bad[0])} is outside the target's vocabulary [0, {self.V}): the "
                              f"dump was made with another tokenizer or target")
        features = stack[:, [self.slots[t] for t in self.layer_ids]].reshape(S, -1)  # (S, m*D), ours in order
        final = final if self.labels else None
        if not all_finite(features) or (final is not None and not all_finite(final)):
            if f not in self.skipped:
                self.skipped[f] = "NaN or inf in its hidden states"
                print(f"note: {f}: NaN or inf in its hidden states; skipped ({len(self.skipped)} so far)",
                      file=sys.stderr)
            return None
        y = None
        if final is not None:
            with torch.no_grad():
                w = self.lm_head.weight
                f_ = self.norm(final.to(w.device, w.dtype)) if self.prenorm else final.to(w.device, w.dtype)
                y = greedy_labels(f_[None], self.lm_head)[0].cpu()
        return dict(input_ids=input_ids, loss_mask=loss_mask, features=features, labels=y)

    def check_stack(self, f, stack, S, n):  # (S, n, D) as the layout says, D the target's
        shape = tuple(stack.shape)
        need(stack.is_floating_point(), f"{f}: hidden states of dtype {stack.dtype}, not floating point; {REDO}")
        need(shape[0] == S, f"{f}: hidden states for {shape[0]} tokens, but the sample has {S}; {REDO}")
        need(shape[1] == n, f"{f}: hidden states of {shape[1]} layers, {n} in the dump's first file ({self.dump_ids})"
             f"; {REDO}")
        need(not self.D or shape[2] == self.D, f"{f}: hidden size {shape[2]}, but the target's is {self.D}: the dump "
             f"was made with another target")


def all_finite(x):  # NaN and inf reach a row's sum, so a finite sum clears the row (~10x faster than isfinite on
    # bf16); a sum that overflowed is checked entry by entry
    return bool(torch.isfinite(x.sum(-1)).all()) or bool(torch.isfinite(x).all())


SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F8_E4M3": "float8_e4m3fn"}


def unreadable(f, e):
    return DFlashError(f"cannot read {f} ({first_line(e)}): truncated or corrupt; {REDO}")


class SpeculatorsDump(Dump):
    kind = "speculators"

    def list_files(self):
        sub = os.path.join(self.path, "hidden_states")
        self.hs_dir = sub if os.path.isdir(sub) else self.path
        parent = os.path.dirname(os.path.abspath(self.hs_dir))
        data = self.data or (self.path if saved_dataset(self.path) else parent if saved_dataset(parent) else None)
        need(data, f"--features {self.path!r}: speculators' hidden states without their dataset (its tokens and loss "
             f"mask): give prepare_data.py's output directory, whose hidden_states/ holds the hs_{{i}} files")
        datasets = optional_package("datasets", "datasets", f"--features {self.path!r}: reading its dataset")
        try:
            self.ds, self.data = datasets.load_from_disk(data), data
        except Exception as e:  # the library's own errors for a damaged directory
            raise DFlashError(f"cannot read speculators' dataset {data!r}: {first_line(e)}") from None
        if isinstance(self.ds, datasets.DatasetDict):
            raise DFlashError(f"{data!r} holds the splits {', '.join(self.ds)}; speculators' prepare_data.py writes "
                              f"one dataset: give its output directory")
        cols = set(self.ds.column_names)
        need("loss_mask" in cols and "input_ids" in cols, f"speculators' dataset {data!r} has no "
             f"{' and no '.join(sorted({'input_ids', 'loss_mask'} - cols))} column: DFlash trains on the loss mask; "
             f"run speculators' prepare_data.py, which writes both")
        names = os.listdir(self.hs_dir)
        busy = {n.removesuffix(".lock") for n in names if n.endswith(".lock")}  # vLLM still writing those
        rows = sorted(int(m.group(1)) for n in names if n not in busy and (m := HS_FILE.fullmatch(n)))
        need(not rows or rows[-1] < len(self.ds), f"{self.hs_dir}/hs_{rows[-1] if rows else 0}.safetensors has no row "
             f"in {data!r} ({len(self.ds)} rows): the hidden states were made from other data")
        self.rows, self.missing = rows, len(self.ds) - len(rows)  # rows vLLM skipped (failed requests) or not yet done
        return [os.path.join(self.hs_dir, f"hs_{r}.safetensors") for r in rows]

    def layout(self, ids):
        from safetensors import safe_open
        f = self.files[0]
        try:
            with safe_open(f, "pt") as h:
                need("hidden_states" in h.keys(), f"{f} has no hidden_states: not a vLLM extract_hidden_states file")
                sl = h.get_slice("hidden_states")
                shape, dtype = sl.get_shape(), sl.get_dtype()
        except DFlashError:
            raise
        except Exception as e:
            raise unreadable(f, e) from None
        L, self.dtype = self.L, SAFETENSORS_DTYPES.get(dtype, dtype)
        need(len(shape) == 3, f"{f}: hidden_states of shape {tuple(shape)}, not (tokens, layers, hidden)")
        need(not self.D or shape[2] == self.D, f"{f}: hidden size {shape[2]}, but the target's is {self.D}: the dump "
             f"was made with another target")
        if L not in ids and shape[1] == len(ids) + 1:  # launch_vllm.py appends L (--include-last-layer, its default)
            ids = ids + [L]
        need(shape[1] == len(ids), f"{f} holds {shape[1]} layers, but {len(ids)} ids were named ({ids}); name those "
             f"vLLM was launched with")
        need(all(0 <= k <= L for k in ids), f"layer ids {ids} lie outside vLLM's 0..{L} for this {L}-layer target")
        self.dump_ids = ids
        # vLLM's id k: the stream entering decoder layer k = our layer k-1 (id 0, the embedding's output, is none of
        # ours); id L enters the final norm: our layer L-1 and, through norm and lm_head, the labels
        return {k - 1: s for s, k in enumerate(ids) if k >= 1}, ids.index(L) if L in ids else None, True

    def tokens(self, i):
        """Row i's tokens from the dataset, and its file's header checked against its size and the row (no hidden
        states read: sample(i) checks the file's token_ids): a truncated file is named before training starts."""
        f, ids = self.files[i], torch.as_tensor(self.ds[self.rows[i]]["input_ids"]).long()
        try:
            shapes = {k: t["shape"] for k, t in safetensors_header(f)[0].items()}
        except (OSError, ValueError) as e:
            raise unreadable(f, e) from None
        S, n = len(ids), len(self.dump_ids)
        want = {"hidden_states": [S, n, self.D], "token_ids": [S]}
        bad = [f"{k} {shapes.get(k, 'missing')}, not {v}" for k, v in want.items() if shapes.get(k) != v]
        need(not bad, f"{f}: {'; '.join(bad)} (row {self.rows[i]} of {self.data!r}: {S} tokens, {n} layer ids); {REDO}")
        return ids

    def read(self, i):
        from safetensors.torch import load_file
        f, row = self.files[i], self.rows[i]
        try:
            t = load_file(f)
        except Exception as e:
            raise unreadable(f, e) from None
        lack = " or ".join(sorted({"hidden_states", "token_ids"} - set(t)))
        need(not lack, f"{f} has no {lack}: not a vLLM extract_hidden_states file; {REDO}")
        rec = self.ds[row]
        ids, mask = torch.as_tensor(rec["input_ids"]).long(), torch.as_tensor(rec["loss_mask"]).bool()
        tok = t["token_ids"].long().flatten()
        same = len(tok) == len(ids) and torch.equal(tok, ids)
        need(same, f"{f}: its token_ids differ from row {row} of {self.data!r} (first at position "
             f"{first_difference(tok, ids)}): the hidden states were made from other data; capture them again")
        stack = t["hidden_states"]
        self.check_stack(f, stack, len(ids), len(self.dump_ids))
        return ids, mask, stack, stack[:, self.final] if self.final is not None else None


def first_difference(a, b):
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class SpecForgeDump(Dump):
    kind = "specforge"

    def list_files(self):
        found = {}
        groups = sorted(os.path.join(self.path, n) for n in os.listdir(self.path) if ROWS_DIR.fullmatch(n))
        for d in [self.path] + groups:
            with os.scandir(d) as it:
                for e in it:
                    if m := CKPT_FILE.fullmatch(e.name):
                        found.setdefault(int(m.group(1)), e.path)  # .ckpt and .ckpt.gz of one sample: either
        self.missing = None  # SpecForge's sample count is not on disk: its capture skips NaN samples unrecorded
        return [found[k] for k in sorted(found)]

    def load(self, f):
        try:
            if f.endswith(".gz"):
                with gzip.open(f, "rb") as g:
                    rec = torch.load(io.BytesIO(g.read()), map_location="cpu", weights_only=True)
            else:
                rec = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # truncated zip or gzip, garbage, or not tensors
            raise unreadable(f, e) from None
        need(isinstance(rec, dict), f"{f} is not a SpecForge record (a dict of tensors); {REDO}")
        lack = " or ".join(sorted({"input_ids", "loss_mask"} - set(rec)))
        need(not lack, f"{f} has no {lack}: DFlash trains on the tokens' loss mask; capture with SpecForge's "
             f"prepare_hidden_states.py, which stores both")
        return rec

    def layout(self, ids):
        rec = self.load(self.files[0])
        if "hidden_states" in rec:  # DFlash, Domino; DSpark adds the final hidden state
            self.feature_key, self.final_key = "hidden_states", "target_last_hidden_states"
            self.record = "dspark" if self.final_key in rec else "dflash"
        else:
            need("aux_hidden_state" in rec, f"{self.files[0]} holds neither hidden_states (DFlash) nor "
                 f"aux_hidden_state (EAGLE3): keys {sorted(rec)}")
            self.feature_key, self.final_key, self.record = "aux_hidden_state", "hidden_state", "eagle3"
        self.dtype, has_final = rec[self.feature_key].dtype, self.final_key in rec
        need(all(0 <= k < self.L for k in ids), f"layer ids {ids} lie outside this {self.L}-layer target's "
             f"0..{self.L - 1}")
        self.dump_ids = ids
        return {k: s for s, k in enumerate(ids)}, -1 if has_final else None, False  # SpecForge's final: after the norm

    def read(self, i):
        f = self.files[i]
        rec = self.load(f)
        need(self.feature_key in rec, f"{f} has no {self.feature_key}, as the dump's first file has; {REDO}")
        ids, mask = rec["input_ids"].long().flatten(), rec["loss_mask"].flatten().bool()
        feats = rec[self.feature_key]
        feats = feats[0] if feats.dim() == 3 and feats.shape[0] == 1 else feats  # (1, S, W) as captured
        n, S = len(self.dump_ids), len(ids)
        need(feats.dim() == 2 and feats.shape[-1] % n == 0, f"{f}: {self.feature_key} of shape "
             f"{tuple(rec[self.feature_key].shape)}, not (1, {S}, {n} x hidden); {REDO}")
        stack = feats.reshape(feats.shape[0], n, -1)
        self.check_stack(f, stack, S, n)
        need(len(mask) == S, f"{f}: loss_mask has {len(mask)} entries for {S} tokens; {REDO}")
        final = None
        if self.final is not None and self.labels:
            need(self.final_key in rec, f"{f} has no {self.final_key}, as the dump's first file has; {REDO}")
            final = rec[self.final_key]
            final = final[0] if final.dim() == 3 else final
            need(tuple(final.shape) == (S, stack.shape[2]), f"{f}: {self.final_key} of shape "
                 f"{tuple(rec[self.final_key].shape)} for {S} tokens; {REDO}")
        # prepare_hidden_states.py captures its batches' padded rows: token 0 without loss on the right, dropped here
        # (no loss term reads them: the loss lies before them, and a block's context before its anchor)
        real = ((ids != 0) | mask).nonzero()
        S = int(real[-1]) + 1 if len(real) else S
        return ids[:S], mask[:S], stack[:S], None if final is None else final[:S]
