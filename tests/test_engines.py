"""A drafter directory is the contract with the serving engines. Both vLLM and SGLang load config.json through
transformers' own config class for its model_type (AutoConfig: defaults such as head_dim 128 and derived fields such
as layer_types are transformers'), then read the DFlash keys from that object. The engines' rules are re-typed below
from their sources (vLLM qwen3_dflash.py, eagle3_utils.py; SGLang models/dflash.py, speculative/dflash_utils.py),
independently of dflash.py, and applied to transformers' real config object. Where both serve one drafter, dflash.py
reads exactly that drafter; where they differ or either refuses, dflash.py refuses the config in one line."""

import json
import os

import pytest
import torch

import dflash
from dflash_tools import engines
from conftest import ZL, one_error, tiny_cfg, tiny_qwen3, write_zlab_dir, zlab_config, zlab_tensors
from dflash import DFlashError

SLIDING = "sliding_attention"


class Refuses(Exception):
    """The engine would not serve this config (it raises at load)."""


def hf(c):
    """config.json as both engines hold it: transformers' own config class for its model_type."""
    from transformers import AutoConfig
    return AutoConfig.for_model(**json.loads(json.dumps(c)))


def attr(h, k, default=None):
    return getattr(h, k, default)


def vllm_aux_ids(h):
    """vLLM's aux hidden-state ids (target id + 1), first found of: eagle_aux_hidden_state_layer_ids, dflash_config.
    target_layer_ids + 1, dspark_target_layer_ids + 1, target_layer_ids + 1, dflash_config/eagle_config.layer_ids as
    they are; none: the target model's own default EAGLE-3 layers."""
    dc = attr(h, "dflash_config") or {}
    ids = attr(h, "eagle_aux_hidden_state_layer_ids")
    for raw in (dc.get("target_layer_ids"), attr(h, "dspark_target_layer_ids"), attr(h, "target_layer_ids")):
        ids = ids or ([t + 1 for t in raw] if raw else None)
    ids = ids or dc.get("layer_ids") or (attr(h, "eagle_config") or {}).get("layer_ids")
    return list(ids) if ids else "the target model's default layers"


def vllm_layer(h, i):
    """(causal, window) of layer i in vLLM: sliding from layer_types (every layer with use_swa when none is listed);
    window dflash_config.swa_window_size, else sliding_window; causal: is_causal, else dflash_config.causal, else
    iff layer_types[i] is sliding. A bidirectional sliding layer is windowed on both sides."""
    dc, types = attr(h, "dflash_config") or {}, attr(h, "layer_types")
    use_swa = dc.get("use_swa", False)
    sliding = use_swa if types is None or (use_swa and SLIDING not in types) else types[i] == SLIDING
    window = dc.get("swa_window_size", attr(h, "sliding_window")) if sliding else None
    if sliding and window is None:
        raise Refuses("vLLM: a sliding layer without a window")
    if attr(h, "is_causal") is not None:
        causal = bool(h.is_causal)
    elif dc.get("causal") is not None:
        causal = bool(dc["causal"])
    else:
        causal = bool(types) and types[i] == SLIDING
    return causal, window


def vllm_serves(h):
    dc = attr(h, "dflash_config") or {}
    drafter = {**(attr(h, "eagle_config") or {}), **dc}  # eagle_config, updated by dflash_config
    if h.hidden_act != "silu":
        raise Refuses("vLLM: only silu")
    aux = vllm_aux_ids(h)
    use_aux = drafter.get("use_aux_hidden_state", attr(h, "use_aux_hidden_state", True))
    width = attr(h, "target_hidden_size") or h.hidden_size
    return dict(layers=[vllm_layer(h, i) for i in range(h.num_hidden_layers)], aux=aux,
                mask=drafter.get("mask_token_id", attr(h, "mask_token_id")),
                fc_in=width * len(aux) if use_aux and isinstance(aux, list) else None,
                head_dim=attr(h, "head_dim") or h.hidden_size // h.num_attention_heads, kv=h.num_key_value_heads,
                logit_scale=attr(h, "logit_scale", 1.0), embed_scale=attr(h, "input_embedding_scale", 1.0),
                vocab=attr(h, "draft_vocab_size") or h.vocab_size)  # a smaller draft vocabulary mapped through d2t


