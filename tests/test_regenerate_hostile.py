"""dflash_tools/regenerate.py against a server that answers badly: a small HTTP server written here (127.0.0.1 only,
at most MAX_REQUESTS requests, gone by itself after LIFETIME_S) whose every answer a test chooses. Bad replies are
recorded as failed with their reason and never written as answers; a run where every sample failed is one error
line; resume goes by each sample's key, whatever happened to the input in between; one run writes OUT at a time, a
file this tool did not write is refused untouched; Retry-After is honoured (bounded) and --timeout bounds a whole
request. Every refusal's advice, followed as given, gets past it."""

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import Hostile, Reply, completion, echo, flag_edges, is_check, tiny_tokenizer
from dflash_tools import regenerate as rg

PROMPTS = ["hi there", "good day", "hello world", "bye", "sure thing"]


@pytest.fixture
def server(request):
    servers = []

    def start(answer):
        servers.append(Hostile(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tiny_tokenizer().save_pretrained(d)
    return str(d)


def write_prompts(path, prompts=PROMPTS):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def argv(srv, tokenizer_dir, data, out, *extra):
    url = srv if isinstance(srv, str) else srv.url
    return ["--server", url, "--model", "m", "--tokenizer", tokenizer_dir, "--data", str(data), "--out", str(out),
            "--concurrency", "2", "--retries", "0", *extra]


def lines(path):
    with open(path) as f:
        return [json.loads(x) for x in f]


def refused(capsys, args, *needles):
    """regenerate exits 2 with exactly one `error:` line on stderr holding every needle."""
    with pytest.raises(SystemExit) as e:
        rg.main(args)
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip() and "sample/s" not in x and "%|" not in x]
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], (n, err[0])
    return err[0]


def check_answers(out, prompts):
    """OUT holds exactly one line per prompt, each the answer to its own prompt."""
    got = {r["messages"][0]["content"]: r["messages"][-1]["content"] for r in lines(out)}
    assert len(lines(out)) == len(prompts) and got == {p: f"answer to {p}" for p in prompts}


# -----------------------------------------------------------------------------
# Replies checked where they enter

