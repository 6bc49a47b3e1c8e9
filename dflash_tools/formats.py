"""Data formats beyond JSONL, imported by dflash.read_records only for files of their kind: a JSON array (as many
published ShareGPT sets), gzipped JSONL, Parquet (found by its magic bytes), a directory written by datasets'
save_to_disk; and ShareGPT's {"conversations": [...]} records, read as {"messages": [...]}, and OpenAI's content
parts. pyarrow and datasets are imported only for their formats. A table's row drops its null fields: columns that
only other rows' formats fill."""
import gzip
import hashlib
import importlib
import json
import os
import zlib

from dflash import DFlashError, data_kind, first_line, need, read_jsonl

def optional_package(module, package, why):
    """An optional package's module, or one error line naming the package and the pip command."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DFlashError(f"{why} needs the {package} package: pip install {package}") from None

def check_readable(path, flag, out=None):
    """Before any weights load: a directory must be a save_to_disk one, its format's package installed, and the run's
    --out (out) not inside it (its checkpoints would change the digest a resume compares)."""
    if os.path.isdir(path):
        need(saved_dataset(path), f"{flag} {path!r} is a directory but not one written by datasets' save_to_disk (no "
             f"state.json or dataset_dict.json); pass {flag} with a JSONL (.jsonl, .jsonl.gz) or Parquet file")
        inside = out and os.path.commonpath([os.path.realpath(out), os.path.realpath(path)]) == os.path.realpath(path)
        need(not inside, f"--out {out} is inside {flag} {path}; give an --out outside it")
        optional_package("datasets", "datasets", f"{flag} {path!r} is a datasets.save_to_disk directory: reading it")
    elif data_kind(path) == "Parquet":
        optional_package("pyarrow.parquet", "pyarrow", f"{flag} {path!r} is Parquet: reading it")

def read_records(path, what):
    """Yield (where, record) for each record: "file item i" of a JSON array, "file row i" of Parquet or of a
    save_to_disk directory."""
    if os.path.isdir(path):
        yield from read_saved_dataset(path, what)
        return
    if data_kind(path) == "Parquet":
        yield from read_parquet(path, what)
        return
    if data_kind(path) == "gzipped JSONL":
        try:
            yield from read_jsonl(path, what, opener=gzip.open)
        except (EOFError, zlib.error) as e:  # a truncated or corrupt gzip stream
            raise DFlashError(f"cannot read {what} file {path!r}: {first_line(e)}") from None
        return
    try:
        with open(path, "rb") as f:
            items = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser takes
        raise DFlashError(f"cannot read {what} file {path!r} as a JSON array: {first_line(e)}") from None
    for i, rec in enumerate(items):
        yield f"{path} item {i}", rec

def drop_nulls(x):
    if isinstance(x, dict):
        return {k: drop_nulls(v) for k, v in x.items() if v is not None}
    return [drop_nulls(v) for v in x] if isinstance(x, list) else x

def read_parquet(path, what):
    pq = optional_package("pyarrow.parquet", "pyarrow", f"{what} file {path!r} is Parquet: reading it")
    import pyarrow
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        rows = (row for batch in batches for row in batch.to_pylist())
        for i, row in enumerate(rows):
            yield f"{path} row {i}", drop_nulls(row)
    except (OSError, pyarrow.ArrowException) as e:
        raise DFlashError(f"cannot read {what} file {path!r} as Parquet: {first_line(e)}") from None

def saved_dataset(path):
    """Whether path is a directory written by datasets' save_to_disk (a Dataset's state.json, a DatasetDict's
    dataset_dict.json)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f)) for f in ("state.json",
                                                                                        "dataset_dict.json"))