def sglang_spread(L, n):
    """SGLang's ids for a config that names none: evenly from 1 to L-3 (one layer: L // 2)."""
    return [L // 2] if n == 1 else [round(1 + i * (L - 4) / (n - 1)) for i in range(n)]


def sglang_serves(h):
    """SGLang: ids from dflash_config, else the top level, else its spread; it captures layer inputs (id + 1), so never
    the last layer. layer_types missing: every layer full and bidirectional; a full layer bidirectional and a sliding
    one causal with window sliding_window, unless the top-level is_causal says otherwise. A bidirectional sliding
    layer is windowed on the left only: with block_size B > W, later block keys stay visible."""
    dc = attr(h, "dflash_config") or {}
    if h.hidden_act != "silu":
        raise Refuses("SGLang: only silu")
    n, L = h.num_hidden_layers, dc.get("num_target_layers", attr(h, "num_target_layers"))
    ids = dc.get("target_layer_ids", attr(h, "target_layer_ids")) or sglang_spread(L, n)
    if max(ids) >= L - 1:
        raise Refuses("SGLang: cannot capture the last layer")
    B = dc.get("block_size", attr(h, "block_size")) or 16
    types, causal_all, layers = attr(h, "layer_types"), attr(h, "is_causal"), []
    for i in range(n):
        sliding = bool(types) and types[i] == SLIDING
        causal = bool(causal_all) if causal_all is not None else sliding
        window = attr(h, "sliding_window") if sliding else None
        if sliding and window is None:
            raise Refuses("SGLang: a sliding layer without sliding_window")
        if sliding and not causal and window < B:
            window = ("left side only", window)
        layers.append((causal, window))
    return dict(layers=layers, aux=[t + 1 for t in ids], mask=dc.get("mask_token_id", attr(h, "mask_token_id")),
                fc_in=h.hidden_size * len(ids), head_dim=attr(h, "head_dim", h.hidden_size // h.num_attention_heads),
                kv=attr(h, "num_key_value_heads", h.num_attention_heads), logit_scale=1.0, embed_scale=1.0,
                vocab=h.vocab_size)


def served(c):
    """{engine: what it serves, or why it refuses}, from transformers' config object."""
    try:
        h = hf(c)
    except Exception as e:  # transformers' config class refuses it: so do both engines
        return {"vLLM": f"transformers: {e}", "SGLang": f"transformers: {e}"}
    out = {}
    for engine, rule in (("vLLM", vllm_serves), ("SGLang", sglang_serves)):
        try:
            out[engine] = rule(h)
        except Refuses as e:
            out[engine] = str(e)
    return out


def ours(cfg):
    """What dflash.py trains and measures for this config, in the terms above."""
    ids = cfg.target_layer_ids
    return dict(layers=kinds(cfg), aux=[t + 1 for t in ids], mask=cfg.mask_token_id,
                fc_in=cfg.hidden_size * len(ids), head_dim=cfg.head_dim, kv=cfg.num_key_value_heads, logit_scale=1.0,
                embed_scale=1.0, vocab=cfg.vocab_size)


def kinds(cfg):
    return [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]


def read(c):
    return dflash.config_from_json(json.loads(json.dumps(c)))


def refused(c, *needles):
    with pytest.raises(DFlashError) as e:
        read(c)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
    return msg


# -----------------------------------------------------------------------------
# Reading: what both engines would serve is what is trained and evaluated here

def zlab_qwen36_27b():
    """z-lab/Qwen3.6-27B-DFlash's config.json as published (their values; the layout z-lab writes)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 5120,
            "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 248320, "rms_norm_eps": 1e-6, "rope_theta": 10000000, "rope_scaling": None,
            "max_position_embeddings": 262144, "block_size": 16, "num_target_layers": 64,
            "layer_types": [SLIDING] * 4 + ["full_attention"], "sliding_window": 2048, "use_sliding_window": True,
            "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}}


def zlab_qwen3_8b():
    """z-lab/Qwen3-8B-DFlash-b16: five full-attention layers over Qwen3-8B's 36 (its width and heads)."""
    return {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "max_position_embeddings": 40960, "block_size": 16, "num_target_layers": 36,
            "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}


def test_zlab_configs_read_as_the_engines_serve_them():
    q36, q8 = read(zlab_qwen36_27b()), read(zlab_qwen3_8b())
    for c, cfg in ((zlab_qwen36_27b(), q36), (zlab_qwen3_8b(), q8)):
        s = served(c)
        assert s["vLLM"] == s["SGLang"] == ours(cfg)
    assert kinds(q36) == [(True, 2048)] * 4 + [(False, None)]
    assert q36 == dflash.DFlashConfig()  # the dataclass defaults are this drafter
    assert kinds(q8) == [(False, None)] * 5
    assert (q8.mask_token_id, q8.target_layer_ids, q8.num_target_layers) == (151669, [1, 9, 17, 25, 33], 36)


def without(c, *keys):
    return {k: v for k, v in c.items() if k not in keys}


def dc(**over):
    """dflash_config: z-lab's two keys, then over (None: the key left out)."""
    d = {"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"], **over}
    return {k: v for k, v in d.items() if v is not None}


WIDE = dict(num_attention_heads=32, head_dim=4)  # 32 heads: transformers' default of 32 kv heads divides them
CASES = {  # name: (config.json, the words of the refusal; none: both engines serve it alike, and so is it read here)
    # defaults that transformers fills in
    "no head_dim: transformers' 128": (without(zlab_config(), "head_dim"), ()),
    "no num_key_value_heads: transformers' 32": (without(zlab_config(**WIDE), "num_key_value_heads"), ()),
    "sliding layers, use_sliding_window false: the window dropped":
        (zlab_config(use_sliding_window=False), ("use_sliding_window", "sliding_window 5", "both engines")),
    "sliding layers, use_sliding_window absent":
        (without(zlab_config(), "use_sliding_window"), ("use_sliding_window", "both engines")),
    "swa_window_size without use_sliding_window":
        (zlab_config(use_sliding_window=False, dflash_config=dc(swa_window_size=5)), ("use_sliding_window",)),
    "no layer_types, use_sliding_window: sliding from max_window_layers":
        (without(zlab_config(max_window_layers=1), "layer_types"), ()),
    "no layer_types, no sliding window: all full": (without(zlab_config(use_sliding_window=False), "layer_types"), ()),
    "no layer_types, is_causal true": (without(zlab_config(use_sliding_window=False, is_causal=True), "layer_types"),
                                       ()),
    # keys that change the served model
    "hidden_act gelu": (zlab_config(hidden_act="gelu"), ("hidden_act='gelu'", "silu")),
    "target_hidden_size": (zlab_config(target_hidden_size=64), ("target_hidden_size=64", "hidden_size 32")),
    "target_hidden_size equal to hidden_size": (zlab_config(target_hidden_size=32), ()),
    "logit_scale": (zlab_config(logit_scale=2.0), ("logit_scale=2.0", "vLLM")),
    "eagle_config without aux hidden states": (zlab_config(eagle_config={"use_aux_hidden_state": False}),
                                               ("eagle_config.use_aux_hidden_state=False",)),
    "eagle_config mask_token_id, vLLM's only": (zlab_config(mask_token_id=ZL["M"], dflash_config=dc(mask_token_id=None),
                                                            eagle_config={"mask_token_id": 3}),
                                                ("eagle_config.mask_token_id", "vLLM")),
    # layer ids read in another order
    "dflash_config.layer_ids only": (zlab_config(dflash_config=dc(target_layer_ids=None, layer_ids=[2, 5])),
                                     ("dflash_config.layer_ids", "[2, 5]")),
    "dflash_config.layer_ids beside target_layer_ids": (zlab_config(dflash_config=dc(layer_ids=[0, 2])), ()),
    "dspark_target_layer_ids beside target_layer_ids":
        (zlab_config(target_layer_ids=ZL["T"], dspark_target_layer_ids=[0, 3], dflash_config=dc(target_layer_ids=None)),
         ("dspark_target_layer_ids", "[0, 3]")),
    "dspark_target_layer_ids equal": (zlab_config(target_layer_ids=ZL["T"], dspark_target_layer_ids=ZL["T"],
                                                  dflash_config=dc(target_layer_ids=None)), ()),
    "target_layer_ids at the top level only": (zlab_config(target_layer_ids=ZL["T"],
                                                           dflash_config=dc(target_layer_ids=None)), ()),
    "no target_layer_ids at all": (zlab_config(dflash_config=dc(target_layer_ids=None)),
                                   ("target_layer_ids", "vLLM", "SGLang")),
    "the target's last layer": (zlab_config(dflash_config=dc(target_layer_ids=[1, 5])),
                                ("target_layer_ids", "5", "last layer", "SGLang")),
    "eagle_aux ids other than target ids + 1": (zlab_config(eagle_aux_hidden_state_layer_ids=[1, 4]),
                                                ("eagle_aux_hidden_state_layer_ids", "target ids + 1")),
    "eagle_aux ids equal to target ids + 1": (zlab_config(eagle_aux_hidden_state_layer_ids=[2, 5]), ()),
    # a scale on the block embeddings (vLLM and z-lab honour it, SGLang does not read it)
    "input_embedding_scale": (zlab_config(input_embedding_scale=5.66), ("input_embedding_scale",)),
    # windows the engines bound differently
    "bidirectional sliding, B > W": (zlab_config(is_causal=False), ("is_causal", "block_size 8", "sliding_window 5",
                                                                    "SGLang")),
    "bidirectional sliding, B <= W (NeMo)": (zlab_config(is_causal=False, sliding_window=8), ()),
    "causal sliding, B > W": (zlab_config(), ()),
    # attention keys only one engine reads
    "is_causal true, sliding and full": (zlab_config(is_causal=True, layer_types=[SLIDING] + ["full_attention"] * 2),
                                         ()),
    "dflash causal equal to the rule": (zlab_config(layer_types=["full_attention"] * 3, use_sliding_window=False,
                                                    dflash_config=dc(causal=False)), ()),
    "dflash causal against the rule": (zlab_config(dflash_config=dc(causal=False)),
                                       ("dflash_config.causal=False", "vLLM only", "top-level is_causal")),
    "use_swa with sliding layers listed": (zlab_config(dflash_config=dc(use_swa=True)), ()),
    "use_swa without sliding layers": (zlab_config(layer_types=["full_attention"] * 3, dflash_config=dc(
        use_swa=True, swa_window_size=4)), ("use_swa", "layer_types")),
    "swa_window_size equal to sliding_window": (zlab_config(dflash_config=dc(swa_window_size=ZL["Wz"])), ()),
    "swa_window_size other than sliding_window": (zlab_config(dflash_config=dc(swa_window_size=9)),
                                                  ("swa_window_size 9", "sliding_window 5")),
    "draft_vocab_size": (zlab_config(draft_vocab_size=64), ("draft_vocab_size=64", "d2t")),
}


@pytest.mark.parametrize("name", CASES)
def test_config_read_as_both_engines_serve_it(name):
    """One case per kind of config: where both engines serve one drafter it is read as exactly that drafter; where
    they differ, or either refuses, it is refused in one line naming the key (and transformers' config class decides
    every default, as in the engines)."""
    c, needles = CASES[name]
    s = served(c)
    agree = isinstance(s["vLLM"], dict) and s["vLLM"] == s["SGLang"]
    assert agree != bool(needles), f"{name}: the engines {'agree' if agree else 'differ'}: {s}"
    if agree:
        assert ours(read(c)) == s["vLLM"], name
    else:
        refused(c, "config.json", *needles)


def test_defaults_are_transformers_own():
    """The values transformers fills in are read, not ours: head_dim 128 (not hidden / heads), 32 kv heads (not the
    head count), sliding layers from max_window_layers on when layer_types is missing."""
    from transformers import Qwen3Config
    plain = Qwen3Config()
    assert read(without(zlab_config(), "head_dim")).head_dim == plain.head_dim == 128 != ZL["D"] // ZL["heads"]
    assert read(without(zlab_config(**WIDE), "num_key_value_heads")).num_key_value_heads == plain.num_key_value_heads
    cfg = read(without(zlab_config(max_window_layers=1), "layer_types"))
    assert cfg.layer_types == hf(without(zlab_config(max_window_layers=1), "layer_types")).layer_types \
        == ["full_attention", SLIDING, SLIDING]


def test_what_transformers_refuses_is_one_line():
    """A config transformers' class rejects (a wrong type, layer_types of the wrong length) is one line naming it."""
    for over, needle in [(dict(head_dim="8"), "head_dim"), (dict(layer_types=[SLIDING, "full_attention"]),
                                                            "layer_types"), (dict(rms_norm_eps=None), "rms_norm_eps")]:
        refused(zlab_config(**over), "config.json", needle)
    refused(without(zlab_config(), "model_type"), "model_type", "qwen3")
    refused(zlab_config(model_type="no_such_model"), "model_type", "no_such_model")


def test_engine_precedence_of_the_dflash_fields():
    """dflash_config wins over the top level for num_target_layers, block_size, mask_token_id, target_layer_ids (as
    both engines read them)."""
    c = zlab_config(num_target_layers=99, block_size=3, mask_token_id=1, target_layer_ids=[0],
                    eagle_aux_hidden_state_layer_ids=[t + 1 for t in ZL["T"]])
    c["dflash_config"].update(num_target_layers=ZL["L"], block_size=ZL["Bs"])
    cfg = read(c)
    assert (cfg.num_target_layers, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == \
        (ZL["L"], ZL["Bs"], ZL["M"], ZL["T"])


def test_mask_embedding_file_is_refused(tmp_path):
    """vLLM replaces the mask token's embedding with a mask_embedding.pt beside the weights, SGLang does not."""
    d = write_zlab_dir(str(tmp_path / "z"), zlab_config(), zlab_tensors())
    dflash.read_drafter_config(d)
    torch.save(torch.zeros(ZL["D"]), os.path.join(d, "mask_embedding.pt"))
    for load in (dflash.read_drafter_config, dflash.load_drafter):
        with pytest.raises(DFlashError) as e:
            load(d)
        assert "mask_embedding.pt" in str(e.value) and "vLLM" in str(e.value) and "\n" not in str(e.value)


def test_eval_refuses_what_dflash_refuses(tmp_path, capsys):
    """eval.py measures only drafters both engines serve alike: the same refusal, one error line."""
    import eval as ev
    from conftest import VOCAB
    z = dict(ZL, V=VOCAB, M=VOCAB - 1, L=4, T=[1, 2])  # fits tiny_qwen3()
    target = tiny_qwen3(tmp_path / "q3")
    d = write_zlab_dir(str(tmp_path / "z"), zlab_config(z, hidden_act="gelu"), zlab_tensors(z))
    capsys.readouterr()
    one_error(capsys, ev.main, ["--target", target, "--drafter", d, "--no_progress"], "hidden_act='gelu'", "silu")


def test_block_embeddings_are_the_raw_table(tmp_path):
    """A target whose embedding module scales its output (Gemma's sqrt(D)): the engines' DFlash paths embed the block
    tokens with the raw table, and so does training here (no scale to record in the checkpoint)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding
    emb = Gemma3TextScaledWordEmbedding(11, 16, padding_idx=0, embed_scale=4.0)
    target = type("T", (), {"embed": emb})()
    ids = torch.tensor([[3, 7, 10]])
    torch.testing.assert_close(dflash.embed_blocks(target, ids), emb.weight[ids])
    assert not torch.allclose(emb(ids), emb.weight[ids])  # the module itself would scale them


# (DFlash2's keys are implemented: tests/test_dflash2.py)
NOT_PLAIN = {"attention_sink_bias": True, "add_swa_attention_sink_bias": True, "attention_value_scale": 0.5,
             "projector_type": "domino", "shift_label": True, "gru_hidden_dim": 64, "sample_from_anchor": True,
             "use_aux_hidden_state": False, "is_neox_style": False, "rope_is_neox_style": False,
             "partial_rotary_factor": 0.25}


def test_every_refused_key_has_a_test_value():
    assert set(NOT_PLAIN) == set(engines.NOT_IMPLEMENTED)


@pytest.mark.parametrize("key", NOT_PLAIN)
def test_math_keys_not_implemented_are_refused(key):
    """Each key in dflash_config, eagle_config and at the top level: one line naming it and what it means; its plain
    value reads."""
    meaning = engines.NOT_IMPLEMENTED[key][1]
    for where in ("top", "dflash_config", "eagle_config"):
        c = zlab_config(eagle_config={})
        (c if where == "top" else c[where])[key] = NOT_PLAIN[key]
        refused(c, key, meaning[:20], "not implemented")
        (c if where == "top" else c[where])[key] = engines.NOT_IMPLEMENTED[key][0][0]
        read(c)


def test_partial_rotary_factor_copied_from_a_qwen35_target_is_refused():
    refused(zlab_config(rope="nested", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25}),
            "rope_parameters.partial_rotary_factor=0.25")
    read(zlab_config(rope="nested", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 1.0}))


# -----------------------------------------------------------------------------
# Writing: a saved config is served as trained by both engines, with no engine default involved

SAVED = {
    "z-lab 27B": {},
    "all full (Qwen3-8B)": dict(layer_types=["full_attention"] * 3, sliding_window=None),
    "NeMo bidirectional sliding": dict(is_causal=False),
    "all causal": dict(is_causal=True),
    "all sliding, causal": dict(layer_types=[SLIDING] * 3),
    "all sliding, bidirectional": dict(layer_types=[SLIDING] * 3, is_causal=False),
    "causal sliding, W < B": dict(block_size=8),
}


@pytest.mark.parametrize("name", SAVED)
def test_saved_config_is_served_as_trained(name, tmp_path):
    cfg = tiny_cfg(**SAVED[name])
    path = dflash.save_drafter(dflash.DFlashDrafter(cfg), str(tmp_path / "d"))
    with open(f"{path}/config.json") as f:
        c = json.load(f)
    s = served(c)
    assert s["vLLM"] == s["SGLang"] == ours(cfg), name
    dc = c["dflash_config"]
    assert (dc["num_target_layers"], dc["block_size"], dc["mask_token_id"], dc["target_layer_ids"]) == \
        (cfg.num_target_layers, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids)
    assert c["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in cfg.target_layer_ids]  # vLLM reads it first
    assert c["layer_types"] == cfg.layer_types and dc["sample_from_anchor"] is False
    if len({k[0] for k in kinds(cfg)}) == 1:  # one causality: said outright, not left to a default
        assert c["is_causal"] == dc["causal"] == kinds(cfg)[0][0]
    assert dflash.read_drafter_config(path) == cfg


@pytest.mark.parametrize("over, needles", [
    (dict(is_causal=False, block_size=8), ["block_size 8", "sliding_window 6", "SGLang", "--block_size",
                                           "--sliding_window 8"]),
    (dict(target_layer_ids=[1, 4]), ["target_layer_ids [1, 4]", "last layer", "SGLang", "--target_layer_ids 1,3"]),
])
def test_layouts_an_engine_serves_differently_are_never_written(over, needles, tmp_path):
    """The layout is a legal drafter (its masks are well defined), but one engine would serve another one: the
    writer refuses it, saying which flag fixes it, and writes nothing."""
    cfg = tiny_cfg(**over)  # read from a config.json, the same layouts are refused (CASES above)
    msg = "; ".join(dflash.engine_problems(cfg))
    assert all(n in msg for n in needles), msg
    with pytest.raises(DFlashError) as e:
        dflash.save_drafter(dflash.DFlashDrafter(cfg), str(tmp_path / "d"))
    assert all(n in str(e.value) for n in needles) and not os.path.exists(tmp_path / "d")


def test_training_refuses_them_before_any_weights_load(tmp_path, capsys):
    """--target_layer_ids naming the target's last layer: one error line at the start, before the target's weights
    are read (the target directory here has none: reading them would fail otherwise)."""
    from conftest import SMALL, write_data
    target = tiny_qwen3(tmp_path / "q3")
    os.remove(os.path.join(target, "model.safetensors"))
    argv = [*SMALL, "--target", target, "--data", write_data(tmp_path / "d.jsonl", 4), "--out", str(tmp_path / "o")]
    argv[argv.index("--target_layer_ids") + 1] = "1,3"  # tiny_qwen3 has 4 layers: 3 is the last
    capsys.readouterr()
    one_error(capsys, dflash.main, argv, "--target_layer_ids 1,2", "last layer", "SGLang")


# -----------------------------------------------------------------------------
# Target layer t: the output of decoder layer t before the final norm (vLLM's aux hidden state t+1 = hidden_states +
# residual after layer t; SGLang captures layer inputs, so layers 0..L-2 only)

def test_target_layer_is_captured_before_the_final_norm(tmp_path, one_thread):
    target = dflash.load_target(tiny_qwen3(tmp_path / "q3"))
    L = target.num_layers
    ids = torch.tensor([[5, 9, 13, 17, 21, 25]])
    hf_states = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # L+1; the last after the norm
    ctx, final = dflash.target_features(target, ids, [0, L - 2, L - 1])
    D = target.hidden_size
    torch.testing.assert_close(ctx[..., :D], hf_states[1])          # vLLM's aux 1: the output of layer 0
    torch.testing.assert_close(ctx[..., D:2 * D], hf_states[L - 1])  # aux L-1: the output of layer L-2
    last = ctx[..., 2 * D:]
    torch.testing.assert_close(target.backbone.norm(last), hf_states[L])  # layer L-1's output, before the norm
    assert (last - hf_states[L]).abs().max() > 1e-2  # which is not Hugging Face's hidden_states[L]
    torch.testing.assert_close(final, hf_states[L])
