"""Shared test helpers: the repository root on sys.path, tiny Hugging Face targets, a tiny drafter config, z-lab
drafter directories, a tiny tokenizer, pre-tokenized training data, and the one_thread fixtures.

Test files import the plain helpers with `from conftest import ...` (pytest puts tests/ on sys.path); fixtures
defined here are found by name."""

import json
import math
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # `import dflash`, `import eval` whichever test file runs alone

import dflash  # noqa: E402

VOCAB = 96
CYCLE = [7, 23, 41, 60, 88]

# dflash.py command-line flags for a small drafter over tiny_qwen3()'s default geometry
SMALL = ["--mask_token_id", str(VOCAB - 1), "--num_heads", "4", "--num_kv_heads", "2", "--head_dim", "8",
         "--num_draft_layers", "2", "--target_layer_ids", "1,2", "--block_size", "4", "--sliding_window", "8",
         "--num_anchors", "6", "--lr", "3e-3", "--warmup_ratio", "0.1", "--log_every", "1", "--eval_every", "0",
         "--save_every", "0", "--eval_fraction", "0"]


# -----------------------------------------------------------------------------
# Threads


@contextmanager
def torch_threads(n):
    """Run with n intra-op threads, restoring the previous number after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pytest_configure(config):
    config.addinivalue_line("markers", "all_threads: the one_thread fixture leaves this test's thread count alone")


@pytest.fixture
def one_thread(request):
    """Tiny models run many small ops: on a shared, oversubscribed CPU, extra intra-op threads only add waiting
    (seconds, not ms). A test marked all_threads keeps the default."""
    if request.node.get_closest_marker("all_threads"):
        yield
        return
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_module():
    """one_thread for a whole module, module-scoped fixtures included (use it before them)."""
    with torch_threads(1):
        yield


# -----------------------------------------------------------------------------
# Tiny Hugging Face targets. build_*: the model in memory (seeded, so the same weights every time); tiny_*: the
# same model saved as a Hugging Face directory at path, whose str is returned. Keyword arguments override the
# config fields below.

TINY_TARGET = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
# the Qwen3.5 hybrid layout: three Gated DeltaNet (linear attention) layers, then one full-attention layer
TINY_HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                   layer_types=["linear_attention"] * 3 + ["full_attention"])
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, num_position_embeddings=16)  # out_hidden_size: the text hidden size


def build_qwen3(**config):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**{**TINY_TARGET, **config}))


def build_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_TARGET, **config}))


def build_qwen35(**config):
    """The Qwen3.5 hybrid text model (Qwen3_5ForCausalLM)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TINY_TARGET, **TINY_HYBRID, **config}))


def build_qwen35_multimodal(**config):
    """The Qwen3.5 multimodal class (Qwen3_5ForConditionalGeneration): the hybrid text model plus a tiny vision
    tower; config overrides the text config."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    text = {**TINY_TARGET, **TINY_HYBRID, **config}
    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(
        text_config=text, vision_config={**TINY_VISION, "out_hidden_size": text["hidden_size"]}))


# Other families, as a new user's own small model would be (tests/test_families.py): name -> (config class, model
# class, the config fields that make the family what it is on top of TINY_TARGET). Token ids 0-2 are pad, bos and eos
# (the families' defaults lie outside a 96-token vocabulary).
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),  # Llama-3.2, Qwen3-0.6B..4B
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    # tied, sqrt(D)-scaled embedding, sliding and full layers with a RoPE base each (rope_parameters per layer type)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"], **IDS)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", IDS),             # fused qkv_proj and gate_up_proj
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", IDS),          # norms after attention and MLP, q/k norm over heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
}


def build_family(name, **config):
    """A tiny model of FAMILIES[name] (seeded), config overriding its fields."""
    import transformers
    config_cls, model_cls, fields = FAMILIES[name]
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**TINY_TARGET, **fields, **config}))


def tiny_family(path, name, **config):
    build_family(name, **config).save_pretrained(path)
    return str(path)


def tiny_gpt2(path):
    """GPT-2 (transformer.h, ln_f, learned positions): a family dflash does not support."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=256, **IDS)
                    ).save_pretrained(path)
    return str(path)


