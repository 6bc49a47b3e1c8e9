"""dflash_tools/regenerate.py against a real server: `transformers serve` on 127.0.0.1 with a tiny Qwen3 target whose
byte-level BPE tokenizer merges a newline with the indentation after it and whose chat template is Qwen3-like
(think blocks, enable_thinking). Every regenerated turn must equal the target's own greedy generate() for the same
rendered prefix; an interrupted run resumed must write the uninterrupted run's file; dflash.py must train on it."""

import itertools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import dflash
from conftest import SMALL, torch_threads
from dflash_tools import regenerate as rg

MAX_TOKENS = 24
# Qwen3-like: the assistant turn after the last user message carries a think block (split out of the content when
# the answer has one), earlier ones do not; thinking off puts the empty block in the generation prompt.
TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% set content = m.content %}{% set reasoning = '' %}"
    "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n"
    "{% if loop.index0 > ns.last_user %}<think>\n{{ reasoning.strip('\\n') }}\n</think>\n\n{% endif %}"
    "{{ content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def code_tokenizer():
    """Byte-level BPE trained on a few stdlib modules (GPT-2 pre-tokenization, so "\\n" + indentation is one
    pre-token and merges, e.g. into "\\n   "), <|im_end|> as eos, <think> / </think> as plain added tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    root = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(root, f), encoding="utf-8").read() for f in ("textwrap.py", "shlex.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.add_tokens(["<think>", "</think>"])
    fast.chat_template = TEMPLATE
    return fast


def tiny_target(path, tokenizer):
    """A random tiny Qwen3 that writes printable ASCII and no think tags (other tokens' lm_head rows zeroed, so they
    never win the argmax: the text round-trips), starts its answers indented, and stops with <|im_end|> where it
    would write "W" (its row a scaled copy), so some answers end and some are cut by MAX_TOKENS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id))
    ascii_ = [all(c == "\n" or " " <= c <= "~" for c in tokenizer.decode([i])) for i in range(len(tokenizer))]
    with torch.no_grad():
        w = model.lm_head.weight
        w[~torch.tensor(ascii_)] = 0
        w[tokenizer.all_special_ids + tokenizer.convert_tokens_to_ids(["<think>", "</think>"])] = 0
        w[eos] = 1.02 * w[tokenizer.convert_tokens_to_ids("W")]
        indent, th = tokenizer.convert_tokens_to_ids(["ĠĠĠ", "Ġth"])
        w[indent] = 1.02 * w[th]  # "   " where it would write " th": answers start indented, like code
        w[[i for i in range(len(tokenizer)) if i != indent and not tokenizer.decode([i]).strip()]] = 0
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(d):
    """`transformers serve` on a free port, not pinned to a model, so it serves any local directory by path."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # a hub id fails at once, not after retries
    log = open(d / "serve.log", "w")
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", "--host",
                             "127.0.0.1", "--port", str(port), "--device", "cpu"], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, log, f"http://127.0.0.1:{port}"


def wait_healthy(proc, url, d, timeout=120):
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail(f"transformers serve did not start:\n{(d / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module, and the tiny target saved twice: with and without a chat template."""
    d = tmp_path_factory.mktemp("regen")
    proc, log, url = start_server(d)  # it starts (~6 s) while the target is built
    tok = code_tokenizer()
    model = tiny_target(d / "target", tok)
    plain = d / "no_template"
    shutil.copytree(d / "target", plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    wait_healthy(proc, url, d)
    yield dict(dir=d, url=url + "/v1", target=str(d / "target"), plain=str(plain), model=model.eval(), tok=tok)
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


SYSTEM = {"role": "system", "content": "You write Python."}
INPUT = [
    {"prompt": "def f(x):"},
    {"prompt": "hello", "response": "an answer that is not the target's"},
    {"messages": [SYSTEM, {"role": "user", "content": "import os"}, {"role": "assistant", "content": "old"},
                  {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "old too"}]},
    {"messages": [{"role": "user", "content": "class A:"}, {"role": "assistant", "content": "old"},
                  {"role": "user", "content": "for i in range(3):"}]},
    {"prompt": "print('hi')"},
    {"prompt": "x = [1, 2]"},
    {"prompt": "what is 2+2?"},
    {"messages": [{"role": "user", "content": "    return x"}]},
]


def write_input(path, records=INPUT):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def greedy(served, messages, thinking):
    """The target's own answer after `messages`: generate() on the rendered prefix, as the server tokenizes it."""
    tok = served["tok"]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch_threads(1), torch.no_grad():
        out = served["model"].generate(ids, do_sample=False, max_new_tokens=MAX_TOKENS)[0, ids.shape[1]:]
    return tok.decode(out, skip_special_tokens=True), len(out) >= MAX_TOKENS, out.tolist()  # finish_reason "length"


def expected_lines(served, records, thinking):
    """The output file regenerate.py must write, computed here with generate(): turn by turn, truncated samples
    dropped."""
    lines = []
    for n, rec in enumerate(records, 1):
        turns = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
        if turns[-1]["role"] != "assistant":
            turns = turns + [{"role": "assistant"}]
        out, cut = [], False
        for m in turns:
            if m["role"] == "assistant":
                text, cut, _ = greedy(served, out, thinking)
                m = {"role": "assistant", "content": text}
                if cut:
                    break
            out.append(m)
        if not cut:
            lines.append({"messages": out, "source_line": n, "enable_thinking": thinking})
    return lines


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def regen(served, data, out, *extra, model=None):
    """regenerate.py's command line, in this process (it is I/O-bound; the server does the work)."""
    return rg.main(["--server", served["url"], "--model", model or served["target"], "--data", data, "--out",
                    str(out), "--max_tokens", str(MAX_TOKENS), "--concurrency", "2", *extra])


@pytest.fixture(scope="module")
def regenerated(served):
    """Both thinking modes regenerated once; shared by the tests below."""
    data = write_input(served["dir"] / "in.jsonl")
    runs = {}
    for thinking in (False, True):
        out = served["dir"] / f"out_{thinking}.jsonl"
        flag = "--enable_thinking" if thinking else "--no-enable_thinking"
        runs[thinking] = dict(out=out, summary=regen(served, data, out, flag), flag=flag)
    return dict(data=data, runs=runs)


@pytest.mark.parametrize("thinking", [False, True])
def test_every_turn_is_the_targets_greedy_answer(served, regenerated, thinking):
    """Each assistant turn equals decode(generate(greedy)) for the prefix rendered with the same enable_thinking,
    multi-turn conversations turn by turn on the target's own earlier answers; system and user turns kept; answers
    cut by --max_tokens dropped and counted."""
    run = regenerated["runs"][thinking]
    expected = expected_lines(served, INPUT, thinking)
    lines = read_lines(run["out"])
    assert [{k: v for k, v in r.items() if k != "key"} for r in lines] == expected
    assert len({r["key"] for r in lines}) == len(lines)  # the key resume goes by: one per sample
    s = run["summary"]
    assert (s["written"], s["truncated"], s["failed"], s["skipped_done"]) == (len(expected), len(INPUT) - len(expected),
                                                                             0, 0)
    assert 0 < len(expected) < len(INPUT)  # the target both stops and runs into --max_tokens here
    assert any([m["role"] for m in r["messages"]].count("assistant") == 2 for r in expected)  # a two-turn one
    assert s["generated_tokens"] > 0 and s["prompt_tokens"] > 0


def test_thinking_modes_differ(regenerated):
    """enable_thinking reaches the template: the two modes' prefixes differ, so do some answers."""
    off, on = (read_lines(regenerated["runs"][t]["out"]) for t in (False, True))
    answers = lambda lines: {r["source_line"]: r["messages"][-1]["content"] for r in lines}  # noqa: E731
    a, b = answers(off), answers(on)
    assert any(a[n] != b[n] for n in a.keys() & b.keys())


def test_interrupted_then_resumed_equals_uninterrupted(served, regenerated, tmp_path):
    """SIGTERM mid-run: the request in flight finishes and is written, nothing after it; a crash's torn last line
    is dropped; rerunning the same command appends the rest, and the file equals the uninterrupted run's."""
    run = regenerated["runs"][False]
    full = (run["out"]).read_bytes()
    out = tmp_path / "out.jsonl"

    def interrupt():  # as soon as the first sample is written
        while not (out.exists() and out.read_bytes().count(b"\n")):
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=interrupt)
    watcher.start()
    s = regen(served, regenerated["data"], out, run["flag"], "--concurrency", "1")
    watcher.join()
    part = out.read_bytes()
    assert s["stopped"] and 0 < part.count(b"\n") < full.count(b"\n") and full.startswith(part)
    done = part.count(b"\n")
    torn = full[len(part):full.index(b"\n", len(part))][:-7]  # the next line, cut off by a crash
    out.write_bytes(part + torn)
    s = regen(served, regenerated["data"], out, run["flag"])
    assert out.read_bytes() == full
    assert s["written"] == full.count(b"\n") - done and not s["stopped"]
    s = regen(served, regenerated["data"], out, run["flag"])  # all done: nothing is sent, nothing written
    assert (s["written"], s["skipped_done"], out.read_bytes()) == (0, len(INPUT), full)