BAD = {  # a reply to every sample request -> what the failure must say
    "not JSON": (Reply(b"<html>502 Bad Gateway</html>"), "not JSON"),
    "not UTF-8": (Reply(b'{"choices": [{"text": "\xff\xfe"}]}'), "not UTF-8"),
    "a JSON list": (Reply([1, 2]), "not an object"),
    "no choices": (Reply({"id": "x", "object": "text_completion"}), "no choices"),
    "empty choices": (Reply({"choices": []}), "no choices (an empty list"),
    "an error with 200": (Reply({"error": {"message": "model overloaded"}}), "model overloaded"),
    "text null": (Reply({"choices": [{"text": None, "finish_reason": "stop"}]}), "text is null"),
    "text a number": (Reply({"choices": [{"text": 42, "finish_reason": "stop"}]}), "text is a number"),
    "finish_reason a number": (Reply({"choices": [{"text": "a", "finish_reason": 1}]}), "finish_reason is a number"),
    "a lone surrogate": (Reply(b'{"choices": [{"text": "a\\ud800b", "finish_reason": "stop"}]}'), "lone surrogate"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_reply_is_failed_never_an_answer(server, tokenizer_dir, tmp_path, capsys, case):
    """The check request is answered well, every sample's badly: nothing reaches OUT, each sample is in
    OUT.failed.jsonl with the reason, and the run is one error line saying what the server returned. The advice
    (fix the server, rerun the same command) gets past it."""
    reply, needle = BAD[case]
    srv = server(lambda req, n: completion("ok") if is_check(req) else reply)
    data, out = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    err = refused(capsys, argv(srv, tokenizer_dir, data, out), "every one of the 5 samples sent failed", needle,
                  "rerun the same command")
    assert out.read_bytes() == b""
    failed = lines(str(out) + ".failed.jsonl")
    assert len(failed) == len(PROMPTS) and all(needle in f["error"] for f in failed), failed
    srv.close()
    good = server(lambda req, n: echo(req))
    rg.main(argv(good, tokenizer_dir, data, out))  # the same command, once the server answers
    check_answers(out, PROMPTS)
    assert not os.path.exists(str(out) + ".failed.jsonl") or lines(str(out) + ".failed.jsonl") == [], err


def test_some_bad_replies_fail_those_samples_only(server, tokenizer_dir, tmp_path, capsys):
    """Null usage counts are ignored (they only feed the summary); a null text for one prompt fails that one."""
    def answer(req, n):
        if "bye" in req["prompt"]:
            return Reply({"choices": [{"text": None}]})
        r = echo(req)
        body = json.loads(r.body)
        body["usage"] = {"prompt_tokens": None, "completion_tokens": "many"}
        return Reply(body)

    srv = server(answer)
    data, out = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    s = rg.main(argv(srv, tokenizer_dir, data, out))
    assert (s["written"], s["failed"], s["generated_tokens"]) == (4, 1, 0)
    assert [f["source_line"] for f in lines(str(out) + ".failed.jsonl")] == [4]
    assert "1 failed (see" in capsys.readouterr().out


@pytest.mark.parametrize("reply,needle", [(Reply(b"garbage"), "not with a completion"),
                                          (Reply({"choices": [{"text": None}]}), "text is null"),
                                          (Reply(b"", status=301, headers={"Location": "http://elsewhere/v1"}),
                                           "redirected to http://elsewhere/v1")])
def test_a_server_that_answers_nonsense_is_refused_before_the_run(server, tokenizer_dir, tmp_path, capsys, reply,
                                                                   needle):
    srv = server(lambda req, n: reply)
    refused(capsys, argv(srv, tokenizer_dir, write_prompts(tmp_path / "in.jsonl"), tmp_path / "o.jsonl"), needle)
    assert srv.samples() == []


def test_chat_replies_are_checked(server, tokenizer_dir, tmp_path, capsys):
    """--endpoint chat: a reply without message, or with a content that is not a string, fails."""
    def answer(req, n):
        if is_check(req):
            return Reply({"choices": [{"message": {"content": "ok"}}]})
        if "bye" in json.dumps(req["messages"]):
            return Reply({"choices": [{"text": "a completion, not a chat reply"}]})
        if "sure" in json.dumps(req["messages"]):
            return Reply({"choices": [{"message": {"content": ["parts"]}}]})
        return Reply({"choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}]})

    srv = server(answer)
    out = tmp_path / "out.jsonl"
    s = rg.main(argv(srv, tokenizer_dir, write_prompts(tmp_path / "in.jsonl"), out, "--endpoint", "chat"))
    failed = {f["source_line"]: f["error"] for f in lines(str(out) + ".failed.jsonl")}
    assert s["written"] == 3 and "message is null" in failed[4] and "content is a list" in failed[5]


def test_a_lone_surrogate_in_the_input_is_one_line_before_any_request(server, tokenizer_dir, tmp_path, capsys):
    srv = server(lambda req, n: echo(req))
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "hi there"}\n{"prompt": "bad \\ud800 text"}\n')
    out = tmp_path / "out.jsonl"
    refused(capsys, argv(srv, tokenizer_dir, data, out), f"{data}:2", "lone surrogate", "fix or drop that line")
    assert srv.requests == []
    data.write_text('{"prompt": "hi there"}\n')  # the line dropped, as advised
    rg.main(argv(srv, tokenizer_dir, data, out))
    check_answers(out, ["hi there"])


# -----------------------------------------------------------------------------
# Resume by identity, and the files beside OUT


def test_resume_by_key_after_the_input_changed(server, tokenizer_dir, tmp_path, capsys):
    """Lines inserted, removed and reordered between runs: the rerun asks for exactly the new prompts and OUT ends
    with one right answer per prompt ever given (a removed prompt's answer stays: it is data already paid for)."""
    srv = server(lambda req, n: echo(req))
    data, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rg.main(argv(srv, tokenizer_dir, write_prompts(data, PROMPTS[:3]), out))
    changed = ["sure thing", PROMPTS[2], "bye", PROMPTS[0]]  # PROMPTS[1] removed, two inserted, order changed
    before = len(srv.samples())
    s = rg.main(argv(srv, tokenizer_dir, write_prompts(data, changed), out))
    asked = [r["prompt"] for r in srv.samples()[before:]]
    assert sorted(a.split("<|user|>")[-1].split("<|end|>")[0].strip() for a in asked) == ["bye", "sure thing"]
    assert (s["written"], s["skipped_done"]) == (2, 2)
    check_answers(out, PROMPTS)
    # a prompt given twice is two samples (with sampling, two answers): the second copy is regenerated too
    s = rg.main(argv(srv, tokenizer_dir, write_prompts(data, changed + ["bye"]), out))
    assert s["written"] == 1 and len({r["key"] for r in lines(out)}) == len(lines(out)) == 6


def test_truncated_samples_are_retried_by_the_flag_the_summary_names(server, tokenizer_dir, tmp_path, capsys):
    """Answers cut by --max_tokens are dropped and listed; the same command skips them; the summary names
    --retry_truncated and a larger --max_tokens, and each, run as given, regenerates them."""
    def answer(req, n):
        r = json.loads(echo(req).body)
        r["choices"][0]["finish_reason"] = "length" if req["max_tokens"] < 8 else "stop"
        return Reply(r)

    srv = server(answer)
    data, out = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    base = argv(srv, tokenizer_dir, data, out, "--max_tokens", "4")
    s = rg.main(base)
    assert (s["written"], s["truncated"]) == (0, 5) and "--retry_truncated" in capsys.readouterr().out
    s = rg.main(base)
    assert (s["written"], s["skipped_done"], s["skipped_truncated"]) == (0, 5, 5)
    assert "--retry_truncated, or a larger --max_tokens" in capsys.readouterr().out
    before = len(srv.samples())
    s = rg.main(base + ["--retry_truncated"])  # asked again (cut again at 4: back on the list, once)
    assert len(srv.samples()) - before == 5 and s["truncated"] == 5
    assert len(lines(str(out) + ".truncated.jsonl")) == 5
    s = rg.main(base[:-1] + ["16"])  # a larger --max_tokens
    assert (s["written"], s["truncated"]) == (5, 0)
    check_answers(out, PROMPTS)
    assert lines(str(out) + ".truncated.jsonl") == []


def test_a_foreign_out_is_refused_untouched(server, tokenizer_dir, tmp_path, capsys):
    """A file another tool wrote (here without a final newline), or an earlier version's line-numbered output, is
    refused before a byte of it changes; another --out, as advised, works."""
    srv = server(lambda req, n: echo(req))
    data = write_prompts(tmp_path / "in.jsonl")
    out = tmp_path / "theirs.jsonl"
    for content in [b'{"messages": [{"role": "user", "content": "x"}]}\n{"messages": []}',
                    b'{"messages": [], "source_line": 1, "enable_thinking": null}\n', b'{"id": 3}', b"plain text"]:
        out.write_bytes(content)
        refused(capsys, argv(srv, tokenizer_dir, data, out), "not a line this tool writes", "left untouched",
                "give another --out")
        assert out.read_bytes() == content and not os.path.exists(str(out) + ".lock")
    assert srv.requests == []
    rg.main(argv(srv, tokenizer_dir, data, tmp_path / "another.jsonl"))
    check_answers(tmp_path / "another.jsonl", PROMPTS)


def test_a_whole_last_line_without_its_newline_is_kept(server, tokenizer_dir, tmp_path):
    """A crash that cut only the newline of our last line: the line is kept and the next one starts on its own."""
    srv = server(lambda req, n: echo(req))
    data, out = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2]), tmp_path / "out.jsonl"
    rg.main(argv(srv, tokenizer_dir, data, out))
    out.write_bytes(out.read_bytes()[:-1])
    rg.main(argv(srv, tokenizer_dir, write_prompts(tmp_path / "in.jsonl"), out))
    check_answers(out, PROMPTS)


def test_failed_list_that_is_a_directory(server, tokenizer_dir, tmp_path, capsys):
    srv = server(lambda req, n: echo(req))
    data, out = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    os.mkdir(str(out) + ".failed.jsonl")
    refused(capsys, argv(srv, tokenizer_dir, data, out), "is a directory", "remove it")
    os.rmdir(str(out) + ".failed.jsonl")  # as advised
    rg.main(argv(srv, tokenizer_dir, data, out))
    check_answers(out, PROMPTS)


HOLDER = """import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
print("held", flush=True)
time.sleep(60)
"""


def test_one_run_at_a_time(server, tokenizer_dir, tmp_path, capsys):
    """While another process holds OUT.lock as a run does (flock, its pid inside; a small stand-in, since a second
    regenerate would take seconds to import), a run on the same --out is refused naming that pid and touches nothing;
    once it has finished, the same command runs. A lock file left by a killed run (no flock on it) does not block."""
    srv = server(lambda req, n: echo(req))
    data, out = write_prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(out) + ".lock"], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        refused(capsys, argv(srv, tokenizer_dir, data, out), f"pid {first.pid}", "wait for it to finish")
        assert srv.requests == [] and not out.exists()
    finally:
        first.kill()
        first.wait(timeout=30)
    rg.main(argv(srv, tokenizer_dir, data, out))  # the same command, the first one gone
    check_answers(out, PROMPTS)
    assert not os.path.exists(str(out) + ".lock")
    (tmp_path / "out2.jsonl.lock").write_text("999999999\n")  # a killed run's lock: no flock held on it
    rg.main(argv(srv, tokenizer_dir, data, tmp_path / "out2.jsonl"))
    check_answers(tmp_path / "out2.jsonl", PROMPTS)


