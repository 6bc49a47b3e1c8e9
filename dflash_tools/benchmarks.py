"""
z-lab's benchmark prompts, built as z-lab's dflash/benchmark.py builds them, for `eval.py --bench`.

    gsm8k      openai/gsm8k "main", test            "{question}" + REASON
    math500    HuggingFaceH4/MATH-500, test         "{problem}" + REASON
    humaneval  openai/openai_humaneval, test        "Write a solution ... tests:\\n```python\\n{prompt}\\n```"
    mbpp       google-research-datasets/mbpp "sanitized", test   "{prompt}"
    mt-bench   HuggingFaceH4/mt_bench_prompts, train              the turns in "prompt", a multi-turn conversation

Each sample is a list of user turns (one, except mt-bench's two). A conversation is run turn by turn: the user turn
is appended, the chat template renders the conversation with the generation prompt, the target answers greedily,
and its decoded answer (special tokens skipped) becomes the assistant turn the next user turn follows. tau is
measured on every assistant turn's continuation. --max_samples N takes, as z-lab's transformers backend does, the
first N after a shuffle seeded with 0 (no shuffle when the dataset has at most N samples): the same subset for
every drafter and every run.

`datasets` is needed only to download; a directory of local files (NAME.jsonl, one row per line in the dataset's
own schema, or NAME.json holding a list of rows) works offline. Imports nothing of the project (eval.py imports
it): errors are BenchmarkError, which eval.py reports as one line.
"""

import gzip
import json
import os
import random
import zlib

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"

# name -> (load_dataset arguments, split, the fields a row must have, row -> list of user turns)
BENCHMARKS = {
    "gsm8k": (("openai/gsm8k", "main"), "test", ("question",), lambda r: [r["question"] + REASON]),
    "math500": (("HuggingFaceH4/MATH-500",), "test", ("problem",), lambda r: [r["problem"] + REASON]),
    "humaneval": (("openai/openai_humaneval",), "test", ("prompt",), lambda r: [HUMANEVAL.format(r["prompt"])]),
    "mbpp": (("google-research-datasets/mbpp", "sanitized"), "test", ("prompt",), lambda r: [r["prompt"]]),
    "mt-bench": (("HuggingFaceH4/mt_bench_prompts",), "train", ("prompt",), lambda r: list(r["prompt"])),
}
SUBSET_SEED = 0


class BenchmarkError(ValueError):
    """Bad benchmark input; eval.py turns it into one `error:` line."""


def parse_bench(spec):
    """"gsm8k,mt-bench" or "gsm8k=path/to/file.jsonl,..." -> [(name, local file or None)], checked."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        name, _, path = item.partition("=")
        if name not in BENCHMARKS:
            raise BenchmarkError(f"--bench: unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
        if name in (n for n, _ in out):
            raise BenchmarkError(f"--bench: {name} is named twice")
        out.append((name, path or None))
    return out


def read_local(path):
    """Rows of a local file: JSONL (one object per line) or JSON (a list of objects), either of them gzip-compressed
    (as HumanEval.jsonl.gz is published; found by its magic bytes)."""
    if not os.path.isfile(path):
        raise BenchmarkError(f"benchmark file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:  # a truncated gzip, a binary file
        why = str(e).strip().splitlines()[0][:100] if str(e).strip() else type(e).__name__
        raise BenchmarkError(f"{path}: not a JSONL/JSON text file, plain or gzip ({why})") from None
    try:
        if path.removesuffix(".gz").endswith(".json"):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise BenchmarkError(f"{path}: not valid JSON{'' if path.removesuffix('.gz').endswith('.json') else 'L'} "
                             f"({e})") from None
    if not isinstance(rows, list) or not rows:
        raise BenchmarkError(f"{path}: expected a non-empty list of rows")
    return rows


def load_rows(name, path=None, bench_dir=None):
    """The rows of one benchmark: from `path`, from bench_dir/NAME.jsonl (or .json), else through
    datasets.load_dataset (downloads on first use)."""
    if path is None and bench_dir is not None:
        path = next((p for p in (os.path.join(bench_dir, f"{name}.{e}") for e in ("jsonl", "json"))
                     if os.path.isfile(p)), None)
        if path is None:
            raise BenchmarkError(f"--bench_dir {bench_dir!r} has no {name}.jsonl or {name}.json")
    if path is not None:
        return read_local(path)
    args, split = BENCHMARKS[name][:2]
    try:
        from datasets import load_dataset
    except ImportError:
        raise BenchmarkError(f"--bench {name} needs the datasets package to download {args[0]}: pip install "
                             f"datasets (or pass --bench_dir with {name}.jsonl saved from its {split} split)") from None
    try:
        return [dict(r) for r in load_dataset(*args, split=split)]
    except Exception as e:  # offline, no such dataset, ...: one line, with what to do instead
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise BenchmarkError(f"--bench {name}: could not load {args[0]} through datasets ({why}); when offline, "
                             f"save its {split} split as {name}.jsonl and pass --bench_dir") from None


def conversations(name, rows, where=None):
    """Rows -> one list of user turns per sample, each row checked for its dataset's fields."""
    fields, to_turns = BENCHMARKS[name][2:]
    where = where or name
    out = []
    for i, r in enumerate(rows):
        missing = [f for f in fields if not isinstance(r, dict) or f not in r]
        if missing:
            got = sorted(r) if isinstance(r, dict) else type(r).__name__
            raise BenchmarkError(f"{where} row {i}: no field {missing[0]!r} (a {name} row has "
                                 f"{', '.join(fields)}); got {got}")
        v, multi = r[fields[0]], name == "mt-bench"
        if not (isinstance(v, list) and v and all(isinstance(t, str) and t for t in v) if multi else
                isinstance(v, str) and v):
            what = "a list of non-empty strings" if multi else "a non-empty string"
            raise BenchmarkError(f"{where} row {i}: {fields[0]!r} must be {what}")
        out.append(to_turns(r))
    return out


def subset(samples, max_samples):
    """The first max_samples after a shuffle seeded with SUBSET_SEED (all of them, in order, when there are fewer)."""
    if max_samples is None or len(samples) <= max_samples:
        return list(samples)
    samples = list(samples)
    random.Random(SUBSET_SEED).shuffle(samples)
    return samples[:max_samples]


def run_conversation(turns, render, generate, decode):
    """One sample's (prompt ids, continuation) per assistant turn. render(messages) -> prompt ids (the chat template
    with the generation prompt); generate(prompt ids) -> the target's greedy continuation; decode(ids) -> the text
    the next turn's conversation carries as the assistant's answer."""
    messages, out = [], []
    for user in turns:
        messages.append({"role": "user", "content": user})
        prompt = render(messages)
        continuation = generate(prompt)
        out.append((prompt, continuation))
        messages.append({"role": "assistant", "content": decode(continuation)})
    return out