def test_resume_refuses_another_thinking_mode(served, regenerated, capsys):
    with pytest.raises(SystemExit) as e:
        regen(served, regenerated["data"], regenerated["runs"][False]["out"], "--enable_thinking")
    assert e.value.code == 2 and "enable_thinking=False" in capsys.readouterr().err


def test_a_refused_sample_goes_to_failed_jsonl_and_the_run_goes_on(served, regenerated, tmp_path, monkeypatch):
    """A 4xx for one sample (here the real server's 422, provoked by an unexpected field in that one request) is
    written to OUT.failed.jsonl with the error; the others are written as usual."""
    real = rg.exchange

    def exchange(url, data, timeout):
        if data and b"print('hi')" in data:
            data = json.dumps({**json.loads(data), "not_a_field": 1}).encode()
        return real(url, data, timeout)

    monkeypatch.setattr(rg, "exchange", exchange)
    out = tmp_path / "out.jsonl"
    s = regen(served, regenerated["data"], out, "--no-enable_thinking")
    failed = read_lines(str(out) + ".failed.jsonl")
    assert [f["source_line"] for f in failed] == [5] and "HTTP 422" in failed[0]["error"]
    assert "not_a_field" in failed[0]["error"]
    expected = [r for r in read_lines(regenerated["runs"][False]["out"]) if r["source_line"] != 5]
    assert read_lines(out) == expected and s["failed"] == 1


