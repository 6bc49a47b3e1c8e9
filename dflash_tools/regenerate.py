"""
Regenerate training data with the target: every assistant turn becomes the target's own answer (the paper's recipe).

    vllm serve Qwen/Qwen3.6-27B --port 8000          # or SGLang, or `transformers serve`: any OpenAI-style server
    python -m dflash_tools.regenerate --server http://127.0.0.1:8000/v1 --model Qwen/Qwen3.6-27B \
        --data prompts.jsonl --out train.jsonl --no-enable_thinking --concurrency 64
    python dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl --no-enable_thinking ...

Input: the JSONL forms dflash.py trains on ({"messages": [...]}, {"prompt", "response"}, {"prompt"} alone). Output:
{"messages": [...], "source_line": N, "enable_thinking": ...} lines, N the input line. A conversation is regenerated
turn by turn, each assistant turn given the earlier turns as the target answered them; user and system turns are
kept, and a conversation that ends with a user turn gets an answer to it.

Why /v1/completions by default: the prefix is rendered here with the target's own chat template and the answer
comes back as generated. Chat endpoints may rewrite it (strip leading/trailing whitespace, losing a code answer's
indentation; move a think block into reasoning_content), so --endpoint chat is only the fallback.

Lossless and resumable: each finished sample is one whole, flushed line, in input order; rerunning the same command
skips the samples already there, drops a torn last line left by a crash, and appends the rest, so an interrupted
and resumed run writes the same file as an uninterrupted one. SIGTERM / Ctrl-C stop after the requests in flight.
Beside OUT: OUT.truncated.jsonl lists the samples dropped because an answer hit --max_tokens (skipped on a rerun too),
OUT.failed.jsonl the ones the server refused in the latest run, with its error (tried again on a rerun).
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException

from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this folder's scripts import dflash.py from the repository root

import dflash  # noqa: E402

BACKOFF_S = 1.0  # first retry wait; doubled each retry up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
RETRY_STATUS = {429, 500, 502, 503, 504}  # overloaded or restarting: worth another try


class HTTPFailure(Exception):
    """The server answered with an error status; `reason` is what it said (or that it said nothing)."""

    def __init__(self, status, reason):
        super().__init__(f"HTTP {status}: {reason}")
        self.status, self.reason = status, reason


class Unreachable(Exception):
    """No answer at all (connection refused or reset, timeout) after every retry."""


# -----------------------------------------------------------------------------
# HTTP: one JSON POST, retried with backoff on what a busy or restarting server does


def error_reason(body):
    """What an error body says: the detail / message fields of a JSON body, else its first line."""
    try:
        d = json.loads(body)
    except ValueError:
        return (body.strip().splitlines() or ["(empty body)"])[0][:300]
    if isinstance(d, dict):
        err = d.get("error")
        for v in (d.get("detail"), err.get("message") if isinstance(err, dict) else err, d.get("message")):
            if v:
                return str(v)[:300]
    return body.strip()[:300]


def http_json(url, payload=None, timeout=60.0, retries=0, stop=None):
    """POST payload (GET when None) as JSON; the decoded answer. Connection errors, timeouts, 429 and 5xx are retried
    `retries` times with exponential backoff (not once stop is set); other statuses raise HTTPFailure at once."""
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            failure = HTTPFailure(e.code, error_reason(e.read().decode("utf-8", "replace")))
            if e.code not in RETRY_STATUS:
                raise failure from None
        except (urllib.error.URLError, HTTPException, ConnectionError, socket.timeout, TimeoutError) as e:
            failure = Unreachable(str(getattr(e, "reason", None) or e) or type(e).__name__)
        if attempt == retries or (stop is not None and stop.requested):
            raise failure
        time.sleep(min(BACKOFF_S * 2 ** attempt, BACKOFF_MAX_S))


# -----------------------------------------------------------------------------
# One sample: the conversation to regenerate, and the requests that regenerate it


def conversation(record, where):
    """The turns of one input record, assistant turns to be replaced; a trailing user turn gets an answer."""
    if not isinstance(record, dict):
        raise dflash.DFlashError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
            raise dflash.DFlashError(f"{where}: messages must be a non-empty list of {{\"role\": ..., \"content\": "
                                     f"...}} objects")
        turns = list(messages)
    elif isinstance(record.get("prompt"), str):
        turns = [{"role": "user", "content": record["prompt"]}]  # a response, if any, is replaced
    else:
        raise dflash.DFlashError(f"{where}: nothing to regenerate: expected {{\"messages\": [...]}} or a string "
                                 f"\"prompt\" (got keys {sorted(record)})")
    if turns[-1]["role"] != "assistant":
        turns.append({"role": "assistant"})
    return turns


class Server:
    """How answers are asked for: the prompt text rendered here (completions) or the messages sent (chat)."""

    def __init__(self, args, tokenizer):
        self.args, self.tokenizer = args, tokenizer
        self.url = args.server.rstrip("/") + ("/completions" if args.endpoint == "completions" else
                                              "/chat/completions")
        self.kw = dflash.template_kwargs(tokenizer, args.enable_thinking) if tokenizer is not None else {}
        # the server tokenizes the prompt with special tokens (a BOS) added; the template's own BOS would double it
        bos = getattr(tokenizer, "bos_token", None)
        self.strip_bos = bool(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]

    def prompt(self, turns):
        text = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **self.kw)
        return text[len(self.tokenizer.bos_token):] if self.strip_bos and text.startswith(
            self.tokenizer.bos_token) else text

    def payload(self, turns, max_tokens):
        a = self.args
        body = {"model": a.model, "max_tokens": max_tokens, "temperature": a.temperature}  # 0 sent, never implied
        if a.top_p is not None:
            body["top_p"] = a.top_p
        if a.endpoint == "completions":
            body["prompt"] = self.prompt(turns)
        else:
            body["messages"] = turns
            if a.enable_thinking is not None:
                body["chat_template_kwargs"] = {"enable_thinking": a.enable_thinking}
        return body

    def answer(self, turns, stop):
        """(text, finish_reason, prompt_tokens, generated_tokens) of the next assistant turn after `turns`."""
        r = http_json(self.url, self.payload(turns, self.args.max_tokens), self.args.timeout, self.args.retries,
                      stop)
        choice, usage = r["choices"][0], r.get("usage") or {}
        if self.args.endpoint == "completions":
            text = choice["text"]
        else:  # put a reasoning parser's think block back where the target generated it
            message = choice["message"]
            text = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning")
            if reasoning:
                text = f"<think>\n{reasoning}\n</think>\n\n{text}"
        return text, choice.get("finish_reason"), usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)


def regenerate(server, line, turns, stop):
    """Regenerate one conversation turn by turn: (kind, record, stats), kind "done" | "truncated" | "failed" (record
    for the file of that kind) or "stopped" (None). A turn cut by --max_tokens ends the sample unless
    --keep_truncated, and only its line number is kept, so that a rerun does not ask for it again."""
    stats, out, truncated = [0, 0], [], False
    mark = {"source_line": line, "enable_thinking": server.args.enable_thinking}
    for m in turns:
        if m["role"] != "assistant":
            out.append(m)
            continue
        if stop.requested:
            return "stopped", None, stats
        try:
            text, finish, p, g = server.answer(out, stop)
        except HTTPFailure as e:
            return "failed", {"source_line": line, "error": f"HTTP {e.status}: {e.reason}"}, stats
        except Unreachable as e:
            stop.fatal = f"the server at {server.args.server} stopped answering ({e}) after {server.args.retries} " \
                         f"retries; rerun the same command to continue"
            stop.requested = True
            return "stopped", None, stats
        except Exception as e:  # the chat template fails on this conversation: a problem of this sample only
            return "failed", {"source_line": line, "error": f"{type(e).__name__}: {e}"}, stats
        stats[0], stats[1] = stats[0] + p, stats[1] + g
        out.append({"role": "assistant", "content": text})
        if finish == "length":
            truncated = True
            if not server.args.keep_truncated:
                return "truncated", {**mark, "truncated_turn": len(out) - 1}, stats
    return ("truncated" if truncated else "done"), {"messages": out, **mark, **({"truncated": True} if truncated
                                                                                else {})}, stats


# -----------------------------------------------------------------------------
# Before the first request: the input, the output file (and what it holds already), the server


def read_input(path):
    """[(line number, turns)] of the whole input file, every line checked first: a bad line is an error before any
    request is sent."""
    return [(int(where.rsplit(":", 1)[1]), conversation(rec, where))
            for where, rec in dflash.read_jsonl(path, "data", "; pass --data with a JSONL file")]


def finished_lines(path, enable_thinking):
    """The input lines already in the file at `path` (the output, or the list of dropped truncated samples), after
    cutting a torn last line (a crash mid-write) off it. Opening it first checks that it can be written."""
    if os.path.isdir(path):
        raise dflash.DFlashError(f"--out {path!r} is a directory; give a file path")
    try:
        with open(path, "ab"):  # creates it: a path that cannot be written fails here, before any request
            pass
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise dflash.DFlashError(f"--out {path!r} cannot be written: {e.strerror}") from None
    whole = data[:data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with open(path, "r+b") as f:
            f.truncate(len(whole))
        print(f"{path}: dropped a torn last line ({len(data) - len(whole)} bytes) left by an interrupted run",
              file=sys.stderr)
    done = set()
    for lineno, line in enumerate(whole.splitlines(), 1):
        try:
            rec = json.loads(line)
            n = rec["source_line"]
        except (ValueError, KeyError, TypeError):
            raise dflash.DFlashError(f"{path}:{lineno}: not a line this tool writes; give another --out") from None
        if rec.get("enable_thinking") != enable_thinking:
            raise dflash.DFlashError(f"{path}:{lineno}: written with enable_thinking={rec.get('enable_thinking')}, "
                                     f"not {enable_thinking}; resume with the same flags or give another --out")
        done.add(n)
    return done


def load_tokenizer(args):
    if args.endpoint == "chat" and args.tokenizer is None:
        name = args.model  # optional here: it only helps explain a bare 500
    else:
        name = args.tokenizer or args.model
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except Exception as e:
        if args.endpoint == "chat":
            return None
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise dflash.DFlashError(f"cannot load the tokenizer {name!r} ({why}); pass --tokenizer with the target's "
                                 f"tokenizer (a local directory or hub id)") from None
    if args.endpoint == "completions" and not getattr(tokenizer, "chat_template", None):
        raise dflash.DFlashError(f"the tokenizer {name!r} has no chat template, which renders each prefix; pass "
                                 f"--tokenizer with one that has")
    return tokenizer


def check_server(server, args, stop):
    """One small request before the run, so a wrong URL, a model the server does not serve or a failing endpoint is
    one error line; a bare 500 (transformers serve for an unknown model or a missing chat template) is explained."""
    turns = [{"role": "user", "content": "Hello"}]
    try:
        http_json(server.url, server.payload(turns, 1), args.timeout, 0, stop)
    except Unreachable as e:
        raise dflash.DFlashError(f"cannot reach the server at {args.server} ({e}); is it running, and is --server "
                                 f"its OpenAI base URL (e.g. http://127.0.0.1:8000/v1)?") from None
    except HTTPFailure as e:
        if e.status == 404:
            raise dflash.DFlashError(f"{server.url} answered 404 ({e.reason}): is --server the OpenAI base URL "
                                     f"(ending in /v1)? A server without /v1/completions needs --endpoint chat") \
                from None
        if e.status >= 500:
            raise dflash.DFlashError(f"{server.url} answered HTTP {e.status} ({e.reason}) for model "
                                     f"{args.model!r}: {explain_500(server, args)}") from None
        raise dflash.DFlashError(f"{server.url} refused a request for model {args.model!r}: HTTP {e.status}: "
                                 f"{e.reason}") from None


def explain_500(server, args):
    """A server error that says nothing: look for the reason where it can be seen from here."""
    try:
        listed = [m.get("id") for m in http_json(args.server.rstrip("/") + "/models", None, args.timeout)["data"]]
    except Exception:
        listed = None
    if listed is not None and args.model not in listed:
        return f"the server does not list it among its models ({', '.join(map(str, listed)) or 'none'}); check --model"
    if args.endpoint == "chat" and server.tokenizer is not None and not server.tokenizer.chat_template:
        return ("its tokenizer has no chat template, which the chat endpoint needs; add one, or use the default "
                "--endpoint completions with --tokenizer")
    return "the server gave no reason; see its log"


# -----------------------------------------------------------------------------
# The run


class Stop:
    """SIGTERM / SIGINT: send no new requests, finish the ones in flight, write what is finished; a second signal
    kills. `fatal` says why a run stopped on its own (the server went away)."""

    def __init__(self):
        self.requested, self.fatal = False, None
        self.previous = {s: signal.signal(s, self._handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handler(self, signum, frame):
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)


def run(args):
    samples = read_input(args.data)
    paths = {"done": args.out, "truncated": args.out if args.keep_truncated else args.out + ".truncated.jsonl",
             "failed": args.out + ".failed.jsonl"}
    done = finished_lines(paths["done"], args.enable_thinking) | finished_lines(paths["truncated"],
                                                                               args.enable_thinking)
    todo = [(n, turns) for n, turns in samples if n not in done]
    if os.path.exists(paths["failed"]):
        os.remove(paths["failed"])  # it lists the failures of the latest run; the earlier ones are tried again
    tokenizer = load_tokenizer(args)
    stop = Stop()
    try:
        server = Server(args, tokenizer)
        if todo:
            check_server(server, args, stop)
        if args.endpoint == "chat":
            print("warning: --endpoint chat: the server may normalise the answers' whitespace (a code answer's "
                  "indentation), and a reasoning parser's think block is put back as <think>\\n...\\n</think>\\n\\n "
                  "here; prefer /v1/completions", file=sys.stderr)
        summary = generate_all(server, todo, args, stop, paths)
    finally:
        stop.restore()
    summary["skipped_done"] = len(samples) - len(todo)
    failed = f" (see {paths['failed']})" if summary["failed"] else ""
    print(f"regenerate: {summary['written']} written, {summary['skipped_done']} skipped as done, "
          f"{summary['failed']} failed{failed}, "
          f"{summary['truncated']} truncated ({'kept' if args.keep_truncated else 'dropped'}), "
          f"{summary['prompt_tokens']} prompt and {summary['generated_tokens']} generated tokens, "
          f"{summary['wall_s']:.1f} s ({summary['generated_tokens'] / max(summary['wall_s'], 1e-9):.1f} generated "
          f"tokens/s){'; stopped early: rerun the same command to continue' if summary['stopped'] else ''}")
    if stop.fatal:
        raise dflash.DFlashError(stop.fatal)
    return summary


def generate_all(server, todo, args, stop, paths):
    """Keep `concurrency` requests in flight; append each result, in input order, as one whole flushed line to the
    file of its kind."""
    s = dict(written=0, failed=0, truncated=0, prompt_tokens=0, generated_tokens=0, stopped=False)
    t0 = time.time()
    bar = tqdm(total=len(todo), unit="sample", disable=not todo, dynamic_ncols=True)
    pending = deque()  # futures in input order; a few more than the workers so none waits for the oldest
    queue = iter(todo)
    files = {}
    with ThreadPoolExecutor(args.concurrency) as pool:
        def fill():
            while not stop.requested and len(pending) < 4 * args.concurrency:
                item = next(queue, None)
                if item is None:
                    return
                pending.append(pool.submit(regenerate, server, *item, stop))

        fill()
        gap = False  # after a sample that was not finished, nothing more is written: the files stay in input order
        while pending:
            kind, record, (p, g) = pending.popleft().result()
            s["prompt_tokens"] += p
            s["generated_tokens"] += g
            if kind == "stopped":
                gap = s["stopped"] = True
            elif not gap:
                s["written"] += paths[kind] == args.out
                if kind != "done":
                    s[kind] += 1
                if paths[kind] not in files:
                    files[paths[kind]] = open(paths[kind], "a", encoding="utf-8")
                f = files[paths[kind]]
                f.write(json.dumps(record, ensure_ascii=False) + "\n")  # one write: a crash tears only this line
                f.flush()
                bar.update(1)
                bar.set_postfix_str(f"{s['generated_tokens'] / max(time.time() - t0, 1e-9):.1f} gen tok/s",
                                    refresh=False)
            fill()
        s["stopped"] = s["stopped"] or next(queue, None) is not None  # stopped before sending them all
    for f in files.values():
        f.close()
    bar.close()
    s["wall_s"] = time.time() - t0
    return s


def get_parser():
    p = dflash.ArgumentParser(description="Regenerate every assistant turn of a JSONL data set with the target, "
                                          "through an OpenAI-compatible server (vLLM, SGLang, transformers serve).")
    flag = dflash.flag
    flag(p, "--server", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1", required=True)
    flag(p, "--model", help="the model name the server serves (also the default --tokenizer)", required=True)
    flag(p, "--data", help="input JSONL: messages | prompt+response | prompt per line", required=True)
    flag(p, "--out", help="output JSONL of {\"messages\": [...]} lines (appended to: reruns resume)", required=True)
    flag(p, "--tokenizer", None, "the target's tokenizer, whose chat template renders each prefix: a local directory "
         "or hub id (default: --model)")
    flag(p, "--endpoint", "completions", "completions: the prefix rendered here, the answer as generated; chat: for "
         "servers without completions (whitespace may be normalised)", choices=["completions", "chat"])
    flag(p, "--enable_thinking", None, "passed to the chat template and recorded in each line; train and serve with "
         "the same (default: the template's own)", action=argparse.BooleanOptionalAction)
    flag(p, "--max_tokens", 2048, "the longest answer, in tokens, sent with every request", int, lo=1)
    flag(p, "--temperature", 0.0, "sampling temperature, always sent (0: greedy)", float, lo=0)
    flag(p, "--top_p", None, "nucleus sampling, sent when given", float, lo=0, hi=1, open_lo=True)
    flag(p, "--keep_truncated", False, "keep answers cut by --max_tokens, marked \"truncated\" (default: count them "
         "and list their line numbers in OUT.truncated.jsonl, which a rerun skips)", action="store_true")
    flag(p, "--concurrency", 16, "requests in flight", int, lo=1)
    flag(p, "--timeout", 600.0, "seconds to wait for one answer", float, lo=0, open_lo=True)
    flag(p, "--retries", 5, "retries of a request on connection errors, timeouts and 5xx (with backoff)", int, lo=0)
    flag(p, "--trust_remote_code", False, "allow the tokenizer's custom code", action="store_true")
    flag(p, "--debug", False, "show tracebacks for input errors (or DFLASH_DEBUG=1)", action="store_true")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    return dflash.run_main(run, args)


if __name__ == "__main__":
    main()
