"""eval.py: the tau walk, the exact method against a real speculative decoding loop, hybrid targets, z-lab drafter
directories, prompts and the command line. Tiny random models on CPU, fp32."""

import json
import os
import subprocess
import sys

import pytest
import torch

import dflash
import eval as ev
from conftest import (DENSE_DRAFTER as DRAFTER, DENSE_TARGET as TARGET, NEW_TOKENS, ROOT, reference_greedy, tiny_cfg,
                      tiny_qwen3, tiny_qwen35, tiny_tokenizer, write_zlab_dir, zlab_config, zlab_tensors)
from dflash import DFlashError

V, D, L = 96, 64, 4                       # conftest's dense target: vocab, hidden, decoder layers
MASK = V - 1

# tiny models run fastest on one thread (and do not fight other processes for the cores), module fixtures included
pytestmark = pytest.mark.usefixtures("one_thread_module")


# -----------------------------------------------------------------------------
# The tau walk and the prompt-lookup baseline: hand-computed examples


def test_tau_walk_hand_example():
    s = list(range(10, 19))  # 9 tokens: s[0] comes with the prefill, so the first block is anchored at s[0]
    drafts = {0: [11, 12, 99],   # 2 accepted -> 3 tokens, next anchor s[3]
              3: [99, 15, 16],   # 0 accepted -> 1 token (the target's own), next anchor s[4]
              4: [15, 16, 99],   # 2 accepted -> 3 tokens, next anchor s[7]
              7: [18, 50, 51]}   # only s[8] is left: 1 accepted -> 2, done. Unvisited anchors are never read.
    lengths = dflash.tau_walk(s, drafts)
    assert lengths == [3, 1, 3, 2]
    assert ev.step_anchors(lengths) == [0, 3, 4, 7]
    stats = ev.acceptance_stats(lengths, block_size=4)
    assert stats["tau"] == 9 / 4 and stats["steps"] == 4
    assert stats["histogram"] == [1, 1, 2, 0]
    assert stats["per_offset_acceptance"] == [3 / 4, 2 / 4, 0.0]
    assert stats["tau"] == 1 + sum(stats["per_offset_acceptance"])
    assert dflash.tau_walk([5], {}) == []          # only the prefill token: no verification step
    assert dflash.tau_walk([5, 6], {0: []}) == [1]  # no drafts: the target's own token only


def test_prompt_lookup_hand_examples():
    assert ev.PromptLookup([1, 2, 3, 9, 1, 2, 3]).draft(4) == [9, 1, 2, 3]  # 3-gram match, copies what followed
    assert ev.PromptLookup([5, 6, 5, 6]).draft(5) == [5, 6, 5, 6, 5]        # the copy runs on into its own output
    assert ev.PromptLookup([7, 1, 8, 7, 2, 9, 7]).draft(2) == [2, 9]          # the most recent match, not the first
    assert ev.PromptLookup([4, 1, 2, 3, 8, 4]).draft(3) == [1, 2, 3]          # falls back to shorter n-grams
    assert ev.PromptLookup([1, 2, 3]).draft(4) == []                          # no match, no drafts
    lookup = ev.PromptLookup([1, 2])
    lookup.extend([3, 1, 2])  # incremental indexing gives the same answer as indexing all at once
    assert lookup.draft(3) == ev.PromptLookup([1, 2, 3, 1, 2]).draft(3) == [3, 1, 2]


# -----------------------------------------------------------------------------
# Exact method vs a real speculative decoding loop (dense target)


def test_exact_equals_loop_and_loop_equals_greedy(dense):
    target, prompts, ref = dense["target"], dense["prompts"], dense["continuations"]
    drafters = {"ours": dense["drafter"], "prompt-lookup": ev.PromptLookupDrafter()}
    exact = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, continuations=ref, progress=False)
    loop = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, mode="loop", continuations=ref, progress=False)
    for re_, rl in zip(exact["results"], loop["results"]):
        assert re_["drafter"] == rl["drafter"]
        assert [e["continuation"] for e in rl["prompts"]] == ref          # loop: token for token plain greedy
        assert rl["matches_greedy"]
        assert [e["acceptance_lengths"] for e in re_["prompts"]] == [e["acceptance_lengths"] for e in rl["prompts"]]
        assert re_["tau"] == rl["tau"]
        lengths = [n for e in re_["prompts"] for n in e["acceptance_lengths"]]
        assert max(lengths) > 1                      # drafts do get accepted, so the comparison is not vacuous
        assert re_["tau"] > 1.5
        # every step produces accepted+1 tokens: they cover the continuation after s[0] (the last may overshoot by 1)
        for e in re_["prompts"]:
            assert len(e["continuation"]) - 1 <= sum(e["acceptance_lengths"]) <= len(e["continuation"])