def test_connection_errors_and_5xx_are_retried(served, regenerated, tmp_path, monkeypatch):
    """A reset connection and a 503 on the first requests are retried (with backoff) and lose nothing. Every request
    says temperature 0 and max_tokens (a server would otherwise apply the model's sampling generation_config)."""
    real, calls = rg.exchange, []

    def exchange(url, data, timeout):
        calls.append(json.loads(data))
        if len(calls) == 2:
            raise ConnectionResetError(104, "Connection reset by peer")
        if len(calls) == 3:
            return 503, {}, b"Service Unavailable"
        return real(url, data, timeout)

    monkeypatch.setattr(rg, "exchange", exchange)
    monkeypatch.setattr(rg, "BACKOFF_S", 0.01)
    out = tmp_path / "out.jsonl"
    regen(served, regenerated["data"], out, "--no-enable_thinking", "--concurrency", "1")
    assert out.read_bytes() == regenerated["runs"][False]["out"].read_bytes()
    sent = calls[1:]  # after the one-token check of the server
    assert all(c["temperature"] == 0 and c["max_tokens"] == MAX_TOKENS and "top_p" not in c for c in sent)
    with pytest.raises(SystemExit):  # without retries the same failure ends the run
        calls.clear()
        regen(served, regenerated["data"], tmp_path / "other.jsonl", "--no-enable_thinking", "--retries", "0")


def test_dflash_trains_on_the_output(served, regenerated, tmp_path):
    """The output is a dflash.py --data file as it is: a tiny run trains and logs finite losses."""
    out = tmp_path / "run"
    with torch_threads(1):
        dflash.main(["--target", served["target"], "--data", str(regenerated["runs"][False]["out"]),
                     "--no-enable_thinking", "--out", str(out), "--max_steps", "2", "--batch_size", "2",
                     "--grad_accum", "1", *SMALL])
    with open(out / "metrics.jsonl") as f:
        losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (out / "step_2" / "model.safetensors").exists()