def tiny_qwen3(path, **config):
    build_qwen3(**config).save_pretrained(path)
    return str(path)


def tiny_llama(path, **config):
    build_llama(**config).save_pretrained(path)
    return str(path)


def tiny_qwen35(path, **config):
    build_qwen35(**config).save_pretrained(path)
    return str(path)


def tiny_qwen35_multimodal(path, **config):
    build_qwen35_multimodal(**config).save_pretrained(path)
    return str(path)


# -----------------------------------------------------------------------------
# The tiny drafter config

TINY_CFG = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, vocab_size=97, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256,
                block_size=4, mask_token_id=96, target_layer_ids=[1, 3], num_target_layers=5,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=6)


def tiny_cfg(*presets, **overrides):
    """A tiny DFlashConfig: TINY_CFG, then each preset dict in order, then the keyword overrides."""
    base = dict(TINY_CFG)
    for p in presets:
        base.update(p)
    base.update(overrides)
    if "selector_top_k" in base:  # a DFlash2 config
        from dflash_tools import dflash2
        return dflash2.Config(**base)
    return dflash.DFlashConfig(**base)


# -----------------------------------------------------------------------------
# Drafter directories in the z-lab layout, written by hand (not from dflash's helpers): config.json as z-lab
# writes it (flat rope_theta, nested dflash_config) and model.safetensors with the z-lab key names (no `model.`
# prefix, no embedding, no lm_head).

# geometry: D hidden, layers, heads, kv heads, hd head_dim, inter intermediate, V vocab, M mask id,
# T target_layer_ids, L num_target_layers, Bs block_size, Wz sliding_window
ZL = dict(D=32, layers=3, heads=4, kv=2, hd=8, inter=40, V=120, M=117, T=[1, 4], L=6, Bs=8, Wz=5)


def zlab_tensors(z=ZL, seed=0, scale=0.2, norm_scale=0.2, dtype=torch.bfloat16):
    """Random tensors under the z-lab names: weights scale * N(0, 1), norms 1 + norm_scale * N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (scale * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    n = lambda *s: 1 + (norm_scale * torch.randn(*s, generator=g)).to(dtype)  # noqa: E731
    t = {"fc.weight": r(z["D"], len(z["T"]) * z["D"]), "hidden_norm.weight": n(z["D"]), "norm.weight": n(z["D"])}
    for i in range(z["layers"]):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = n(z["D"])
        t[p + "post_attention_layernorm.weight"] = n(z["D"])
        t[p + "self_attn.q_proj.weight"] = r(z["heads"] * z["hd"], z["D"])
        t[p + "self_attn.k_proj.weight"] = r(z["kv"] * z["hd"], z["D"])
        t[p + "self_attn.v_proj.weight"] = r(z["kv"] * z["hd"], z["D"])
        t[p + "self_attn.o_proj.weight"] = r(z["D"], z["heads"] * z["hd"])
        t[p + "self_attn.q_norm.weight"] = n(z["hd"])
        t[p + "self_attn.k_norm.weight"] = n(z["hd"])
        t[p + "mlp.gate_proj.weight"] = r(z["inter"], z["D"])
        t[p + "mlp.up_proj.weight"] = r(z["inter"], z["D"])
        t[p + "mlp.down_proj.weight"] = r(z["D"], z["inter"])
    return t


def zlab_config(z=ZL, rope="flat", **over):
    """config.json contents; rope "flat" (rope_theta, rope_scaling) or "nested" (transformers 5's rope_parameters)."""
    c = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": z["Bs"], "bos_token_id": 1,
        "dflash_config": {"mask_token_id": z["M"], "target_layer_ids": z["T"]}, "eos_token_id": 2,
        "head_dim": z["hd"], "hidden_act": "silu", "hidden_size": z["D"], "initializer_range": 0.02,
        "intermediate_size": z["inter"], "layer_types": ["sliding_attention"] * (z["layers"] - 1) + ["full_attention"],
        "max_position_embeddings": 40960, "max_window_layers": z["layers"], "model_type": "qwen3",
        "num_attention_heads": z["heads"], "num_hidden_layers": z["layers"], "num_key_value_heads": z["kv"],
        "num_target_layers": z["L"], "rms_norm_eps": 1e-6, "sliding_window": z["Wz"], "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "transformers_version": "4.57.1", "use_cache": True, "use_sliding_window": True,
        "vocab_size": z["V"],
    }
    if rope == "flat":
        c.update(rope_theta=1000000, rope_scaling=None)
    else:  # transformers 5 writes rope_parameters
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0}
    c.update(over)
    return c


