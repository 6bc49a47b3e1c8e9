"""A drafter directory is the contract with the serving engines: config.json is read here the way vLLM and SGLang
read it, written so that both serve the mask trained here, and the target layers are captured where they capture
them. The engines' rules are re-typed below from their sources (vLLM qwen3_dflash.py, SGLang models/dflash.py and
speculative/dflash_utils.py), independently of dflash.read_attention."""

import json

import pytest
import torch

import dflash
from conftest import ZL, tiny_cfg, tiny_qwen3, zlab_config
from dflash import DFlashConfig, DFlashError

SLIDING = "sliding_attention"


def vllm_layers(c):
    """vLLM: per layer (causal, window). Causal: top-level is_causal, else dflash_config.causal, else sliding.
    Sliding: layer_types[i], or every layer when use_swa and layer_types has no sliding layer (or is missing);
    window: dflash_config.swa_window_size, else sliding_window."""
    dc, types = c.get("dflash_config") or {}, c.get("layer_types")
    use_swa = dc.get("use_swa", False)
    out = []
    for i in range(c["num_hidden_layers"]):
        if types is None or (use_swa and SLIDING not in types):
            sliding = use_swa
        else:
            sliding = types[i] == SLIDING
        window = dc.get("swa_window_size", c.get("sliding_window")) if sliding else None
        if c.get("is_causal") is not None:
            causal = bool(c["is_causal"])
        elif dc.get("causal") is not None:
            causal = bool(dc["causal"])
        else:
            causal = bool(types) and types[i] == SLIDING
        out.append((causal, window))
    return out


def sglang_layers(c):
    """SGLang: no layer_types: every layer full and bidirectional (ENCODER_ONLY). Otherwise a full layer is
    bidirectional and a sliding one causal (DECODER) with window sliding_window (stored as window_left = W - 1, the
    same keys as q - k < W), unless the top-level is_causal says otherwise."""
    types = c.get("layer_types")
    out = []
    for i in range(c["num_hidden_layers"]):
        if types is None:
            out.append((False, None))
            continue
        sliding = types[i] == SLIDING
        causal = bool(c["is_causal"]) if c.get("is_causal") is not None else sliding
        out.append((causal, c["sliding_window"] if sliding else None))
    return out


def kinds(cfg):
    return [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]


def read(c):
    return dflash.config_from_json(json.loads(json.dumps(c)))


def refused(c, *needles):
    with pytest.raises(DFlashError) as e:
        read(c)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg


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
    assert kinds(q36) == vllm_layers(zlab_qwen36_27b()) == sglang_layers(zlab_qwen36_27b()) \
        == [(True, 2048)] * 4 + [(False, None)]
    assert q36 == DFlashConfig()  # the dataclass defaults are this drafter
    assert kinds(q8) == vllm_layers(zlab_qwen3_8b()) == sglang_layers(zlab_qwen3_8b()) == [(False, None)] * 5
    assert (q8.mask_token_id, q8.target_layer_ids, q8.num_target_layers) == (151669, [1, 9, 17, 25, 33], 36)


AGREED = {  # configs on which both engines serve the same mask: read the same here
    "nemo is_causal false": dict(is_causal=False),  # NeMo writes it: sliding layers bidirectional, windowed
    "is_causal true": dict(is_causal=True, layer_types=[SLIDING, "full_attention", "full_attention"]),
    "no layer_types": dict(layer_types=None),
    "dflash causal equal to the rule": dict(layer_types=["full_attention"] * 3, dflash_config={
        "mask_token_id": ZL["M"], "target_layer_ids": ZL["T"], "causal": False}),
    "use_swa with sliding layers listed": dict(dflash_config={"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"],
                                                              "use_swa": True}),
    "swa_window_size equal to sliding_window": dict(dflash_config={"mask_token_id": ZL["M"],
                                                                   "target_layer_ids": ZL["T"],
                                                                   "swa_window_size": ZL["Wz"]}),
}


@pytest.mark.parametrize("name", AGREED)
def test_attention_keys_read_as_both_engines(name):
    c = {k: v for k, v in zlab_config(**AGREED[name]).items() if v is not None or k != "layer_types"}
    assert kinds(read(c)) == vllm_layers(c) == sglang_layers(c), name


@pytest.mark.parametrize("over, needles", [
    (dict(dflash_config={"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"], "causal": False}),
     ["dflash_config.causal=False", "vLLM only", "top-level is_causal"]),
    (dict(layer_types=["full_attention"] * 3, dflash_config={"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"],
                                                              "use_swa": True, "swa_window_size": 4}),
     ["use_swa", "layer_types"]),
    (dict(dflash_config={"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"], "swa_window_size": 9}),
     ["swa_window_size 9", "sliding_window 5"]),
    (dict(dflash_config={"mask_token_id": ZL["M"], "target_layer_ids": ZL["T"], "layer_ids": [0, 2]}),
     ["dflash_config.layer_ids", "[0, 2]"]),
    (dict(eagle_aux_hidden_state_layer_ids=[1, 4]), ["eagle_aux_hidden_state_layer_ids", "target ids + 1"]),
    (dict(draft_vocab_size=64), ["draft_vocab_size=64", "d2t"]),
])
def test_keys_the_engines_would_serve_differently_are_refused(over, needles):
    c = zlab_config(**over)
    if "causal" in c["dflash_config"]:  # this one really differs between the engines
        assert vllm_layers(c) != sglang_layers(c)
    refused(c, "config.json", *needles)