def test_exact_equals_loop_when_eos_stops_generation(dense):
    target, prompts, ref = dense["target"], dense["prompts"][:1], dense["continuations"][:1]
    eos = ref[0][5]  # a token the target really generates: generation stops after at most 6 tokens
    gc = target.model.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = eos
    try:
        drafters = {"ours": dense["drafter"], "prompt-lookup": ev.PromptLookupDrafter()}
        exact = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, progress=False)
        loop = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, mode="loop", progress=False)
    finally:
        gc.eos_token_id = saved
    first = exact["results"][0]["prompts"][0]["continuation"]
    assert first == ref[0][:ref[0].index(eos) + 1]  # stopped right after eos
    for re_, rl in zip(exact["results"], loop["results"]):
        assert rl["matches_greedy"]
        assert [e["continuation"] for e in re_["prompts"]] == [e["continuation"] for e in rl["prompts"]]
        assert [e["acceptance_lengths"] for e in re_["prompts"]] == [e["acceptance_lengths"] for e in rl["prompts"]]


def test_block_size_truncates_drafts(dense):
    target, prompts, ref = dense["target"], dense["prompts"][:2], dense["continuations"][:2]
    drafters = {"ours": dense["drafter"]}
    full = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, continuations=ref, dump_drafts=True,
                                progress=False)["results"][0]
    small = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, block_size=3, continuations=ref,
                                 progress=False)["results"][0]
    assert full["block_size"] == 8 and small["block_size"] == 3
    assert len(small["histogram"]) == 3 and len(small["per_offset_acceptance"]) == 2
    assert max(n for e in small["prompts"] for n in e["acceptance_lengths"]) <= 3
    assert max(n for e in full["prompts"] for n in e["acceptance_lengths"]) > 3
    assert all(len(d) == 7 for e in full["prompts"] for d in e["drafts"])
    with pytest.raises(DFlashError, match="--block_size 9 > drafter .*'s 8; give at most that"):
        ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, block_size=9, continuations=ref, progress=False)


# -----------------------------------------------------------------------------
# Hybrid (Gated DeltaNet + full attention) target: the exact method needs no rollback


def test_hybrid_target_exact_method(tmp_path):
    target = dflash.load_target(tiny_qwen35(tmp_path / "hybrid", **TARGET, linear_key_head_dim=16,
                                            linear_value_head_dim=16))
    prompts = [[3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28]]
    drafter = dflash.DFlashDrafter(tiny_cfg(DRAFTER, target_layer_ids=[0, 3])).eval()
    report = ev.evaluate_drafters(target, {"random": drafter, "prompt-lookup": ev.PromptLookupDrafter()}, prompts, 10,
                                  dump_drafts=True, progress=False)
    for r in report["results"]:
        for p, e in zip(prompts, r["prompts"]):
            assert e["continuation"] == reference_greedy(target, p, 10)
            assert len(e["acceptance_lengths"]) == len(e["drafts"]) >= 1
    with pytest.raises(DFlashError, match="cannot be rolled back"):
        ev.evaluate_drafters(target, {"prompt-lookup": ev.PromptLookupDrafter()}, prompts, 10, mode="loop", progress=False)


# -----------------------------------------------------------------------------
# A drafter directory written by hand in the z-lab layout


# z-lab geometry (conftest.ZL's keys) for a drafter over the dense target, and its files: fp32 tensors
ZLAB = dict(D=D, layers=3, heads=4, kv=2, hd=16, inter=96, V=V, M=MASK, T=[0, 1, 2], L=L, Bs=6, Wz=5)
ZLAB_CONFIG = dict(torch_dtype="float32", max_position_embeddings=512)
ZLAB_TENSORS = dict(scale=0.05, norm_scale=0.1, dtype=torch.float32)


def test_zlab_directory_drafts_match_inference_forward(dense, tmp_path):
    target, prompts, ref = dense["target"], dense["prompts"][:3], dense["continuations"][:3]
    directory = write_zlab_dir(str(tmp_path / "zlab"), zlab_config(ZLAB, **ZLAB_CONFIG),
                               zlab_tensors(ZLAB, **ZLAB_TENSORS))
    drafters = ev.load_drafters([directory], target, torch.float32, prompt_lookup=False)
    drafter = drafters[directory].drafter  # the DFlashDrafter inside eval's NeuralDrafter
    assert drafter.cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert drafter.cfg.sliding_window == 5
    report = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, continuations=ref, dump_drafts=True,
                                  progress=False)
    entries = report["results"][0]["prompts"]
    steps = 0
    for prompt, cont, e in zip(prompts, ref, entries):
        ids = torch.tensor([prompt + cont])
        features, _ = dflash.target_features(target, ids, drafter.cfg.target_layer_ids)
        for k, drafts in zip(ev.step_anchors(e["acceptance_lengths"]), e["drafts"]):
            a = len(prompt) + k  # the anchor's position: context is everything before it
            cache = ev.NeuralDrafter(drafter)
            cache.start(target, prompt + cont[:k], features[:, :a])
            expected = cache.draft(cont[k], drafter.cfg.block_size - 1)
            assert drafts == expected, f"anchor {a}"
            steps += 1
        # drafting in chunks of one anchor (a tiny memory budget) gives the same drafts as one big batch
        every = dflash.draft_every_anchor(drafter, target, features, ids, len(prompt))[0]
        assert torch.equal(dflash.draft_every_anchor(drafter, target, features, ids, len(prompt), budget=1)[0], every)
    assert steps > len(prompts) and steps == report["results"][0]["steps"]