def write_zlab_dir(path, config, tensors, shards=1):
    """config.json and model.safetensors at path; shards > 1: model-0000k-of-0000n.safetensors plus the index."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::shards]}
        save_file(part, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


# -----------------------------------------------------------------------------
# Data

TOKENIZER_WORDS = ["<unk>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>", "hi", "there", "good", "day", "bye", "ok",
                   "sure", "thing", "hello", "world", "a", "b", "c"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tiny_tokenizer(chat_template=True, words=TOKENIZER_WORDS, **special_tokens):
    """A whitespace word-level tokenizer (word i has id i). chat_template: True for CHAT_TEMPLATE, a template
    string, or False for none. special_tokens default to unk <unk> and pad <pad>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **(special_tokens or {"unk_token": "<unk>",
                                                                               "pad_token": "<pad>"}))
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE if chat_template is True else chat_template
    return fast


def write_data(path, n, seed=0, prompt=6, response=18):
    """Pre-tokenized samples: a random prompt, then a response cycling through five fixed tokens from a random
    phase (learnable by a tiny drafter in a few steps: the next tokens depend only on the anchor token)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            p = [rng.randrange(VOCAB - 1) for _ in range(prompt)]
            phase = rng.randrange(len(CYCLE))
            r = [CYCLE[(phase + k) % len(CYCLE)] for k in range(response)]
            f.write(json.dumps({"input_ids": p + r, "loss_mask": [0] * prompt + [1] * response}) + "\n")
    return str(path)


def write_lines(path, lines):
    """Each line plus a newline, to the pathlib.Path path; returns str(path)."""
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def loss_of(drafter, target, batch, anchors, valid, gamma=4.0, **kw):
    """dflash_loss of a plain drafter with the CE's weights (gamma) on these anchors: (loss, stats)."""
    w = dflash.loss_weights(anchors, valid, batch["loss_mask"], drafter.cfg.block_size, gamma)
    return dflash.dflash_loss(drafter, drafter.cfg, target, batch, anchors, valid, w, **kw)


# -----------------------------------------------------------------------------
# The dense eval target: a tiny Qwen3 wider than TINY_TARGET, its greedy continuations and a briefly trained
# drafter (test_eval, test_tau_modes)

NEW_TOKENS = 32
# the tiny targets here: wider than conftest's default, with longer positions
DENSE_TARGET = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16,
                    max_position_embeddings=512)
# tiny_cfg overrides for a drafter over those targets
DENSE_DRAFTER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16, vocab_size=VOCAB,
                     max_position_embeddings=512, block_size=8, mask_token_id=VOCAB - 1, target_layer_ids=[1, 2],
                     num_target_layers=4, layer_types=["sliding_attention", "full_attention"], sliding_window=16)


def reference_greedy(target, prompt, n):
    """Plain greedy decoding by the target itself (HF generate), independent of eval.py."""
    x = torch.tensor([prompt])
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(prompt):].tolist()


