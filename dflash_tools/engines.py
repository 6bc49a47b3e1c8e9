"""config.json as the engines read any drafter's, and hub ids. dflash.config_from_json reads the layout this
trainer writes; every other config.json (z-lab's, NeMo's, SpecForge's, a hand-edited one) is read here, as vLLM and
SGLang serve it: through transformers' config class for its model_type, then the DFlash keys in the engines' order
(dflash_config, then the top level). A key this drafter does not implement, or that the engines would serve
differently, is refused in one line naming the key and what each engine does, never ignored."""
import os
import re

from dflash import (DFlashConfig, DFlashError, config_class, engine_problems, first_line, is_int, need, read_json,
                    valid_target_layer_ids)
from dflash_tools.dflash2 import INTS, UNARY

NOT_IMPLEMENTED = {
    "attention_sink_bias": ((False, None), "a learned per-head attention sink"),
    "add_swa_attention_sink_bias": ((False, None), "a learned per-head attention sink"),
    "attention_value_scale": ((1, None), "a scale on the attention values"),
    "projector_type": ((None,), "another context projector (Domino's GRU correction head)"),
    "shift_label": ((False, None), "Domino's shifted labels"),
    "gru_hidden_dim": ((None,), "Domino's GRU correction head"),
    "sample_from_anchor": ((False, None), "the anchor's own output predicts the next token, as in DSpark and Domino; "
                                          "DFlash predicts token a+i at block offset i"),
    "use_aux_hidden_state": ((True, None), "false: no fc projection of the target's layer features"),
    "is_neox_style": ((True, None), "false: interleaved RoPE pairs; this drafter rotates halves (neox style)"),
    "rope_is_neox_style": ((True, None), "false: interleaved RoPE pairs; this drafter rotates halves (neox style)"),
    "partial_rotary_factor": ((1, None), "RoPE over part of head_dim; this drafter rotates all of it (often copied "
                                         "from a Qwen3.5/3.6 target config: vLLM honours it, HF Qwen3 ignores it)"),
}

def not_implemented(d, dc, ec, rope):
    """One line per key of NOT_IMPLEMENTED set to another value, wherever an engine may read it."""
    places = (("", d), ("dflash_config.", dc), ("eagle_config.", ec), ("rope_parameters.", rope),
              ("rope_scaling.", d.get("rope_scaling")))
    found = {}  # (key, value): the first place; transformers copies a top-level RoPE key into rope_parameters
    for k, (plain, meaning) in NOT_IMPLEMENTED.items():
        for place, src in places:
            if isinstance(src, dict) and k in src and src[k] not in plain:
                found.setdefault((k, repr(src[k])), f"{place}{k}={src[k]!r} ({meaning}) is not implemented by this "
                                                    f"drafter; refusing it rather than ignoring it")
    return list(found.values())