def one_error_line(capsys, argv):
    with pytest.raises(SystemExit) as e:
        rg.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_error_line(served, regenerated, tmp_path, capsys):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    data = regenerated["data"]
    base = lambda server=served["url"], model=served["target"], data=data, out=tmp_path / "o.jsonl": [  # noqa: E731
        "--server", server, "--model", model, "--data", str(data), "--out", str(out), "--max_tokens", "4"]
    assert "cannot reach the server" in one_error_line(capsys, base(server=dead))
    # the server's own bare 500, its reason looked for: a model it does not have, a target without a chat template
    assert "does not list it among its models" in one_error_line(capsys, base(model="no/such-model") +
                                                                ["--tokenizer", served["target"]])
    assert "no chat template" in one_error_line(capsys, base(model=served["plain"]) + ["--endpoint", "chat"])
    assert "no chat template" in one_error_line(capsys, base(model=served["plain"]))  # to render the prefixes
    assert "timed out" in one_error_line(capsys, base() + ["--timeout", "0.0001"])
    # checked before the first request (the server here is not even there)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"prompt": \n')
    assert f"{bad}:2: not valid JSON" in one_error_line(capsys, base(server=dead, data=bad))
    bad.write_text('{"prompt": "hi"}\n{"text": "no turns"}\n')
    assert f"{bad}:2: nothing to regenerate" in one_error_line(capsys, base(server=dead, data=bad))
    assert "is a directory" in one_error_line(capsys, base(server=dead, out=tmp_path))
    assert "cannot be written" in one_error_line(capsys, base(server=dead, out=bad / "out.jsonl"))
    (tmp_path / "foreign.jsonl").write_text('{"messages": []}\n')
    assert "not a line this tool writes" in one_error_line(capsys, base(server=dead, out=tmp_path / "foreign.jsonl"))


