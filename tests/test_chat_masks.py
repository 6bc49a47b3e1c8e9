"""Loss masks of chat data: for every assistant turn, exactly the tokens the target generates at inference, under
templates written here that behave like the real families (Qwen3 think blocks, Llama-3 headers, plain text)."""

import json
from itertools import groupby

import pytest

import dflash
from dflash import DFlashError

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "</s>"]
WORDS = ["<unk>", "\n", "user", "assistant", "system", "<think>", "</think>", "User:", "Assistant:", "hi", "there",
         "good", "day", "bye", "ok", "sure", "thing", "hmm", "let", "me", "think", "be", "brief", "long", "short"]

# Qwen3-style: the assistant turn after the last user message carries a think block (empty reasoning renders as
# "<think>\n\n</think>\n\n"), earlier assistant turns do not; thinking off puts the empty block in the generation
# prompt.
QWEN3 = ("{% if messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
         "{% set ns = namespace(last_user=-1) %}"
         "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
         "{% for m in messages %}"
         "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
         "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
         "{% if loop.index0 > ns.last_user %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
         "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n"
         "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# Llama-3-style: a header per turn, <|eot_id|> ends every turn, the generation prompt is the assistant header.
LLAMA3 = ("<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
          "{{ m.content }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Plain text, no special end-of-turn token; END is "</s>" (the tokenizer's eos after each answer) or nothing.
PLAIN = ("{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n\n"
         "{% elif m.role == 'user' %}User: {{ m.content }}\n{% else %}Assistant: {{ m.content }}END\n{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")


def tokenizer(template, eos):
    """Word level; spaces separate words, every newline is its own token, special tokens are matched first."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS + SPECIAL)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split("\n", "isolated")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos,
                                   additional_special_tokens=SPECIAL)
    fast.chat_template = template
    return fast


def qwen3():  # as Qwen3 base tokenizers: eos <|endoftext|>; <|im_end|> comes from the target's generation_config
    return tokenizer(QWEN3, "<|endoftext|>")


QWEN_EOS = [SPECIAL.index("<|im_end|>") + len(WORDS)]
SYSTEM = [{"role": "system", "content": "be brief"}]
ONE = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "good day"}]
THREE = ONE + [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ok sure"},
               {"role": "user", "content": "thing"}, {"role": "assistant", "content": "hmm ok"}]


def encode(tok, messages, thinking=None, eos_ids=()):
    return dflash.encode_sample({"messages": messages}, tok, enable_thinking=thinking, eos_ids=eos_ids)


def spans(tok, ids, mask):
    """The loss spans as token strings, one list per maximal run of loss tokens."""
    toks = tok.convert_ids_to_tokens(ids)
    return [[t for t, _ in run] for m, run in groupby(zip(toks, mask), key=lambda x: x[1]) if m]


def roles(tok, ids):
    """The role of the turn each token belongs to, read off the rendered tokens (not from the code under test)."""
    toks, role, out = tok.convert_ids_to_tokens(ids), "system", []
    for i, t in enumerate(toks):
        if t in ("<|im_start|>", "<|start_header_id|>"):
            role = toks[i + 1]
        elif t in ("User:", "Assistant:"):
            role = t[:-1].lower()
        out.append(role)
    return out


def check(tok, messages, expected, **kw):
    ids, mask = encode(tok, messages, **kw)
    assert spans(tok, ids, mask) == expected
    assert not [t for t, m, r in zip(ids, mask, roles(tok, ids)) if m and r != "assistant"], "loss in a user turn"
    return ids, mask


NL = "\n"
EMPTY_THINK = ["<think>", NL, NL, "</think>", NL, NL]  # what the target generates first when thinking is on


@pytest.mark.parametrize("system", [[], SYSTEM])
def test_qwen3_thinking_on(system):
    """Thinking on (the template default, or set): the target generates the think block of the turn after the last
    user message, so it is in the loss; earlier turns are rendered (and learned) without one."""
    tok = qwen3()
    for thinking in (None, True):
        check(tok, system + ONE, [EMPTY_THINK + ["good", "day", "<|im_end|>"]], thinking=thinking, eos_ids=QWEN_EOS)
        check(tok, system + THREE, [["good", "day", "<|im_end|>"], ["ok", "sure", "<|im_end|>"],
                                    EMPTY_THINK + ["hmm", "ok", "<|im_end|>"]], thinking=thinking, eos_ids=QWEN_EOS)
    reasoned = system + ONE[:1] + [{"role": "assistant", "content": "good day", "reasoning_content": "let me think"}]
    check(tok, reasoned, [["<think>", NL, "let", "me", "think", NL, "</think>", NL, NL, "good", "day", "<|im_end|>"]],
          thinking=True, eos_ids=QWEN_EOS)


@pytest.mark.parametrize("system", [[], SYSTEM])
def test_qwen3_thinking_off(system):
    """Thinking off: the empty think block is part of the generation prompt, hence context; only answers are learned."""
    tok = qwen3()
    ids, mask = check(tok, system + ONE, [["good", "day", "<|im_end|>"]], thinking=False, eos_ids=QWEN_EOS)
    toks = tok.convert_ids_to_tokens(ids)
    assert toks[-len(EMPTY_THINK) - 4:-4] == EMPTY_THINK and not any(mask[-len(EMPTY_THINK) - 4:-4])
    assert toks[-1] == NL and mask[-1] == 0  # the template's newline after <|im_end|> is not generated
    check(tok, system + THREE, [["good", "day", "<|im_end|>"], ["ok", "sure", "<|im_end|>"],
                                ["hmm", "ok", "<|im_end|>"]], thinking=False, eos_ids=QWEN_EOS)


def test_qwen3_two_turns_original_bug():
    """The reported bug: turn 0's end was taken from rendering [user, assistant] alone, where that assistant turn is
    the last one and carries a think block (4 more tokens), so its mask ran into "<|im_start|>user\\n" and "bye"."""
    tok = qwen3()
    two = THREE[:4]
    ids, mask = encode(tok, two, eos_ids=QWEN_EOS)
    toks = tok.convert_ids_to_tokens(ids)
    end = toks.index("<|im_end|>", toks.index("good"))
    assert toks[end + 1:end + 6] == [NL, "<|im_start|>", "user", NL, "bye"]
    assert mask[end - 2:end + 6] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert spans(tok, ids, mask) == [["good", "day", "<|im_end|>"], EMPTY_THINK + ["ok", "sure", "<|im_end|>"]]


@pytest.mark.parametrize("system", [[], SYSTEM])
def test_llama3(system):
    """Every turn ends at <|eot_id|> (the tokenizer's eos); the header and its blank line are the generation prompt.
    The template does not read enable_thinking, so the flag changes nothing."""
    tok = tokenizer(LLAMA3, "<|eot_id|>")
    for thinking in (None, True, False):
        check(tok, system + ONE, [["good", "day", "<|eot_id|>"]], thinking=thinking)
        check(tok, system + THREE, [["good", "day", "<|eot_id|>"], ["ok", "sure", "<|eot_id|>"],
                                    ["hmm", "ok", "<|eot_id|>"]], thinking=thinking)


@pytest.mark.parametrize("system", [[], SYSTEM])
def test_plain_template(system):
    """No special end-of-turn token. With the eos rendered after each answer, the target stops there: the span is the
    answer and </s>, never the newline after it. Without one, nothing stops the target inside the turn; the turn is
    then what the template renders for it, through its newline (it separates the answer from the next "User:")."""
    with_eos = tokenizer(PLAIN.replace("END", "</s>"), "</s>")
    for thinking in (None, False):
        check(with_eos, system + ONE, [["good", "day", "</s>"]], thinking=thinking)
        check(with_eos, system + THREE, [["good", "day", "</s>"], ["ok", "sure", "</s>"], ["hmm", "ok", "</s>"]],
              thinking=thinking)
    no_eos = tokenizer(PLAIN.replace("END", ""), "</s>")
    check(no_eos, system + ONE, [["good", "day", NL]])
    check(no_eos, system + THREE, [["good", "day", NL], ["ok", "sure", NL], ["hmm", "ok", NL]])
    ids, mask = dflash.encode_sample({"prompt": "hi", "response": "ok"}, no_eos)  # prompt/response: the same path
    assert spans(no_eos, ids, mask) == [["ok", NL]]


def test_ambiguous_spans_are_errors_naming_file_line_and_turn(tmp_path):
    # a template that renders earlier turns differently depending on the whole conversation
    rewrites = tokenizer("{% if messages|length > 2 %}long{% else %}short{% endif %}\n" + LLAMA3, "<|eot_id|>")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": ONE}) + "\n" + json.dumps({"messages": THREE[:4]}) + "\n")
    with pytest.raises(DFlashError, match=rf"{data}:2: assistant turn 1: .*differently"):
        dflash.load_samples(str(data), rewrites, 64)
    # Qwen3 without the target's eos ids: nothing ends turn 1 before the next turn, and rendering it alone adds a
    # think block, so the end of the turn is unknown
    with pytest.raises(DFlashError, match=r"x:7: assistant turn 1: no eos token"):
        dflash.encode_sample({"messages": THREE[:4]}, qwen3(), where="x:7")
    with pytest.raises(DFlashError, match=r"x:8: messages must be"):
        dflash.encode_sample({"messages": [{"content": "hi"}]}, qwen3(), where="x:8")
    with pytest.raises(DFlashError, match=r"x:9: the chat template fails"):
        dflash.encode_sample({"messages": ONE}, tokenizer("{{ raise_exception('no') }}", "</s>"), where="x:9")


def test_load_samples_passes_thinking_and_eos(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": THREE[:4]}) + "\n")
    tok = qwen3()
    [(ids, mask)] = dflash.load_samples(str(data), tok, 64, enable_thinking=False, eos_ids=QWEN_EOS)
    assert spans(tok, ids, mask) == [["good", "day", "<|im_end|>"], ["ok", "sure", "<|im_end|>"]]


def test_show_data_cli(tmp_path, capsys):
    """--show_data prints the masks and exits before any drafter or checkpoint exists; the target's eos ids (its
    generation_config) and --no-enable_thinking reach the encoder."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tok = qwen3()
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, vocab_size=64, eos_token_id=QWEN_EOS[0])
    target = tmp_path / "target"
    Qwen3ForCausalLM(cfg).save_pretrained(target)
    tok.save_pretrained(target)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"messages": THREE[:4]}, {"prompt": "hi", "response": "ok"},
                                                           {"text": "hi there"}]))
    out = tmp_path / "out"
    dflash.main(["--target", str(target), "--data", str(data), "--out", str(out), "--show_data", "2",
                 "--no-enable_thinking"])
    text = capsys.readouterr().out
    assert "sample 0: 33 tokens, 6 loss tokens, 4 usable anchors" in text
    assert "[[good day <|im_end|>]]" in text and "[[ok sure <|im_end|>]]" in text
    assert "</think> \n \n[[ok sure" in text  # the generation prompt's empty think block is context
    assert "sample 1:" in text and "sample 2:" not in text
    assert not out.exists()
