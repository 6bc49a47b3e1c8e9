"""
Regenerate training data with the target: every assistant turn becomes the target's own answer (the paper's recipe).

    vllm serve Qwen/Qwen3.6-27B --port 8000          # or SGLang, or `transformers serve`: any OpenAI-style server
    python -m dflash_tools.regenerate --server http://127.0.0.1:8000/v1 --model Qwen/Qwen3.6-27B \
        --data prompts.jsonl --out train.jsonl --no-enable_thinking --concurrency 64
    python dflash.py --target Qwen/Qwen3.6-27B --data train.jsonl --no-enable_thinking ...

Input: the JSONL forms dflash.py trains on ({"messages": [...]}, {"prompt", "response"}, {"prompt"} alone). Output:
{"key": K, "messages": [...], "source_line": N, "enable_thinking": ...} lines, N the input line and K the sample's
key (a hash of its turns but the old answers). A conversation is regenerated turn by turn, each assistant turn given
the earlier turns as the target answered them; user and system turns are kept, and a conversation that ends with a
user turn gets an answer to it.

Why /v1/completions by default: the prefix is rendered here with the target's own chat template and the answer
comes back as generated. Chat endpoints may rewrite it (strip leading/trailing whitespace, losing a code answer's
indentation; move a think block into reasoning_content), so --endpoint chat is only the fallback.

Lossless and resumable: each finished sample is one whole, flushed line; rerunning the same command regenerates
exactly the samples whose key is not in OUT yet (whatever was inserted, removed or reordered in the input), drops a
torn last line left by a crash, and appends the rest, so an interrupted and resumed run writes the same file as an
uninterrupted one. One run writes OUT at a time (OUT.lock, naming its pid), and a file this tool did not write is
refused untouched. SIGTERM / Ctrl-C stop after the requests in flight. Beside OUT: OUT.truncated.jsonl lists the
samples dropped because an answer hit --max_tokens (skipped on a rerun unless --retry_truncated or a larger
--max_tokens), OUT.failed.jsonl the ones that failed in the latest run, with the reason (tried again on a rerun).

Every reply is checked where it enters: an error status is retried (429 / 5xx, after the server's Retry-After when
it gives one) or recorded as failed; a success that is not a UTF-8 JSON completion with a string text is recorded
as failed with what it was, never written as an answer; --timeout bounds each request as a whole. A run in which
every sample failed ends in an error.
"""

import argparse
import email.utils
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection, HTTPException, HTTPSConnection

from tqdm.auto import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this folder's scripts import dflash.py from the repository root

import dflash  # noqa: E402

BACKOFF_S = 1.0  # first retry wait; doubled each retry up to BACKOFF_MAX_S
BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 300.0  # a server's Retry-After is honoured up to this
RETRY_STATUS = {429, 500, 502, 503, 504}  # overloaded or restarting: worth another try
TIMEOUT_MAX_S = 7 * 86400.0  # --timeout's upper bound (socket and timer limits are far above it)


class HTTPFailure(Exception):
    """The server answered with an error status; `reason` is what it said (or that it said nothing)."""

    def __init__(self, status, reason):
        super().__init__(f"HTTP {status}: {reason}")
        self.status, self.reason = status, reason


class BadReply(Exception):
    """The server answered with a success status, but not with a completion (not UTF-8, not JSON, a field missing
    or of the wrong type, text UTF-8 cannot hold): never written as an answer."""


class Unreachable(Exception):
    """No answer at all (connection refused or reset, timeout) after every retry."""


# -----------------------------------------------------------------------------
# HTTP: one JSON POST, bounded as a whole, retried with backoff on what a busy or restarting server does


def is_url(s):
    """An http(s) URL with a host, and a port (when given) that is a number in range."""
    u = urllib.parse.urlsplit(s)
    try:
        u.port  # noqa: B018  (raises on a port that is not a number or out of range)
    except ValueError:
        return False
    return u.scheme in ("http", "https") and bool(u.hostname)


def server_url(s):
    """--server: an http(s) URL with a host; anything else is one error line, with the URL it may have meant."""
    if is_url(s.strip()):
        return s.strip()
    guess = "http://" + s.strip().split("://")[-1].lstrip("/")
    raise argparse.ArgumentTypeError(f"{s!r} is not an http(s) URL; give the server's OpenAI base URL, e.g. "
                                     f"{guess if is_url(guess) else 'http://127.0.0.1:8000/v1'}")