def test_engine_precedence_of_the_dflash_fields():
    """dflash_config wins over the top level for num_target_layers, block_size, mask_token_id, target_layer_ids (as
    both engines read them); eagle_aux ids that agree (target ids + 1) are accepted."""
    c = zlab_config(num_target_layers=99, block_size=3, mask_token_id=1, target_layer_ids=[0],
                    eagle_aux_hidden_state_layer_ids=[t + 1 for t in ZL["T"]])
    c["dflash_config"].update(num_target_layers=ZL["L"], block_size=ZL["Bs"])
    cfg = read(c)
    assert (cfg.num_target_layers, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == \
        (ZL["L"], ZL["Bs"], ZL["M"], ZL["T"])


# (DFlash2's keys are implemented: tests/test_dflash2.py)
NOT_PLAIN = {"attention_sink_bias": True, "add_swa_attention_sink_bias": True, "attention_value_scale": 0.5,
             "projector_type": "domino", "shift_label": True, "gru_hidden_dim": 64, "sample_from_anchor": True,
             "use_aux_hidden_state": False, "is_neox_style": False, "rope_is_neox_style": False,
             "partial_rotary_factor": 0.25}


def test_every_refused_key_has_a_test_value():
    assert set(NOT_PLAIN) == set(dflash.NOT_IMPLEMENTED)


@pytest.mark.parametrize("key", NOT_PLAIN)
def test_math_keys_not_implemented_are_refused(key):
    """Each key in dflash_config and at the top level: one line naming it and what it means; its plain value reads."""
    meaning = dflash.NOT_IMPLEMENTED[key][1]
    for where in ("top", "dflash_config"):
        c = zlab_config()
        (c if where == "top" else c["dflash_config"])[key] = NOT_PLAIN[key]
        refused(c, key, meaning[:20], "not implemented")
        (c if where == "top" else c["dflash_config"])[key] = dflash.NOT_IMPLEMENTED[key][0][0]
        read(c)


def test_partial_rotary_factor_copied_from_a_qwen35_target_is_refused():
    refused(zlab_config(rope="nested", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                         "partial_rotary_factor": 0.25}),
            "rope_parameters.partial_rotary_factor=0.25")
    read(zlab_config(rope="nested", rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 1.0}))


# -----------------------------------------------------------------------------
# Writing: a saved config means the same mask in both engines, with no engine default involved

SAVED = {
    "z-lab 27B": {},
    "all full (Qwen3-8B)": dict(layer_types=["full_attention"] * 3, sliding_window=None),
    "NeMo bidirectional sliding": dict(is_causal=False),
    "all causal": dict(is_causal=True),
    "all sliding, causal": dict(layer_types=[SLIDING] * 3),
    "all sliding, bidirectional": dict(layer_types=[SLIDING] * 3, is_causal=False),
}


@pytest.mark.parametrize("name", SAVED)
def test_saved_config_is_served_with_our_mask(name, tmp_path):
    cfg = tiny_cfg(**SAVED[name])
    path = dflash.save_drafter(dflash.DFlashDrafter(cfg), str(tmp_path / "d"))
    with open(f"{path}/config.json") as f:
        c = json.load(f)
    assert vllm_layers(c) == sglang_layers(c) == kinds(cfg), name
    dc = c["dflash_config"]
    assert (dc["num_target_layers"], dc["block_size"], dc["mask_token_id"], dc["target_layer_ids"]) == \
        (cfg.num_target_layers, cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids)
    assert c["eagle_aux_hidden_state_layer_ids"] == [t + 1 for t in cfg.target_layer_ids]  # vLLM reads it first
    assert c["layer_types"] == cfg.layer_types and dc["sample_from_anchor"] is False
    if len({k[0] for k in kinds(cfg)}) == 1:  # one causality: said outright, not left to a default
        assert c["is_causal"] == dc["causal"] == kinds(cfg)[0][0]
    assert dflash.read_drafter_config(path) == cfg


# -----------------------------------------------------------------------------
# The last target layer: id t is the output of decoder layer t before the final norm, for t = L-1 too (vLLM's
# aux hidden state t+1 = hidden_states + residual after layer t; SGLang captures layer inputs, so never L-1)

def test_last_target_layer_is_captured_before_the_final_norm(tmp_path, one_thread):
    target = dflash.load_target(tiny_qwen3(tmp_path / "q3"))
    L = target.num_layers
    ids = torch.tensor([[5, 9, 13, 17, 21, 25]])
    hf = target.model(input_ids=ids, output_hidden_states=True).hidden_states  # L+1; the last one after the norm
    ctx, final = dflash.target_features(target, ids, [0, L - 2, L - 1])
    D = target.hidden_size
    torch.testing.assert_close(ctx[..., :D], hf[1])          # vLLM's aux 1: the output of layer 0
    torch.testing.assert_close(ctx[..., D:2 * D], hf[L - 1])  # aux L-1: the output of layer L-2
    last = ctx[..., 2 * D:]
    torch.testing.assert_close(target.backbone.norm(last), hf[L])  # layer L-1's output, the norm not yet applied
    assert (last - hf[L]).abs().max() > 1e-2  # which is not Hugging Face's hidden_states[L]
    torch.testing.assert_close(final, hf[L])
