"""GGUF targets (dflash_tools/gguf_target.py): a tiny random Llama written by this test both as safetensors and, with
the gguf package's writer, as a GGUF (fp32 tensors, llama metadata, a byte-level BPE tokenizer and a ChatML template
in the file) loads through dflash.load_target as the same model (logits within 1e-5), with the same tokenizer and
template; a drafter trains on it (online and from a capture), eval.py takes it, and the records name the .gguf and
its sha256; the spellings that are not one GGUF are refused in one line, and so is a missing gguf package; the
features bench runs on it. No test needs the real 98 MB SmolLM2 file."""
import hashlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import ROOT, SMALL, build_family, refused, replace, torch_threads, write_data

import dflash
import eval as ev
from dflash_tools import features, regenerate

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: SmolLM2's layout
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "def add(a, b):\n    return a + b  # the sum of two numbers, returned to the caller\n" * 4


def byte_bpe():
    """A byte-level BPE (GPT-2's pre-tokenization) trained on TEXT to 320 tokens, the specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def permuted(w, heads):
    """llama.cpp's row order for q/k (the two rotary halves of each head interleaved); transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model, tok):
    """model (a LlamaForCausalLM) and tok as a GGUF: llama metadata, fp32 tensors under llama.cpp's names."""
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tok.to_str())["model"]
    tokens = sorted(spec["vocab"], key=spec["vocab"].get)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # tied: the file holds token_embd alone
        x = p.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            x = permuted(x, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """{"st": the safetensors directory (with its tokenizer), "gguf": the same model as a GGUF file in a directory
    of its own, "data"} of a tied tiny Llama whose vocabulary is the tokenizer's."""
    from transformers import PreTrainedTokenizerFast
    d = tmp_path_factory.mktemp("gguf")
    tok = byte_bpe()
    model = build_family("llama_tied", vocab_size=tok.get_vocab_size(), bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    model.save_pretrained(d / "st")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(d / "st")
    os.makedirs(d / "pkg")
    return {"st": str(d / "st"), "gguf": write_gguf(d / "pkg" / "tiny.F32.gguf", model, tok),
            "data": write_data(d / "data.jsonl", 12)}


def test_the_gguf_loads_as_its_safetensors_twin(twins):
    """Both spellings (the file, its directory) give the same model as the safetensors twin: config, tied lm_head,
    logits within 1e-5 (the same fp32 weights, q/k rows permuted there and back); the tokenizer and chat template from
    the file encode, render and decode as the twin's (regenerate.py's --tokenizer reads it too), converted once for
    both spellings; the record names the file and its sha256."""
    st = dflash.load_target(twins["st"])
    x = torch.tensor([[5, 17, 40, 3, 99, 250, 7, 31]])
    want = st.model(x).logits
    sha = hashlib.sha256(open(twins["gguf"], "rb").read()).hexdigest()
    toks = []
    for spelling in (twins["gguf"], os.path.dirname(twins["gguf"])):
        g = dflash.load_target(spelling)
        toks.append(g.tokenizer)
        assert (g.num_layers, g.hidden_size, g.vocab_size) == (st.num_layers, st.hidden_size, st.vocab_size)
        assert g.lm_head.weight is g.embed.weight and g.name == spelling
        torch.testing.assert_close(g.model(x).logits, want, atol=1e-5, rtol=0)
        rec = dflash.target_record(g)
        assert rec["gguf"] == "tiny.F32.gguf" and rec["sha256"] == sha and rec["target"] == spelling
        assert rec["fingerprint"] == dflash.target_record(st)["fingerprint"]
        tok, ref, chat = g.tokenizer, st.tokenizer, [{"role": "user", "content": "add two numbers"}]
        ids = tok(TEXT)["input_ids"]  # merged (fewer ids than characters), as the twin merges, and back
        assert ids == ref(TEXT)["input_ids"] and len(ids) < len(TEXT) / 2 and tok.decode(ids) == TEXT
        assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and 2 in g.eos_ids()
    assert toks[0] is toks[1]  # the file's tokenizer converted once a process, whichever the spelling
    args = SimpleNamespace(endpoint="completions", tokenizer=twins["gguf"], model="m", trust_remote_code=False)
    assert regenerate.load_tokenizer(args).chat_template == CHATML  # regenerate.py --tokenizer model.gguf


def test_a_drafter_trains_against_the_gguf_online_and_from_its_capture(twins, tmp_path):
    """Two steps online against the GGUF (its directory spelling), and two from a capture of it: each checkpoint's
    target record and the capture's manifest name the .gguf and its sha256, and eval.py (the file spelling, a real
    draft-verify loop on a chat-templated prompt) takes the drafter as this target's; the embedding and final norm
    read alone from the file for --features are the loaded model's."""
    pkg, sha = os.path.dirname(twins["gguf"]), hashlib.sha256(open(twins["gguf"], "rb").read()).hexdigest()
    argv = ["--target", pkg, "--data", twins["data"], *replace(SMALL, "--eval_fraction", "0"), "--max_steps", "2",
            "--batch_size", "2", "--eval_walk_prompts", "0", "--no_progress"]
    with torch_threads(1):
        dflash.main([*argv, "--out", str(tmp_path / "online")])
        features.main(["capture", "--target", pkg, "--data", twins["data"], "--out", str(tmp_path / "f"),
                       "--target_layer_ids", "1,2", "--eval_walk_prompts", "0", "--features_dtype", "fp32"])
        dflash.main([*argv, "--out", str(tmp_path / "feat"), "--features", str(tmp_path / "f")])
    manifest = json.load(open(tmp_path / "f" / "manifest.json"))
    assert (manifest["target"]["gguf"], manifest["target"]["sha256"]) == ("tiny.F32.gguf", sha)
    assert manifest["layers_digest"] == sha[:16]  # every tensor of a GGUF: the file's hash
    for run in ("online", "feat"):
        latest = open(tmp_path / run / "latest").read().strip()
        rec = json.load(open(tmp_path / run / latest / dflash.TARGET_RECORD))
        assert (rec["target"], rec["gguf"], rec["sha256"]) == (pkg, "tiny.F32.gguf", sha)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")  # chat-templated: ChatML
    with torch_threads(1):
        ev.main(["--target", twins["gguf"], "--drafter", str(tmp_path / "feat" / latest), "--prompts",
                 str(tmp_path / "p.jsonl"), "--max_new_tokens", "8", "--mode", "loop", "--json",
                 str(tmp_path / "tau.json"), "--no_progress"])
    assert [r["drafter"] for r in json.load(open(tmp_path / "tau.json"))["results"]][1:] == ["prompt-lookup"]
    meta = dflash.load_target(pkg, "meta")
    args = SimpleNamespace(target=pkg, dtype="fp32")
    embed, head = features.load_embedding_and_head(args, meta, torch.device("cpu"))
    st = dflash.load_target(twins["st"])
    assert torch.equal(embed.weight, st.embed.weight) and head.weight is embed.weight
    assert torch.equal(features.final_norm(args, meta, torch.device("cpu")).weight, st.norm.weight)


def test_spellings_that_are_not_one_gguf_are_refused(tmp_path):
    """A directory with two .gguf files names them and the fix; one with none, a missing path and another file
    each say what --target takes."""
    (tmp_path / "two").mkdir()
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / n).write_bytes(b"")
    refused(lambda: dflash.load_target(str(tmp_path / "two")), "2 .gguf files", "a.gguf, b.gguf", "name the one")
    (tmp_path / "none").mkdir()
    refused(lambda: dflash.load_target(str(tmp_path / "none")), "no config.json", "GGUF file")
    refused(lambda: dflash.load_target(str(tmp_path / "gone")), "no such directory or .gguf file")
    (tmp_path / "x.bin").write_bytes(b"")
    refused(lambda: dflash.load_target(str(tmp_path / "x.bin")), "is a file", ".gguf")


def test_without_the_gguf_package_a_gguf_target_is_one_error_line(twins):
    """dflash.py --plan on the GGUF with the gguf package unimportable: exit 2, one `error:` line naming the fix."""
    code = ("import runpy, sys; sys.modules['gguf'] = None; sys.argv = ['dflash.py', '--target', sys.argv[1], "
            "'--plan']; runpy.run_path('dflash.py', run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code, twins["gguf"]], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: "), r.stderr
    assert "pip install gguf" in err[0] and "tiny.F32.gguf" in err[0]


def test_the_bench_on_the_gguf_prints_the_step_ratio_and_the_flop_rate(twins, capsys):
    """features.py bench --target (the GGUF's directory): the online and from-capture step times, their ratio and the
    target forward's share; the drafter step's useful FLOPs (bench.drafter_flops) near what torch's FlopCounterMode
    counts as executed (within 0.5x-4x: the dense path also computes masked scores), and both rates against the
    machine's matmul rate, each figure what its parts make."""
    import re
    with torch_threads(1):
        features.main(["bench", "--target", os.path.dirname(twins["gguf"]), "--dtypes", "fp32", "--steps", "1",
                       "--max_len", "24", "--num_anchors", "4", "--block_size", "4", "--num_draft_layers", "1",
                       "--samples", "4", "--matmul_size", "128"])
    out = capsys.readouterr().out
    rate = float(re.search(r"fp32 matmul 128\^3 on 1 threads: ([\d.,]+) GFLOP/s", out)[1].replace(",", ""))
    on, feat, ratio = map(float, re.search(r"online ([\d.]+), from the capture ([\d.]+): ([\d.]+)x", out).groups())
    assert rate > 0 and on > 0 and feat > 0 and abs(ratio - on / feat) <= 0.005 + 2e-3 * ratio  # (4 digits printed)
    fwd, share = map(float, re.search(r"forward ([\d.]+) s, (\d+)% of the online step", out).groups())
    assert abs(share - 100 * fwd / on) <= 0.5 + 0.2 * fwd / on
    m = re.search(r"drafter step: ([\d.e+-]+) GFLOP useful .*, ([\d.e+-]+) executed .* capture ([\d.e+-]+) GFLOP/s "
                  r"useful, ([\d.e+-]+) executed: (\d+)% of the matmul rate", out)
    useful, executed, useful_rate, executed_rate, percent = map(float, m.groups())
    assert 0.5 <= executed / useful <= 4
    assert abs(useful_rate - useful / feat) <= 0.02 * useful_rate and abs(percent - 100 * executed_rate / rate) <= 1