def exchange(url, data, timeout):
    """One HTTP request bounded as a whole by `timeout` seconds (connecting, the headers and the body: a server that
    trickles bytes cannot hold it longer): (status, {header: value} lower-cased, body bytes). POST data, GET when
    None. TimeoutError past the deadline; OSError / HTTPException when the connection fails."""
    u = urllib.parse.urlsplit(url)
    conn = (HTTPSConnection if u.scheme == "https" else HTTPConnection)(u.hostname, u.port, timeout=timeout)
    expired = threading.Event()

    def cut():  # at the deadline: shutting the socket wakes a read blocked on it
        expired.set()
        if conn.sock is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(timeout, cut)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if expired.is_set():  # the deadline passed while connecting, before there was a socket to cut
            raise TimeoutError()
        conn.request("GET" if data is None else "POST", (u.path or "/") + (f"?{u.query}" if u.query else ""),
                     body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        body = r.read()
        if expired.is_set():
            raise TimeoutError()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, body
    except (OSError, HTTPException):
        if expired.is_set():
            raise TimeoutError(f"timed out: no whole answer within --timeout {timeout:g} s") from None
        raise
    finally:
        watchdog.cancel()
        conn.close()


def error_reason(body):
    """What an error body says: the detail / message fields of a JSON body, else its first line."""
    body = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
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


def decode_reply(body):
    """A success body as the JSON object it must be; BadReply saying what it is instead."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadReply(f"the reply is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        d = json.loads(text)
    except ValueError:
        raise BadReply(f"the reply is not JSON: {text.strip()[:80]!r}") from None
    if not isinstance(d, dict):
        raise BadReply(f"the reply is a JSON {type(d).__name__}, not an object")
    return d


def retry_after(value):
    """Seconds a Retry-After header asks for (a number of seconds or an HTTP date), at most RETRY_AFTER_MAX_S; 0
    when absent or unreadable."""
    if not value:
        return 0.0
    try:
        s = float(value)
    except ValueError:
        try:
            s = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return 0.0
    return min(max(s, 0.0), RETRY_AFTER_MAX_S) if s == s else 0.0  # s == s: not nan


def pause(seconds, stop):
    """Sleep, waking early once a stop is requested."""
    end = time.monotonic() + seconds
    while not (stop is not None and stop.requested) and time.monotonic() < end:
        time.sleep(min(0.05, max(end - time.monotonic(), 0)))


def http_json(url, payload=None, timeout=60.0, retries=0, stop=None):
    """POST payload (GET when None) as JSON; the decoded reply object. Connection errors, timeouts, 429 and 5xx are
    retried `retries` times with exponential backoff, or after the Retry-After the server asks for (bounded; not
    once stop is set); other statuses raise HTTPFailure at once, a success body that is no JSON object BadReply."""
    data = None if payload is None else json.dumps(payload).encode()
    for attempt in range(retries + 1):
        wait = min(BACKOFF_S * 2 ** min(attempt, 30), BACKOFF_MAX_S)
        try:
            status, headers, body = exchange(url, data, timeout)
            if 200 <= status < 300:
                return decode_reply(body)
            reason = error_reason(body)
            if 300 <= status < 400:
                reason = f"redirected to {headers.get('location', '(no Location)')}; pass that URL as --server"
            failure = HTTPFailure(status, reason)
            if status not in RETRY_STATUS:
                raise failure
            wait = max(wait, retry_after(headers.get("retry-after")))
        except (HTTPException, OSError) as e:  # refused, reset, cut mid-reply, timed out
            failure = Unreachable(str(e) or type(e).__name__)
        if attempt == retries or (stop is not None and stop.requested):
            raise failure
        pause(wait, stop)


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
        return (*read_choice(r, self.args.endpoint), *read_usage(r))


def what(v):
    """A JSON value's kind, for an error: null, a number, a list, ..."""
    return {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def encodable(text, where):
    """`text` as it is when UTF-8 can hold it (a lone surrogate, which JSON's \\ud800 escapes can carry, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadReply(f"{where} holds {text[e.start]!r}, a lone surrogate UTF-8 cannot encode") from None
    return text


def read_choice(r, endpoint):
    """(text, finish_reason) of a reply's first choice, every field it needs checked: BadReply naming the one that
    is missing or of the wrong type (a null text is not an empty answer)."""
    choices = r.get("choices")
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
        said = f"; it says: {error_reason(json.dumps(r))}" if "error" in r or "detail" in r else \
            f"; its keys: {sorted(r)}" if "choices" not in r else ""
        got = "none" if choices is None else "an empty list" if choices == [] else what(choices)
        raise BadReply(f"the reply has no choices ({got}{said})")
    choice = choices[0]
    if endpoint == "completions":
        text = choice.get("text")
        if not isinstance(text, str):
            raise BadReply(f"choices[0].text is {what(text)}, not a string")
    else:  # put a reasoning parser's think block back where the target generated it
        message = choice.get("message")
        if not isinstance(message, dict):
            raise BadReply(f"choices[0].message is {what(message)}, not an object")
        text, reasoning = message.get("content"), message.get("reasoning_content") or message.get("reasoning")
        for name, v in (("content", text), ("reasoning_content", reasoning)):
            if v is not None and not isinstance(v, str):
                raise BadReply(f"choices[0].message.{name} is {what(v)}, not a string")
        if text is None and not reasoning:
            raise BadReply("choices[0].message has no content")
        text = text or ""
        if reasoning:
            text = f"<think>\n{reasoning}\n</think>\n\n{text}"
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise BadReply(f"choices[0].finish_reason is {what(finish)}, not a string")
    return encodable(text, "the answer"), finish


def read_usage(r):
    """(prompt_tokens, completion_tokens): only counted for the summary, so a count that is missing or not a
    non-negative integer counts 0."""
    usage = r.get("usage") if isinstance(r.get("usage"), dict) else {}
    count = lambda v: v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0  # noqa: E731
    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


def regenerate(server, line, key, turns, stop):
    """Regenerate one conversation turn by turn: (kind, record, stats), kind "done" | "truncated" | "failed" (record
    for the file of that kind) or "stopped" (None). A turn cut by --max_tokens ends the sample unless
    --keep_truncated, and only its key is kept (with the --max_tokens that cut it), so that a rerun does not ask
    for it again unless told to (--retry_truncated, or a larger --max_tokens)."""
    stats, out, truncated = [0, 0], [], False
    mark = {"key": key, "source_line": line, "enable_thinking": server.args.enable_thinking}
    for m in turns:
        if m["role"] != "assistant":
            out.append(m)
            continue
        if stop.requested:
            return "stopped", None, stats
        try:
            text, finish, p, g = server.answer(out, stop)
        except HTTPFailure as e:
            return "failed", {"key": key, "source_line": line, "error": f"HTTP {e.status}: {e.reason}"}, stats
        except BadReply as e:
            return "failed", {"key": key, "source_line": line, "error": f"bad reply: {e}"}, stats
        except Unreachable as e:
            stop.fatal = f"the server at {server.args.server} stopped answering ({e}) after {server.args.retries} " \
                         f"retries; rerun the same command to continue"
            stop.requested = True
            return "stopped", None, stats
        except Exception as e:  # the chat template fails on this conversation: a problem of this sample only
            return "failed", {"key": key, "source_line": line, "error": f"{type(e).__name__}: {e}"}, stats
        stats[0], stats[1] = stats[0] + p, stats[1] + g
        out.append({"role": "assistant", "content": text})
        if finish == "length":
            truncated = True
            if not server.args.keep_truncated:
                return "truncated", {**mark, "truncated_turn": len(out) - 1,
                                     "max_tokens": server.args.max_tokens}, stats
    head, tail = {"key": key}, {k: v for k, v in mark.items() if k != "key"}
    return ("truncated" if truncated else "done"), {**head, "messages": out, **tail,
                                                    **({"truncated": True} if truncated else {})}, stats


# -----------------------------------------------------------------------------
# Before the first request: the input, the output file (and what it holds already), the server


def read_input(path):
    """[(line number, turns)] of the whole input, every record checked first: a bad one is an error before any
    request is sent. Any format dflash.py trains on (dflash.read_records: JSONL, a JSON array, Parquet, a
    save_to_disk directory; ShareGPT conversations as messages); a table's "line" is its row number."""
    return [(int(where.rsplit(" ", 1)[-1].rsplit(":", 1)[-1]), conversation(dflash.chat_record(rec, where), where))
            for where, rec in dflash.read_records(path, "data", "; pass --data with a JSONL or Parquet file or a "
                                                  "save_to_disk directory")]


def keyed(samples, data):
    """[(line, key, turns)]: each sample's key, what resume goes by. The key is a hash of what the regeneration
    depends on (every turn but the old assistant answers' content), with the occurrence number appended to a repeat,
    so that a rerun after lines were inserted, removed or reordered regenerates exactly the samples not yet done."""
    seen, out = {}, []
    for line, turns in samples:
        skeleton = [m if m["role"] != "assistant" else {"role": "assistant"} for m in turns]
        try:
            text = json.dumps(skeleton, sort_keys=True, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise dflash.DFlashError(f"{data}:{line}: holds {e.object[e.start]!r}, a lone surrogate that UTF-8 "
                                     f"cannot encode (nor OUT hold); fix or drop that line") from None
        h = hashlib.sha256(text).hexdigest()[:20]
        seen[h] = seen.get(h, 0) + 1
        out.append((line, h if seen[h] == 1 else f"{h}.{seen[h]}", turns))
    return out


# A line this tool wrote starts with its key; a torn last line (a crash mid-write) is a prefix of one.
LINE_HEAD = b'{"key": "'


def read_ours(path, kind, enable_thinking, is_out=True):
    """{key: record} of the lines in `path` (OUT, or OUT.truncated.jsonl), and the length of its whole part: a torn
    last line of ours is cut later (once every file has passed); anything this tool did not write is refused
    before a byte of it is touched."""
    if os.path.isdir(path):
        raise dflash.DFlashError(f"{kind} {path!r} is a directory; give --out a file path")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {}, 0
    except OSError as e:
        raise dflash.DFlashError(f"{kind} {path!r} cannot be read: {e.strerror}") from None
    whole = data[:data.rfind(b"\n") + 1]
    tail = data[len(whole):]
    if tail and not (tail.startswith(LINE_HEAD) or LINE_HEAD.startswith(tail)) or complete_json(tail):
        whole = data  # a last line without its newline that no crash of ours leaves: judged like the others
    records = {}
    for lineno, line in enumerate(whole.splitlines(), 1):
        rec = our_line(line, is_out)
        if rec is None:
            old = "source_line" in (loads(line) or {})
            raise dflash.DFlashError(
                f"{path}:{lineno}: not a line this tool writes" + (" (an earlier version, which resumed by line "
                                                                   "number)" if old else "") +
                f"; it is left untouched: give another --out")
        if rec["enable_thinking"] != enable_thinking:
            raise dflash.DFlashError(f"{path}:{lineno}: written with enable_thinking={rec['enable_thinking']}, "
                                     f"not {enable_thinking}; resume with the same flags or give another --out")
        records[rec["key"]] = rec
    return records, len(whole)


def loads(line):
    try:
        return json.loads(line)
    except ValueError:
        return None


def complete_json(b):
    return bool(b) and loads(b) is not None


def our_line(line, is_out):
    """The record of a line this tool writes (to OUT: messages; to OUT.truncated.jsonl: the turn cut), else None."""
    rec = loads(line)
    if not (isinstance(rec, dict) and isinstance(rec.get("key"), str) and isinstance(rec.get("source_line"), int)
            and "enable_thinking" in rec):
        return None
    ok = isinstance(rec.get("messages"), list) if is_out else isinstance(rec.get("truncated_turn"), int)
    return rec if ok else None


def cut_torn_tail(path, whole):
    """Drop a torn last line left by a crash, or end a whole last line whose newline it cut (only ever called
    after read_ours accepted the rest)."""
    size = os.path.getsize(path) if os.path.exists(path) else 0
    if size > whole:
        with open(path, "r+b") as f:
            f.truncate(whole)
        print(f"{path}: dropped a torn last line ({size - whole} bytes) left by an interrupted run", file=sys.stderr)
    elif size:
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def writable(path, kind):
    """Create `path` if needed: a path that cannot be written fails here, before any request."""
    if os.path.isdir(path):
        raise dflash.DFlashError(f"{kind} {path!r} is a directory; remove it or give another --out")
    try:
        with open(path, "ab"):
            pass
    except OSError as e:
        raise dflash.DFlashError(f"{kind} {path!r} cannot be written: {e.strerror}") from None


class OutLock:
    """OUT.lock beside OUT: one run writes OUT and the files beside it at a time. Held with flock where there is
    one, so a killed run leaves no stale lock; it names the pid of the run holding it."""

    def __init__(self, out):
        self.path, self.fd = out + ".lock", None
        try:
            import fcntl
        except ImportError:  # no flock (Windows): the lock file's existence is the lock
            fcntl = None
        while self.fd is None:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | (0 if fcntl else os.O_EXCL), 0o644)
            except FileExistsError:
                self.refuse(self.holder(), " (if no such run is alive, delete the lock file)")
            except OSError as e:
                raise dflash.DFlashError(f"--out {out!r} cannot be written (its lock file {self.path}: "
                                         f"{e.strerror})") from None
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    self.refuse(self.holder(), "")
                try:  # the run holding it may have removed it between our open and flock: lock the new one
                    same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd

    def holder(self):
        try:
            with open(self.path) as f:
                return f.read().strip() or "?"
        except OSError:
            return "?"

    def refuse(self, pid, more):
        out = self.path[:-len(".lock")]
        raise dflash.DFlashError(f"--out {out!r} is being written by another regenerate run (pid {pid}, lock file "
                                 f"{self.path}){more}; wait for it to finish or give another --out")

    def release(self):
        os.unlink(self.path)  # while still held, so no other run can hold the file being removed
        os.close(self.fd)


def load_tokenizer(args):
    if args.endpoint == "chat" and args.tokenizer is None:
        name = args.model  # optional here: it only helps explain a bare 500
    else:
        name = args.tokenizer or args.model
    try:
        from transformers import AutoTokenizer

        from dflash_tools import gguf_target  # a GGUF target's tokenizer and chat template are in the file
        tokenizer = gguf_target.load_tokenizer(name) if gguf_target.spelled(name) else AutoTokenizer.from_pretrained(
            name, trust_remote_code=args.trust_remote_code)
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
        read_choice(http_json(server.url, server.payload(turns, 1), args.timeout, 0, stop), args.endpoint)
    except BadReply as e:
        raise dflash.DFlashError(f"{server.url} answered, but not with a completion: {e}; is --server an "
                                 f"OpenAI-compatible server's base URL?") from None
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
    """SIGTERM / SIGINT / SIGHUP (unless ignored, as under nohup): send no new requests, finish the ones in flight,
    write what is finished; a second signal kills. `fatal` says why a run stopped on its own (the server went away)."""

    def __init__(self):
        self.requested, self.fatal = False, None
        sigs = {signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", signal.SIGINT)}  # no SIGHUP on Windows
        self.previous = {s: signal.signal(s, self._handler) for s in sigs if signal.getsignal(s) != signal.SIG_IGN}

    def _handler(self, signum, frame):
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.requested = True

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)


def run(args):
    samples = keyed(read_input(args.data), args.data)
    paths = {"done": args.out, "truncated": args.out if args.keep_truncated else args.out + ".truncated.jsonl",
             "failed": args.out + ".failed.jsonl"}
    if os.path.isdir(args.out):
        raise dflash.DFlashError(f"--out {args.out!r} is a directory; give a file path")
    lock = OutLock(args.out)
    try:
        return run_locked(args, samples, paths)
    finally:
        lock.release()


def run_locked(args, samples, paths):
    done, whole = read_ours(args.out, "--out", args.enable_thinking)
    dropped, dropped_whole = read_ours(paths["truncated"], "the truncation list", args.enable_thinking, False) \
        if not args.keep_truncated else ({}, 0)
    writable(args.out, "--out")
    writable(paths["failed"], "the failure list")
    if not args.keep_truncated:
        writable(paths["truncated"], "the truncation list")
    cut_torn_tail(args.out, whole)  # every file passed: only now is anything changed
    if not args.keep_truncated:
        cut_torn_tail(paths["truncated"], dropped_whole)
        retry = {k for k, r in dropped.items() if args.retry_truncated or r.get("max_tokens", 0) < args.max_tokens}
        if retry:  # asked for again: off the list (a sample cut again goes back on it)
            keep = [r for k, r in dropped.items() if k not in retry]
            with open(paths["truncated"] + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in keep)
            os.replace(paths["truncated"] + ".tmp", paths["truncated"])
            dropped = {r["key"]: r for r in keep}
    todo = [(n, k, turns) for n, k, turns in samples if k not in done and k not in dropped]
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
    summary["skipped_truncated"] = sum(k in dropped for _, k, _ in samples)
    print(summary_line(summary, args, paths))
    if stop.fatal:
        raise dflash.DFlashError(stop.fatal)
    if todo and summary["failed"] and not summary["written"] and not summary["truncated"] and not summary["stopped"]:
        raise dflash.DFlashError(f"every one of the {summary['failed']} samples sent failed, the first with "
                                 f"{summary['first_error']} (all listed in {paths['failed']}); fix the server or "
                                 f"the flags, then rerun the same command")
    return summary


def summary_line(s, args, paths):
    """The run in one line: what was written, skipped, failed or cut, and the flag that retries each."""
    parts = [f"{s['written']} written", f"{s['skipped_done'] - s['skipped_truncated']} skipped as done"]
    if s["skipped_truncated"]:
        parts.append(f"{s['skipped_truncated']} skipped as cut by --max_tokens earlier (--retry_truncated, or a "
                     f"larger --max_tokens, regenerates them)")
    parts.append(f"{s['failed']} failed" + (f" (see {paths['failed']}; rerun the same command to retry them)"
                                            if s["failed"] else ""))
    parts.append(f"{s['truncated']} truncated " + ("(kept)" if args.keep_truncated else
                                                   "(dropped; --retry_truncated, or a larger --max_tokens, "
                                                   "regenerates them)" if s["truncated"] else "(dropped)"))
    rate = s["generated_tokens"] / max(s["wall_s"], 1e-9)
    parts.append(f"{s['prompt_tokens']} prompt and {s['generated_tokens']} generated tokens, {s['wall_s']:.1f} s "
                 f"({rate:.1f} generated tokens/s)")
    return "regenerate: " + ", ".join(parts) + ("; stopped early: rerun the same command to continue"
                                                if s["stopped"] else "")


def generate_all(server, todo, args, stop, paths):
    """Keep `concurrency` requests in flight; append each result, in input order, as one whole flushed line to the
    file of its kind."""
    s = dict(written=0, failed=0, truncated=0, prompt_tokens=0, generated_tokens=0, stopped=False, first_error=None)
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
                if kind == "failed" and s["first_error"] is None:
                    s["first_error"] = record["error"]
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
    flag(p, "--server", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1", required=True,
         type=server_url)
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
         "and list their keys in OUT.truncated.jsonl, which a rerun skips unless --retry_truncated or a larger "
         "--max_tokens)", action="store_true")
    flag(p, "--retry_truncated", False, "regenerate the samples listed in OUT.truncated.jsonl (those cut by a "
         "smaller --max_tokens are retried anyway)", action="store_true")
    flag(p, "--concurrency", 16, "requests in flight", int, lo=1, hi=4096)
    flag(p, "--timeout", 600.0, "seconds one request may take as a whole (connecting, waiting, reading)", float, lo=0,
         open_lo=True, hi=TIMEOUT_MAX_S)
    flag(p, "--retries", 5, "retries of a request on connection errors, timeouts, 429 and 5xx (with backoff, or the "
         "server's Retry-After)", int, lo=0)
    flag(p, "--trust_remote_code", False, "allow the tokenizer's custom code", action="store_true")
    flag(p, "--debug", False, "show tracebacks for input errors (or DFLASH_DEBUG=1)", action="store_true")
    return p


def main(argv=None):
    args = get_parser().parse_args(argv)
    return dflash.run_main(run, args)


if __name__ == "__main__":
    main()