def transformers_config(d, where):
    """config.json as both engines hold it: transformers' own config class for its model_type (AutoConfig), which owns
    the defaults and derived fields (Qwen3: head_dim 128 and 32 kv heads when missing, no sliding_window unless
    use_sliding_window, layer_types from max_window_layers on when missing, rope_parameters from rope_theta)."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig
    need(isinstance(d, dict), f"{where}: expected a JSON object")
    kind = d.get("model_type")
    need(isinstance(kind, str) and kind in CONFIG_MAPPING, f"{where}: model_type {kind!r} is not a transformers "
         f"config class (both engines build the drafter's config from it); write \"model_type\": \"qwen3\"")
    try:
        c = AutoConfig.for_model(**d)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as e:
        raise DFlashError(f"{where}: transformers' {CONFIG_MAPPING[kind].__name__} refuses it: "
                          f"{' '.join(str(e).split())}") from None
    need(c.get_text_config() is c, f"{where}: model_type {kind!r} nests sub-configs; a DFlash drafter is a plain "
         f"decoder config: write \"model_type\": \"qwen3\"")
    return c

def vllm_aux_ids(c, dc, ec):
    """(key, its ids, the aux hidden states vLLM captures: target id + 1) from the first of these keys that is set, as
    vLLM reads them; (None, None, None) when none is (vLLM then takes the target model's own default layers)."""
    top = lambda k: getattr(c, k, None)  # noqa: E731
    for key, ids, plus in (("eagle_aux_hidden_state_layer_ids", top("eagle_aux_hidden_state_layer_ids"), 0),
                           ("dflash_config.target_layer_ids", dc.get("target_layer_ids"), 1),
                           ("dspark_target_layer_ids", top("dspark_target_layer_ids"), 1),
                           ("target_layer_ids", top("target_layer_ids"), 1),
                           ("dflash_config.layer_ids", dc.get("layer_ids"), 0),
                           ("eagle_config.layer_ids", ec.get("layer_ids"), 0)):
        if ids:
            return key, ids, [t + plus for t in ids] if isinstance(ids, list) and all(map(is_int, ids)) else ids
    return None, None, None

def engines_differ(d, c, dc, ec, ids, num_target):
    """One line per key of transformers' config object c that vLLM and SGLang would serve differently (or that both
    refuse), saying what each does and what to write instead. ids: the target layers as SGLang reads them
    (dflash_config, then the top level; None when neither has them)."""
    out, D = [], c.hidden_size
    act, width, scale = getattr(c, "hidden_act", "silu"), getattr(c, "target_hidden_size", None), \
        getattr(c, "logit_scale", None)
    if act != "silu":
        out.append(f"hidden_act={act!r}: both engines serve DFlash drafters with silu only (and so does this drafter); "
                   f"write \"hidden_act\": \"silu\"")
    if width not in (None, D):
        out.append(f"target_hidden_size={width!r} differs from hidden_size {D}: vLLM sizes fc for target layers of "
                   f"width {width}, SGLang for {D}; drop it (the drafter's hidden_size is the target's)")
    if scale not in (None, 1):
        out.append(f"logit_scale={scale!r}: vLLM scales the drafter's logits by it, SGLang ignores it; drop it")
    top = getattr(c, "mask_token_id", None)
    vllm_mask, sglang_mask = {**ec, **dc}.get("mask_token_id", top), dc.get("mask_token_id", top)
    if vllm_mask != sglang_mask:
        out.append(f"eagle_config.mask_token_id={vllm_mask!r} is read by vLLM only (SGLang reads dflash_config, then "
                   f"the top level: {sglang_mask!r}); write the mask token id as dflash_config.mask_token_id")
    if getattr(c, "draft_vocab_size", None) not in (None, c.vocab_size):
        out.append(f"draft_vocab_size={c.draft_vocab_size} (a reduced draft vocabulary vLLM maps through d2t, SGLang "
                   f"ignores) is not implemented by this drafter; refusing it rather than ignoring it")
    key, raw, aux = vllm_aux_ids(c, dc, ec)
    if ids is None:
        vllm = f"{key} {raw}" if key else "the target model's own default layers"
        L, n = num_target, c.num_hidden_layers
        example = f", e.g. {valid_target_layer_ids(L, n)}" if is_int(L) and L > 0 else ""
        out.append(f"target_layer_ids is missing: vLLM would capture {vllm}, SGLang its spread of layers 1..L-3; "
                   f"write dflash_config.target_layer_ids{example}")
    elif isinstance(ids, list) and all(map(is_int, ids)) and aux != [t + 1 for t in ids]:
        out.append(f"{key} {raw} names other target layers than target_layer_ids {ids}: vLLM would serve the first, "
                   f"SGLang the second; make them equal (eagle_aux ids and layer_ids are target ids + 1)")
    return out + attention_differs(d, c, dc)

def attention_differs(d, c, dc):
    """The attention keys of c that the engines serve differently or both refuse. Both read layer_types,
    sliding_window and the top-level is_causal (absent: a layer is causal iff it is sliding); vLLM alone also reads
    dflash_config.causal (below is_causal), use_swa (every layer sliding when layer_types lists none) and
    swa_window_size (over sliding_window)."""
    types, W, out = getattr(c, "layer_types", None) or [], getattr(c, "sliding_window", None), []
    sliding = [t == "sliding_attention" for t in types]
    given = d.get("sliding_window") or dc.get("swa_window_size")
    if any(sliding) and W is None:
        also = ("SGLang then refuses a sliding layer without it (vLLM falls back to dflash_config.swa_window_size)"
                if "swa_window_size" in dc else "both engines then refuse a sliding layer without it")
        out.append(f"layer_types has sliding layers, sliding_window {given} but use_sliding_window "
                   f"{str(d.get('use_sliding_window')).lower() if 'use_sliding_window' in d else 'missing'}: "
                   f"transformers drops the window, {also}; set \"use_sliding_window\": true" if given else
                   "layer_types has sliding layers but no sliding_window: both engines refuse it; set sliding_window "
                   "and \"use_sliding_window\": true")
    if dc.get("use_swa") and not any(sliding):
        out.append("dflash_config.use_swa makes every layer sliding in vLLM, not in SGLang; list the sliding layers "
                   "in layer_types instead")
    if any(sliding) and W is not None and dc.get("swa_window_size", W) != W:
        out.append(f"dflash_config.swa_window_size {dc['swa_window_size']} (vLLM) differs from sliding_window {W} "
                   f"(SGLang); make them equal")
    if getattr(c, "is_causal", None) is None and dc.get("causal") is not None \
            and any(s != bool(dc["causal"]) for s in sliding):
        out.append(f"dflash_config.causal={dc['causal']!r} is read by vLLM only (SGLang makes a layer causal iff it "
                   f"is sliding); state it as the top-level is_causal, which both read")
    return out

DFLASH2_KEYS = (*INTS, *UNARY)  # DFlash2's dflash_config keys (vLLM reads them there alone)

def variant_fields(cls, d, dc):
    """A variant's keys of a config.json: ({field: value}, problems), read from dflash_config, then the top level
    (z-lab's order). A key only at the top level is a problem (vLLM reads DFlash2's keys from dflash_config alone),
    and so is an `architectures` that disagrees with the keys (vLLM and z-lab pick the model class by it)."""
    kw, problems, arch = {}, [], d.get("architectures") or []
    for k in DFLASH2_KEYS:
        v = dc[k] if k in dc else d.get(k)
        if k not in dc and k in d and v not in (0, None, UNARY.get(k)):  # off, or the identity: nothing to serve
            problems.append(f"{k} is at the top level, not in dflash_config: vLLM reads DFlash2's keys from "
                            f"dflash_config only; move it there")
        if v is not None and not (k in INTS and v == 0):  # an integer 0: off (plain DFlash)
            kw[k] = v
    if cls is DFlashConfig and any(k in kw for k in INTS):
        problems.append(f"dflash_config has DFlash2's keys but architectures is {arch}: vLLM and z-lab would load it "
                        f"as plain DFlash, without its convolutions and selector; set architectures to "
                        f"[\"DFlash2DraftModel\"]")
    elif cls is DFlashConfig and not problems and any(kw.get(k) != v for k, v in UNARY.items() if k in kw):
        problems.append("output_multiplier, final_logit_softcapping and input_embedding_scale are implemented only "
                        "for DFlash2 drafters (they transform its selector's unary logits and block embeddings)")
    on = [k for k in INTS if kw.get(k)]
    if cls is not DFlashConfig and not on:
        problems.append(f"architectures names {cls.architecture} but dflash_config lacks "
                        f"{', '.join(INTS)}; the engines cannot build it")
    elif cls is not DFlashConfig and len(on) < 4:
        problems.append(f"DFlash2 needs all of {', '.join(INTS)}; only {', '.join(on)} set (a half "
                        f"DFlash2 config is refused by z-lab's, vLLM's and SGLang's loaders); set all four or none")
    return ({} if cls is DFlashConfig else kw), problems

def config_from_json(d, where="config.json"):
    """Read a z-lab, NeMo, SpecForge or our config.json as vLLM and SGLang serve it: through transformers' config
    class (transformers_config), then the DFlash keys from that object in the engines' order (dflash_config, then the
    top level). A key this drafter does not implement (not_implemented) or that the engines serve differently
    (engines_differ, engine_problems) is refused, one line each, never ignored."""
    c = transformers_config(d, where)
    n, dc, ec = c.num_hidden_layers, *(getattr(c, k, None) or {} for k in ("dflash_config", "eagle_config"))
    need(isinstance(dc, dict) and isinstance(ec, dict), f"{where}: dflash_config and eagle_config must be JSON objects")
    get = lambda k, default=None: dc[k] if k in dc else getattr(c, k, default)  # noqa: E731
    rope = dict(c.rope_parameters or {})
    need("rope_theta" in rope, f"{where}: per-layer-type rope_parameters are not supported")
    ids, num_target = get("target_layer_ids"), get("num_target_layers")
    bad = [msg for ok, msg in ((num_target is not None, "num_target_layers is missing; set it to the target's number "
                                                        "of decoder layers"),
                               (get("mask_token_id") is not None, "mask_token_id is missing (expected in "
                                                                  "dflash_config)")) if not ok]
    bad += not_implemented(d, dc, ec, rope) + engines_differ(d, c, dc, ec, ids, num_target)
    cls = config_class(d, where)
    v2, v2_problems = variant_fields(cls, d, dc)  # a variant's keys (DFlash2's)
    bad += v2_problems
    need(not bad, "\n".join(f"{where}: {p}" for p in bad))
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    try:  # a config class of another model_type may lack a field Qwen3's has
        cfg = cls(
            hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=n,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // max(c.num_attention_heads, 1),
            vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps, rope_theta=rope["rope_theta"],
            rope_scaling=scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None,
            max_position_embeddings=c.max_position_embeddings, attention_bias=getattr(c, "attention_bias", False),
            block_size=get("block_size", 16), mask_token_id=get("mask_token_id"), num_target_layers=num_target,
            target_layer_ids=ids, layer_types=getattr(c, "layer_types", None) or ["full_attention"] * n,
            sliding_window=getattr(c, "sliding_window", None), is_causal=getattr(c, "is_causal", None), **v2)
    except AttributeError as e:
        raise DFlashError(f"{where}: required field {e.name!r} is missing") from None
    except DFlashError as e:
        raise DFlashError("\n".join(f"{where}: {p}; the config is corrupt" for p in str(e).splitlines())) from None
    bad = engine_problems(cfg)
    need(not bad, "\n".join(f"{where}: {p}" for p in bad))
    return cfg

def download(path, flag):
    """A hub id (owner/name): its *.json and *.safetensors, from the Hugging Face cache, else downloaded once."""
    hub = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", path) and not path.endswith(".") and ".." not in path
    need(hub, f"{flag} {path!r} does not exist; give a drafter directory or a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DFlashError(f"{flag} {path!r} is not a local directory; downloading it as a hub id needs "
                          f"huggingface_hub (pip install huggingface_hub)") from None
    patterns = ["*.json", "*.safetensors"]
    fix = f"download it elsewhere (huggingface-cli download {path} --local-dir DIR) and pass DIR"
    try:  # already in the cache: no network at all
        return snapshot_download(path, allow_patterns=patterns, local_files_only=True)
    except Exception:
        pass
    need(os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes", "on"), f"{flag} {path!r} is not a "
         f"local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is set; {fix}")
    try:
        return snapshot_download(path, allow_patterns=patterns)
    except Exception as e:  # no such repository, gated, offline, ...
        raise DFlashError(f"{flag} {path!r} is not a local directory, and downloading it from the hub failed "
                          f"({first_line(e)}); when offline, {fix}") from None

def shard_files(path, index):
    """The shard files of a drafter saved in pieces (model.safetensors.index.json's weight_map), as other trainers and
    the hub store large ones; dflash.read_safetensors reads each."""
    m = read_json(index, "safetensors index")
    m = m.get("weight_map") if isinstance(m, dict) else None
    ok = isinstance(m, dict) and all(isinstance(v, str) for v in m.values())
    need(ok, f"{index}: no weight_map of tensor names to shard files; the checkpoint is corrupt")
    return [os.path.join(path, f) for f in sorted(set(m.values()))]