def read_saved_dataset(path, what):
    """The rows of a datasets.save_to_disk directory: a Dataset, or a DatasetDict's only split (else say which)."""
    need(saved_dataset(path), f"{what} {path!r} is a directory but not one written by datasets' save_to_disk (no "
         f"state.json or dataset_dict.json); pass a JSONL or Parquet file")
    datasets = optional_package("datasets", "datasets", f"{what} {path!r} is a datasets.save_to_disk directory: "
                                f"reading it")
    try:
        ds = datasets.load_from_disk(path)
    except IndexError:  # state.json without data files: datasets says "list index out of range"
        raise DFlashError(f"{what} {path!r} is a save_to_disk directory without its data files (empty, or copied "
                          f"in part); save the data set again, or pass a JSONL or Parquet file") from None
    except Exception as e:  # the library's own errors for a damaged directory
        raise DFlashError(f"cannot read {what} {path!r} with datasets.load_from_disk: {first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        need(len(ds), f"{what} {path!r} is a save_to_disk DatasetDict without any split; save the data set again, or "
             f"pass a JSONL or Parquet file")
        need(len(ds) == 1, f"{what} {path!r} holds the splits {', '.join(ds)}; pass one of them: "
             f"{os.path.join(path, next(iter(ds)))}")
        path, ds = os.path.join(path, next(iter(ds))), next(iter(ds.values()))
    for i, row in enumerate(ds.with_format(None)):  # as lists (speculators' prepare_data.py saves torch format)
        yield f"{path} row {i}", drop_nulls(row)

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool"}

def chat_record(record, where):
    """ShareGPT's {"conversations": [{"from": human | gpt | system | tool, "value": ...}, ...]} (or turns of
    role/content) -> {"messages": [...]}, encoded as any chat; every other record as it is."""
    if not isinstance(record, dict) or "conversations" not in record or "messages" in record:
        return record
    turns = record["conversations"]
    need(isinstance(turns, list) and turns, f"{where}: conversations must be a non-empty list of {{\"from\": ..., "
         f"\"value\": ...}} turns")
    messages = []
    for j, t in enumerate(turns):
        need(isinstance(t, dict), f"{where}: conversations[{j}] is not an object")
        if "role" in t:
            messages.append(t)
            continue
        need(t.get("from") in SHAREGPT_ROLES, f"{where}: conversations[{j}] has from {t.get('from')!r}; expected "
             f"human, gpt, system or tool (or role/content turns)")
        need(isinstance(t.get("value"), str), f"{where}: conversations[{j}] has no string value")
        messages.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return {"messages": messages}

def text_part(content, where):
    """OpenAI's content parts ([{"type": "text", "text": ...}]) as the text of their one text part, else refused."""
    part = content[0] if len(content) == 1 and isinstance(content[0], dict) else {}
    ok = part.get("type") == "text" and isinstance(part.get("text"), str)
    need(ok, f"{where} is not one text part ({json.dumps(content)[:80]}); give it as a string")
    return part["text"]

SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                     "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}  # bytes an entry, by dtype

def safetensors_header(path):
    """({name: {dtype, shape, data_offsets}}, where the data starts) of a safetensors file, from its header alone (no
    tensor read; safetensors' own safe_open copies a whole file in for torch): ValueError where the file is shorter or
    longer than its header says (truncated) or the header is not one."""
    with open(path, "rb") as f:
        size, n = os.fstat(f.fileno()).st_size, int.from_bytes(f.read(8).ljust(8, b"\xff"), "little")
        if not 2 <= n <= size - 8:
            raise ValueError(f"a header of {n:,} bytes in a file of {size:,}: not safetensors, or truncated")
        try:
            header = json.loads(f.read(n))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"its header is not safetensors' ({first_line(e)})") from None
    if 8 + n + end != size:
        raise ValueError(f"{size:,} bytes where its header says {8 + n + end:,}: truncated or appended to")
    return tensors, 8 + n

def dir_digest(path):
    """{size, sha256} of a save_to_disk directory's files (names and bytes, in name order), as dflash records a
    data file's: a resume can tell the data changed."""
    h, size, walked = hashlib.sha256(), 0, []
    for root, dirs, files in os.walk(path):
        walked.append((root, files))
        if "state.json" in files:  # a Dataset's own files: not its folders (speculators' hidden_states/ lie in it)
            dirs.clear()
    for root, files in sorted(walked):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                digest, size = hashlib.file_digest(f, "sha256").hexdigest(), size + os.fstat(f.fileno()).st_size
            h.update(f"{os.path.relpath(os.path.join(root, name), path)}\0{digest}\n".encode())
    return {"size": size, "sha256": h.hexdigest()}