# -----------------------------------------------------------------------------
# Prompts


def test_prompts_jsonl_formats_and_errors(tmp_path):
    words = ["<unk>", "<eos>", "hello", "world", "user:", "assistant:", "think", "nothink", "bye"]
    tokenizer = tiny_tokenizer(("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                                "{% if add_generation_prompt %}assistant: "
                                "{% if enable_thinking is defined and not enable_thinking %}nothink{% else %}think"
                                "{% endif %}{% endif %}"), words=words, eos_token="<eos>", unk_token="<unk>")
    ids = {w: i for i, w in enumerate(words)}
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello world"}) + "\n\n"
                 + json.dumps({"messages": [{"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": "bye"}]}) + "\n"
                 + json.dumps({"text": "hello world"}) + "\n"
                 + json.dumps({"input_ids": [7, 8, 9]}) + "\n")
    got = ev.load_prompts(str(p), tokenizer)
    gen = [ids["user:"]]  # the template renders "user: ..." then the generation prompt
    assert got[0] == gen + [ids["hello"], ids["world"], ids["assistant:"], ids["think"]]
    assert got[1] == gen + [ids["hello"], ids["assistant:"], ids["think"]]  # trailing assistant turn dropped
    assert got[2] == [ids["hello"], ids["world"]]                          # raw text, no template
    assert got[3] == [7, 8, 9]
    assert ev.load_prompts(str(p), tokenizer, enable_thinking=False)[0][-1] == ids["nothink"]  # passed through
    assert len(ev.load_prompts(None, tokenizer)) == len(ev.BUILTIN_PROMPTS)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"input_ids": [1, 2]}) + "\n{not json\n")
    with pytest.raises(DFlashError, match=r"bad\.jsonl:2: not valid JSON"):
        ev.load_prompts(str(bad), tokenizer)
    bad.write_text(json.dumps({"input_ids": [1, "x"]}) + "\n")
    with pytest.raises(DFlashError, match=r"bad\.jsonl:1: input_ids"):
        ev.load_prompts(str(bad), tokenizer)
    bad.write_text(json.dumps({"input_ids": []}) + "\n")
    with pytest.raises(DFlashError, match=r"bad\.jsonl:1: input_ids is empty"):
        ev.load_prompts(str(bad), tokenizer)
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(DFlashError, match=r"bad\.jsonl:1: none of the known fields"):
        ev.load_prompts(str(bad), tokenizer)
    with pytest.raises(DFlashError, match=r"p\.jsonl:1: the target has no tokenizer"):
        ev.load_prompts(str(p), None)
    with pytest.raises(DFlashError, match="no tokenizer"):
        ev.load_prompts(None, None)


# -----------------------------------------------------------------------------
# Command line


def test_cli_mismatched_drafter_is_one_error_line(dense, tmp_path):
    geometry = {**ZLAB, "L": 8, "T": [1, 4, 6]}
    other = write_zlab_dir(str(tmp_path / "other"), zlab_config(geometry, **ZLAB_CONFIG),
                           zlab_tensors(geometry, **ZLAB_TENSORS))
    env = {**{k: v for k, v in os.environ.items() if k != "DFLASH_DEBUG"}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--target", dense["path"], "--drafter", other,
                           "--no_progress"], capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "num_target_layers 8" in lines[0] and "another target" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_end_to_end_json(dense, tmp_path, capsys):
    directory = write_zlab_dir(str(tmp_path / "zlab"), zlab_config(ZLAB, **ZLAB_CONFIG),
                               zlab_tensors(ZLAB, **ZLAB_TENSORS))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in dense["prompts"][:2]))
    out = tmp_path / "out" / "tau.json"
    ev.main(["--target", dense["path"], "--drafter", directory, "--prompts", str(prompts), "--max_new_tokens", "12",
             "--json", str(out), "--dump_drafts", "--no_progress"])
    printed = capsys.readouterr().out
    assert "prompt-lookup" in printed and "tau" in printed
    report = json.loads(out.read_text())
    assert report["target"] == dense["path"] and report["block_size"] == 6 and report["max_new_tokens"] == 12
    assert [r["drafter"] for r in report["results"]] == [directory, "prompt-lookup"]  # the baseline by default
    for r in report["results"]:
        assert set(r) >= {"drafter", "tau", "histogram", "per_offset_acceptance", "prompts"}
        assert len(r["histogram"]) == 6 and len(r["per_offset_acceptance"]) == 5
        lengths = [n for e in r["prompts"] for n in e["acceptance_lengths"]]
        assert sum(r["histogram"]) == len(lengths) and r["tau"] == pytest.approx(sum(lengths) / len(lengths))
        for i, e in enumerate(r["prompts"]):
            assert e["prompt_tokens"] == len(dense["prompts"][i])
            assert e["continuation"] == dense["continuations"][i][:12]
            assert len(e["drafts"]) == len(e["acceptance_lengths"])
    assert all(len(d) == 5 for e in report["results"][0]["prompts"] for d in e["drafts"])