# -----------------------------------------------------------------------------
# Time limits


@pytest.mark.parametrize("header,wait", [("1", 1.0), ("100000", 1.5), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_retry_after_is_honoured_and_bounded(server, tokenizer_dir, tmp_path, monkeypatch, header, wait):
    """A 503 with Retry-After: the retry comes after the time asked for (seconds, or a date: one in the past is no
    wait), never after more than RETRY_AFTER_MAX_S (here 1.5 s)."""
    monkeypatch.setattr(rg, "BACKOFF_S", 0.01)
    monkeypatch.setattr(rg, "RETRY_AFTER_MAX_S", 1.5)
    times = []

    def answer(req, n):
        if not is_check(req):
            times.append(time.monotonic())
            if len(times) == 1:
                return Reply(b"busy", status=503, headers={"Retry-After": header})
        return echo(req)

    srv = server(answer)
    data, out = write_prompts(tmp_path / "in.jsonl", PROMPTS[:1]), tmp_path / "out.jsonl"
    rg.main(argv(srv, tokenizer_dir, data, out, "--retries", "1"))
    gap = times[1] - times[0]
    assert wait - 0.05 <= gap <= wait + 0.5, gap
    check_answers(out, PROMPTS[:1])


@pytest.mark.parametrize("where", ["body", "headers"])
def test_timeout_bounds_a_whole_request(server, tokenizer_dir, tmp_path, capsys, where):
    """A server that trickles a byte every 0.1 s (each wait far below --timeout) is cut at --timeout: the run ends
    in one error line within about that time, not after the whole trickle (~20 s)."""
    slow = lambda req: Reply(echo(req).body + b" " * 100, trickle=0.1)  # noqa: E731

    srv = server(lambda req, n: (completion("ok") if is_check(req) else slow(req)) if where == "body" else slow(req))
    t0 = time.monotonic()
    refused(capsys, argv(srv, tokenizer_dir, write_prompts(tmp_path / "in.jsonl"), tmp_path / "o.jsonl", "--timeout",
                         "1"), "timed out")
    assert time.monotonic() - t0 < 6


# -----------------------------------------------------------------------------
# --server values and the numeric flags at their edges


@pytest.mark.parametrize("value", ["127.0.0.1:{port}/v1", "localhost:{port}/v1", "ftp://127.0.0.1:{port}/v1",
                                   "http://", "http://127.0.0.1:notaport/v1", "", "//127.0.0.1:{port}/v1"])
def test_bad_server_values_are_one_line_with_advice_that_works(server, tokenizer_dir, tmp_path, capsys, value):
    srv = server(lambda req, n: echo(req))
    port = srv.url.split(":")[2].split("/")[0]
    data, out = write_prompts(tmp_path / "in.jsonl", PROMPTS[:1]), tmp_path / "o.jsonl"
    err = refused(capsys, argv(value.format(port=port), tokenizer_dir, data, out), "--server", "not an http(s) URL")
    suggested = err.split("e.g. ")[-1]
    assert rg.is_url(suggested)  # never the bad value back
    if port in value:  # the advice keeps what was given: followed, it runs
        rg.main(argv(suggested, tokenizer_dir, data, out))
        check_answers(out, PROMPTS[:1])


def test_numeric_flags_at_their_edges(server, tokenizer_dir, tmp_path, capsys):
    """Each numeric flag at the smallest and the largest value its rule accepts (or a huge one where it has no
    upper bound): the run works and the value reaches the server as given; the smallest --timeout times out, in
    one line."""
    srv = server(lambda req, n: echo(req))
    data = write_prompts(tmp_path / "in.jsonl", PROMPTS[:2])
    edges = {a.option_strings[0]: flag_edges(a) for a in rg.get_parser()._actions if hasattr(a.type, "text")}
    assert set(edges) == {"--max_tokens", "--temperature", "--top_p", "--concurrency", "--timeout", "--retries"}
    for flag, (lo, hi) in edges.items():
        for v in (lo, hi):
            out = tmp_path / f"o{flag}{v}.jsonl"
            before = len(srv.requests)
            if flag == "--timeout" and v == lo:
                refused(capsys, argv(srv, tokenizer_dir, data, out, flag, repr(v)), "timed out")
                continue
            rg.main(argv(srv, tokenizer_dir, data, out, flag, repr(v)))
            check_answers(out, PROMPTS[:2])
            sent = srv.requests[before + 1:]  # after the one-token check
            if flag in ("--max_tokens", "--temperature", "--top_p"):
                assert len(sent) == 2 and all(r[flag[2:]] == v for r in sent), (flag, v)