@pytest.mark.parametrize("thinking", [False, True])
def test_encode_sample_tokenizes_each_answer_on_its_own(thinking):
    """The ids inference gives: the generation prompt tokenized as such, then the answer on its own. Whole-string
    tokenization would merge the prompt's last newline(s) with a code answer's indentation ("\\n\\n   " is one token
    of this tokenizer), a token the target never produces there. Chat forms and prompt/response alike."""
    tok = code_tokenizer()
    encode = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    code, more = "    return x\n\n    pass", "\n    y = 1"
    one = [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": code}]
    two = one + [{"role": "user", "content": "and?"}, {"role": "assistant", "content": more}]
    assert tok.convert_ids_to_tokens(encode("\n\n    return"))[0] == "ĊĊĠĠĠ"  # the merge this is about
    think = "<think>\n\n</think>\n\n"  # the template's, in the last turn: generated when thinking is on, else prompt
    for record, messages, answers in [({"messages": one}, one, [code]), ({"prompt": one[0]["content"],
                                                                           "response": code}, one, [code]),
                                      ({"messages": two}, two, [code, more])]:
        ids, mask = dflash.encode_sample(record, tok, enable_thinking=thinking, eos_ids=[tok.eos_token_id])
        spans = [[t for t, _ in run] for m, run in itertools.groupby(zip(ids, mask), key=lambda x: x[1]) if m]
        expected = [encode(a + "<|im_end|>") for a in answers[:-1]] + [encode(think * thinking + answers[-1] +
                                                                              "<|im_end|>")]
        assert spans == expected
        if messages is one:  # the whole generation prompt is in the rendering (an earlier turn's lacks the think block)
            prompt = tok.apply_chat_template(one[:1], tokenize=False, add_generation_prompt=True,
                                             enable_thinking=thinking)
            assert ids[:mask.index(1)] == encode(prompt)


def test_trained_ids_are_the_generated_ids(served, regenerated):
    """Through encode_sample, each regenerated answer (thinking off) trains on exactly the ids the target generated,
    wherever text can carry them: every miss is a generation that is not the tokenizer's own encoding of its text
    (e.g. "   " then "4" where the tokenizer writes "  ", " ", "4")."""
    tok, hits, misses = served["tok"], 0, 0
    for rec in read_lines(regenerated["runs"][False]["out"]):
        ids, mask = dflash.encode_sample(rec, tok, enable_thinking=False, eos_ids=[tok.eos_token_id])
        spans = [[t for t, _ in run] for m, run in itertools.groupby(zip(ids, mask), key=lambda x: x[1]) if m]
        turns = [k for k, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        for span, k in zip(spans, turns, strict=True):
            text, _, generated = greedy(served, rec["messages"][:k], False)
            assert text == rec["messages"][k]["content"]
            if span == generated:
                hits += 1
            else:
                misses += 1
                assert tok(text + "<|im_end|>")["input_ids"] != generated, (span, generated)
    assert hits > 0


def test_chat_endpoint_fallback(served, regenerated, tmp_path, capsys):
    """--endpoint chat against the same server: it warns, sends enable_thinking as chat_template_kwargs, and gets the
    same answers up to the whitespace the chat endpoint strips (why completions is the default)."""
    out = tmp_path / "chat.jsonl"
    regen(served, regenerated["data"], out, "--no-enable_thinking", "--endpoint", "chat")
    assert "warning: --endpoint chat" in capsys.readouterr().err
    single = {r["source_line"]: r for r in read_lines(regenerated["runs"][False]["out"]) if len(r["messages"]) == 2}
    chat = {r["source_line"]: r for r in read_lines(out) if r["source_line"] in single}
    assert chat.keys() == single.keys()
    for n, r in chat.items():
        text, expected = r["messages"][-1]["content"], single[n]["messages"][-1]["content"]
        assert text == expected.strip() and text != expected  # the leading indentation is lost


def test_a_template_bos_is_not_sent_twice():
    """Servers tokenize a completions prompt with special tokens added: when the tokenizer adds a BOS itself (Llama
    3), the one the template renders is left out of the prompt, so the target sees one BOS as in chat."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    def tokenizer(adds_bos):
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "hi", "|user|", "|assistant|"])},
                                         unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        if adds_bos:
            tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
        fast.chat_template = ("{{ bos_token }}{% for m in messages %}|{{ m.role }}| {{ m.content }} {% endfor %}"
                              "{% if add_generation_prompt %}|assistant| {% endif %}")
        return fast

    args = rg.get_parser().parse_args(["--server", "http://x/v1", "--model", "m", "--data", "d", "--out", "o"])
    turns = [{"role": "user", "content": "hi"}]
    assert rg.Server(args, tokenizer(False)).prompt(turns) == "<s>|user| hi |assistant| "
    fast = tokenizer(True)
    prompt = rg.Server(args, fast).prompt(turns)
    assert prompt == "|user| hi |assistant| " and fast(prompt)["input_ids"][:2] == [1, 3]


def test_sampling_flags_are_sent(served, tmp_path, monkeypatch):
    """--temperature / --top_p for sampled data reach every request."""
    real, sent = rg.exchange, []

    def exchange(url, data, timeout):
        sent.append(json.loads(data))
        return real(url, data, timeout)

    monkeypatch.setattr(rg, "exchange", exchange)
    data = write_input(tmp_path / "one.jsonl", INPUT[:1])
    regen(served, data, tmp_path / "out.jsonl", "--temperature", "0.7", "--top_p", "0.9", "--keep_truncated")
    assert len(sent) == 2 and all(c["temperature"] == 0.7 and c["top_p"] == 0.9 for c in sent)
    assert len(read_lines(tmp_path / "out.jsonl")) == 1


# -----------------------------------------------------------------------------
# The same server behind a proxy that spoils some replies, and reruns after the input changed


def proxy(served, spoil):
    """A local proxy (conftest's bounded hostile server) in front of transformers serve: each reply
    passed through spoil(request, reply json) -> Reply, or None to pass it on as it is."""
    from conftest import Hostile, Reply

    def answer(req, n):
        status, _, body = rg.exchange(served["url"] + "/completions", json.dumps(req).encode(), 60)
        spoilt = spoil(req, json.loads(body)) if status == 200 else None
        return spoilt or Reply(body, status=status)

    return Hostile(answer)


def test_spoilt_replies_of_a_real_server_fail_only_their_samples(served, regenerated, tmp_path, capsys):
    """Behind the proxy, one sample's text becomes null and another's reply loses its choices: those two are in
    OUT.failed.jsonl with the reason, every other line is the real server's; with every reply spoilt the run is
    one error line naming what came back."""
    from conftest import Reply

    def spoil(req, r):
        if "print('hi')" in req["prompt"]:
            r["choices"][0]["text"] = None
            return Reply(r)
        if "x = [1, 2]" in req["prompt"]:
            return Reply({k: v for k, v in r.items() if k != "choices"})

    p = proxy(served, spoil)
    try:
        out = tmp_path / "out.jsonl"
        s = rg.main(["--server", p.url, "--model", served["target"], "--data", regenerated["data"], "--out", str(out),
                     "--max_tokens", str(MAX_TOKENS), "--no-enable_thinking"])
        failed = {f["source_line"]: f["error"] for f in read_lines(str(out) + ".failed.jsonl")}
        assert failed.keys() == {5, 6} and "text is null" in failed[5] and "no choices" in failed[6]
        assert read_lines(out) == [r for r in read_lines(regenerated["runs"][False]["out"])
                                   if r["source_line"] not in (5, 6)] and s["failed"] == 2
    finally:
        p.close()
    p = proxy(served, lambda req, r: Reply({"choices": []}) if req["max_tokens"] > 1 else None)
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            rg.main(["--server", p.url, "--model", served["target"], "--data", regenerated["data"], "--out",
                     str(tmp_path / "all.jsonl"), "--max_tokens", str(MAX_TOKENS)])
        err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
        assert e.value.code == 2 and len(err) == 1 and "every one of the 8 samples sent failed" in err[0]
        assert "no choices (an empty list)" in err[0]
    finally:
        p.close()


def test_resume_by_key_on_a_real_server(served, regenerated, tmp_path):
    """The input reordered, one line removed, one inserted: the rerun writes exactly the new prompt's sample, whose
    answer is the target's own; the truncated samples come back with a larger --max_tokens."""
    run = regenerated["runs"][False]
    out = tmp_path / "out.jsonl"
    shutil.copy(run["out"], out)
    shutil.copy(str(run["out"]) + ".truncated.jsonl", str(out) + ".truncated.jsonl")
    new = {"prompt": "y = 3"}
    changed = [INPUT[4], new, *INPUT[5:], *INPUT[:3]]  # INPUT[3] removed, the rest moved
    data = write_input(tmp_path / "in.jsonl", changed)
    s = regen(served, data, out, "--no-enable_thinking")
    added = read_lines(out)[len(read_lines(run["out"])):]
    assert s["skipped_done"] == len(changed) - 1 and s["written"] + s["truncated"] == 1
    if added:
        assert added[0]["source_line"] == 2 and added[0]["messages"] == expected_lines(served, [new], False)[0][
            "messages"]
    keys = {k for _, k, _ in rg.keyed(rg.read_input(data), data)}
    cut = [r["key"] for r in read_lines(str(out) + ".truncated.jsonl") if r["key"] in keys]
    assert cut  # some samples of this input were cut at MAX_TOKENS
    s = regen(served, data, out, "--no-enable_thinking", "--max_tokens", str(4 * MAX_TOKENS))
    assert s["written"] + s["truncated"] == len(cut) and s["skipped_done"] == len(changed) - len(cut)
    lines = read_lines(out)
    assert len({r["key"] for r in lines}) == len(lines)
    assert {r["key"] for r in lines[len(lines) - s["written"]:]} <= set(cut)


def test_retry_after_lock_and_timeout_on_a_real_server(served, regenerated, tmp_path, capsys, monkeypatch):
    """Behind the proxy the first sample request gets a 503 with Retry-After: 1; the retry comes after it and the
    file equals the direct run's. While another run holds OUT.lock, a run is refused naming its pid (and touches
    nothing); once it is released the same command runs. (A --timeout shorter than its answers: see
    test_bad_input_is_one_error_line.)"""
    from conftest import Reply
    monkeypatch.setattr(rg, "BACKOFF_S", 0.01)
    times = []

    def spoil(req, r):
        if req["max_tokens"] > 1:
            times.append(time.monotonic())
            if len(times) == 1:
                return Reply(b"busy", status=503, headers={"Retry-After": "1"})

    p = proxy(served, spoil)
    try:
        out = tmp_path / "out.jsonl"
        argv = ["--server", p.url, "--model", served["target"], "--data", regenerated["data"], "--out", str(out),
                "--max_tokens", str(MAX_TOKENS), "--no-enable_thinking", "--concurrency", "1"]
        held = rg.OutLock(str(out))  # as another run would hold it
        try:
            with pytest.raises(SystemExit):
                rg.main(argv)
            assert f"pid {os.getpid()}" in capsys.readouterr().err and not out.exists()
        finally:
            held.release()
        rg.main(argv)
        assert times[1] - times[0] >= 0.95 and out.read_bytes() == regenerated["runs"][False]["out"].read_bytes()
    finally:
        p.close()