def train_on_continuations(target, drafter, prompts, continuations, steps):
    """A few optimizer steps of the real loss on the target's own continuations (regenerated data)."""
    batch = dflash.collate([(p + c, [0] * len(p) + [1] * len(c)) for p, c in zip(prompts, continuations)], 0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for step in range(steps):
        anchors, valid = dflash.batch_anchors(batch, 24, salt=step)
        loss, _ = loss_of(drafter, target, batch, anchors, valid, noise_std=0.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A tiny Qwen3 target, its greedy continuations of 6 random prompts, and a drafter trained on them briefly
    (random targets fall into repetitive continuations, which a few steps teach the drafter to draft)."""
    path = str(tmp_path_factory.mktemp("dense") / "target")
    target = dflash.load_target(tiny_qwen3(path, **DENSE_TARGET))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (8,), generator=g).tolist() for _ in range(6)]
    continuations = [reference_greedy(target, p, NEW_TOKENS) for p in prompts]
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(tiny_cfg(DENSE_DRAFTER))
    drafter = train_on_continuations(target, drafter, prompts, continuations, steps=30)
    return {"path": path, "target": target, "prompts": prompts, "continuations": continuations, "drafter": drafter}


# -----------------------------------------------------------------------------
# The visibility rule, written out as a brute-force oracle (test_drafter, test_windows)


def visible(a, valid, i, kind, idx, causal, window, same_block=True):
    """Query: offset i of the block anchored at a, at position a+i. Key: ("ctx", j) at position j, or ("blk", i')
    at position a+i'. Context keys exist strictly before the anchor; block keys are the query's own block (only
    i' <= i in a causal layer). A sliding layer then keeps a key only if q_pos - k_pos < W, and, when it is
    explicitly non-causal, also k_pos - q_pos < W."""
    if not valid:
        return False
    q_pos = a + i
    if kind == "ctx":
        k_pos, ok = idx, idx < a
    else:
        k_pos, ok = a + idx, same_block and (not causal or idx <= i)
    if window is not None:
        ok = ok and q_pos - k_pos < window
        if not causal:
            ok = ok and k_pos - q_pos < window
    return ok


# -----------------------------------------------------------------------------
# Command lines


def one_error(capsys, main, argv, *needles, progress=False):
    """main(argv) exits 2 with exactly one stderr line, an `error:` line holding every needle (progress: after the
    training bar, which also writes to stderr, the last line)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    err = err[-1:] if progress and sum(x.startswith("error:") for x in err) == 1 else err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for n in needles:
        assert n in err[0], (n, err[0])
    return err[0]


def refused(fn, *needles):
    """fn() raises one DFlashError line holding every needle."""
    with pytest.raises(dflash.DFlashError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def tree_bytes(d):
    """{relative path: bytes} of every file under d: what a refused run must leave as it was."""
    out = {}
    for root, _, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, d)] = fh.read()
    return out


# -----------------------------------------------------------------------------
# Flags


def flag_edges(action):
    """(smallest, largest) value a numeric flag's rule accepts ("an integer >= 1", "a number > 0 and <= 1"): the
    next representable value above an open bound, and a huge one (10**18, the largest float) where there is no
    upper bound."""
    import math
    import re
    m = re.fullmatch(r"(an integer|a number) (>=|>) (\S+)(?: and <= (\S+))?", action.type.text)
    assert m, action.type.text
    if m[1] == "an integer":
        return int(m[3]) + (m[2] == ">"), int(m[4]) if m[4] else 10 ** 18
    lo = float(m[3])
    return math.nextafter(lo, math.inf) if m[2] == ">" else lo, float(m[4]) if m[4] else sys.float_info.max


# -----------------------------------------------------------------------------
# Float64 references of the drafter, from the specification (test_drafter, test_dflash2): O(1) random drafters,
# block inputs written out, RMSNorm, RoPE, the attention sublayer, and a batch of anchors of every kind

V, D, HD, B, W = (TINY_CFG[k] for k in ("vocab_size", "hidden_size", "head_dim", "block_size", "sliding_window"))
MASK_ID = TINY_CFG["mask_token_id"]


def randomize(module, seed, scale=0.3):
    """Every parameter of module drawn N(0, scale^2) from its own generator (in place): no identity left anywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def randomized(cfg, seed=0):
    """A drafter with O(1) random weights everywhere, norms included, so a misplaced norm or a wrong mask shows."""
    torch.manual_seed(seed)
    d = cfg.Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[1]))
    return d.eval()


def block_ids(tokens, anchors):
    """[tok[a], M, ..., M] per anchor, written here rather than taken from dflash."""
    ids = torch.full((*anchors.shape, B), MASK_ID, dtype=torch.long)
    for r in range(anchors.shape[0]):
        for n in range(anchors.shape[1]):
            ids[r, n, 0] = tokens[r, anchors[r, n]]
    return ids


S = 24  # context length, larger than the window W
# anchors at 0, 1, near the end (23 = S-1: the block runs past the end), duplicates/overlaps, and padding anchors
ANCHORS = torch.tensor([[0, 1, 2, 5, 6, 11, 20, 22, 23, 0],
                        [3, 3, 4, 9, 17, 23, 0, 0, 7, 0]])
VALID = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1, 1, 0],
                      [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)


def ref_rms(x, w, eps=1e-6):
    return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta=10000.0):
    """x (T, heads, hd), positions pos (T,): rotate-half RoPE over the full head_dim."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.double()[:, None] * inv[None]                       # (T, hd/2)
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def ref_attention(hn, ctx, P, p, a, cfg, causal):
    """One block's attention sublayer in float64 from the weights P of layer prefix p: hn (B, D) the normed block,
    ctx (a, D) the context before the anchor a. A block token sees the context (within the window on a sliding
    layer) and its own block (earlier offsets only when causal). Returns o_proj's output (B, D)."""
    B, HD, W = cfg.block_size, cfg.head_dim, cfg.sliding_window
    nh, nk = cfg.num_attention_heads, cfg.num_key_value_heads
    sliding = cfg.layer_types[int(p.split(".")[1])] == "sliding_attention"
    kv_in = torch.cat([ctx, hn], 0)                                       # [ctx ; block]
    kv_pos = torch.cat([torch.arange(a), a + torch.arange(B)])
    q = ref_rms((hn @ P[p + "self_attn.q_proj.weight"].T).view(B, nh, HD), P[p + "self_attn.q_norm.weight"])
    k = ref_rms((kv_in @ P[p + "self_attn.k_proj.weight"].T).view(-1, nk, HD), P[p + "self_attn.k_norm.weight"])
    v = (kv_in @ P[p + "self_attn.v_proj.weight"].T).view(-1, nk, HD)
    q, k = ref_rope(q, a + torch.arange(B)), ref_rope(k, kv_pos)
    out = torch.zeros(B, nh, HD, dtype=torch.float64)
    for hh in range(nh):
        kh = hh // (nh // nk)
        for i in range(B):
            keys = [j for j in range(a) if not sliding or (a + i) - j < W]
            keys += [a + i2 for i2 in range(B) if not causal or i2 <= i]
            s = torch.stack([q[i, hh] @ k[j, kh] for j in keys]) / math.sqrt(HD)
            out[i, hh] = torch.softmax(s, 0) @ v[keys, kh]
    return out.reshape(B, nh * HD) @ P[p + "self_attn.o_proj.weight"].T


def cache_kv(cache, cfg):
    if cache.kv is None:  # anchor at 0: no context at all
        z = torch.zeros(1, 0, cfg.num_key_value_heads, cfg.head_dim)
        return [(z, z)] * cfg.num_hidden_layers
    return cache.kv


# -----------------------------------------------------------------------------
# A tiny run's files and command line, for tests of refusals (test_hostile, test_advice)


@pytest.fixture(scope="module")
def w(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    q3 = tiny_qwen3(d / "q3")
    data = write_data(d / "data.jsonl", 8)
    base = ["--target", q3, "--data", data, "--max_steps", "2", "--batch_size", "2", "--grad_accum", "1", *SMALL]
    return {"dir": d, "q3": q3, "data": data, "base": base}


@pytest.fixture(scope="module")
def trained(w):
    """One real run of two steps, a checkpoint after each: out/step_1, out/step_2, out/latest -> step_2."""
    out = str(w["dir"] / "run")
    dflash.main(w["base"] + ["--out", out, "--save_every", "1"])
    assert sorted(n for n in os.listdir(out) if n.startswith("step_")) == ["step_1", "step_2"]
    return out


def fails_with(capsys, argv, *needles):
    """dflash.main(argv) ends in one `error:` line, whatever the runs before it printed to stderr."""
    return one_error(capsys, dflash.main, argv, *needles, progress=True)


def replace(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


# -----------------------------------------------------------------------------
# A hostile OpenAI-style server on 127.0.0.1 for regenerate (test_regenerate_hostile, test_regenerate): bounded in
# requests and lifetime, every answer chosen by the test

MAX_REQUESTS = 400
LIFETIME_S = 120.0


class Reply:
    """One answer: status, headers, body; `trickle` seconds between single bytes (headers and body alike)."""

    def __init__(self, body=b"", status=200, headers=None, trickle=None, delay=0.0):
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.status, self.headers, self.trickle, self.delay = status, headers or {}, trickle, delay


def completion(text, finish="stop", **extra):
    return Reply({"choices": [{"text": text, "finish_reason": finish}], "usage": {"prompt_tokens": 3,
                                                                                    "completion_tokens": 2}, **extra})


def echo(req):
    """The well-behaved answer: the prompt's own words back, so each answer shows which prompt it answers."""
    prompt = req.get("prompt") or json.dumps(req.get("messages"))
    return completion("answer to " + prompt.split("<|user|>")[-1].split("<|end|>")[0].strip())


def is_check(req):
    """regenerate's one-token request before a run."""
    return req.get("max_tokens") == 1


class Hostile:
    """A local server answering each POST with answer(request json, n) -> Reply; it records the requests."""

    def __init__(self, answer):
        self.answer, self.requests, self.lock = answer, [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    n = len(outer.requests)
                    outer.requests.append(json.loads(body))
                if n >= MAX_REQUESTS:
                    self.close_connection = True
                    return
                r = outer.answer(outer.requests[-1], n)
                time.sleep(r.delay)
                head = f"HTTP/1.1 {r.status} X\r\nContent-Length: {len(r.body)}\r\nConnection: close\r\n" + \
                    "".join(f"{k}: {v}\r\n" for k, v in r.headers.items()) + "\r\n"
                data = head.encode() + r.body
                try:
                    if r.trickle is None:
                        self.wfile.write(data)
                    else:
                        for i in range(len(data)):
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                            time.sleep(r.trickle)
                except OSError:  # the client gave up
                    pass
                self.close_connection = True

            do_GET = do_POST

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that hung up mid-request: not news here
                pass

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.timer = threading.Timer(LIFETIME_S, self.close)
        self.timer.daemon = True
        self.timer.start()

    def close(self):
        self.timer.cancel()
        self.httpd.shutdown()
        self.httpd.server_close()

    def samples(self):
        """The requests for samples (not the one-token check)."""
        return [r for r in self.requests if not is_check(r)]


# -----------------------------------------------------------------------------
# The demo at a size of seconds (test_standalone, test_dflash2)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory):
    """One cache for every reduced demo of the session: its tiny target and data are built once."""
    return str(tmp_path_factory.mktemp("demo_cache"))


@pytest.fixture
def small_demo(demo_cache, monkeypatch):
    """run(out, *flags): `dflash.py --demo` as main() runs it (build the tiny target, regenerate its data, train,
    measure tau, write the report), with few pretraining steps, samples, prompts, tokens and training steps."""
    from dflash_tools import demo, tiny_target
    monkeypatch.setattr(demo, "CACHE", demo_cache)
    for name, value in (("DEMO_PRETRAIN_STEPS", 2), ("DEMO_TRAIN_SAMPLES", 48), ("DEMO_PROMPTS", 2),
                        ("DEMO_NEW_TOKENS", 8)):
        monkeypatch.setattr(demo, name, value)
    monkeypatch.setattr(tiny_target, "CORPUS_MAX_BYTES", 300_000)
    monkeypatch.setattr(tiny_target, "TOKENIZER_MAX_BYTES", 300_000)

    def run(out, *flags):
        with torch_threads(1):
            dflash.main(["--demo", *flags, "--out", str(out), "--max_steps", "3", "--eval_walk_prompts", "2",
                         "--eval_walk_tokens", "8"])
    return run


def signalling_step(sig, at=2):
    """dflash.train_step that sends sig to this process before its at-th call (a scheduler's signal mid-run)."""
    real, n = dflash.train_step, []

    def step(*a, **k):
        n.append(1)
        if len(n) == at:
            os.kill(os.getpid(), sig)
        return real(*a, **k)
    return step
