"""Targets of other families, tried as a new user would with a small model of their own: tied Llama, Mistral with a
sliding window, Gemma3 (sqrt(D)-scaled embedding, a RoPE base per layer type), Phi3 (fused projections), Olmo2
(post-norms), Qwen3-MoE. Each trains a step and walks tau, its hooks and block embeddings are what the target's own
layers receive, and each thing a user meets on the way (a tied lm_head, a mask id the data uses, a drafter of another
target, a family that is not supported, a mistyped flag) is handled and said in one line (the README's commands:
test_readme.py)."""

import json
import os
import re

import pytest
import torch

import dflash
import eval as ev
from conftest import (FAMILIES, SMALL, VOCAB, build_family, build_llama, tiny_family, tiny_gpt2, tiny_llama,
                      tiny_qwen3, tiny_tokenizer, write_data)

pytestmark = pytest.mark.usefixtures("one_thread_module")

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    """name -> (the saved target's path, its Target); each built once."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tiny_family(tmp_path_factory.mktemp(name), name)
            cache[name] = (path, dflash.load_target(path))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("data") / "d.jsonl", 8)


def error_lines(capsys, main, argv):
    """main(argv) exits 2; the `error:` lines it printed."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]


def one_error(capsys, main, argv, *needles):
    lines = error_lines(capsys, main, argv)
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def layer_inputs(target, ids):
    """What each decoder layer of the target receives (its hidden_states input) in a plain forward of ids."""
    seen = {}

    def pre(i):
        return lambda m, a, kw: seen.__setitem__(i, a[0] if a else kw["hidden_states"])
    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(target.layers)]
    try:
        with torch.no_grad():
            logits = target.model(input_ids=ids).logits
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(target.layers))], logits


# -----------------------------------------------------------------------------
# Hooks, block embeddings, a step of training and the tau walk, family by family


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hooks_and_block_embeddings_are_what_the_target_layers_receive(fam, name):
    """h[t] (our hook on layer t) is layer t+1's input; target.embed(ids) is layer 0's input (Gemma3's sqrt(D)
    scaling included; the drafter's block embeddings are the raw table rows, as the engines serve them); f through
    lm_head gives the target's logits, and the greedy labels are their argmax."""
    _, target = fam(name)
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    inputs, logits = layer_inputs(target, ids)
    L = target.num_layers
    with dflash.capture_hidden(target, list(range(L))) as store, torch.no_grad():
        target.backbone(input_ids=ids, use_cache=False)
    for t in range(L - 1):
        assert torch.equal(store[t], inputs[t + 1]), f"{name}: h[{t}] is not layer {t + 1}'s input"
    with torch.no_grad():
        assert torch.equal(target.embed(ids), inputs[0]), f"{name}: target.embed differs from layer 0's input"
        assert torch.allclose(target.lm_head(store["final"]), logits, atol=1e-5)
        labels = dflash.greedy_labels(store["final"], target.lm_head)
    assert torch.equal(labels[:, 1:], logits[:, :-1].argmax(-1))
    if name == "gemma3":  # the scaled embedding: what the layers see is not the raw table row
        assert not torch.allclose(inputs[0], target.embed.weight[ids])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_trains_a_step_and_walks_tau(fam, data, tmp_path, name):
    """dflash.py trains one step and saves; eval.py loads the checkpoint, walks tau, and on these dense targets
    the real draft-verify loop (--mode loop) reproduces plain greedy decoding."""
    path, target = fam(name)
    out = tmp_path / "run"
    dflash.main(["--target", path, "--data", data, "--out", str(out), *SMALL, "--max_steps", "1", "--batch_size", "2",
                 "--grad_accum", "1", "--device", "cpu", "--no_progress"])
    ckpt = str(out / "step_1")
    assert os.path.isfile(os.path.join(ckpt, "model.safetensors"))
    drafters = ev.load_drafters([ckpt], target, torch.float32, prompt_lookup=False)
    prompts = [[5, 9, 14, 3, 7, 23], [41, 60, 88, 7, 23]]
    exact = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, progress=False)
    r = exact["results"][0]
    assert 1.0 <= r["tau"] <= 4 and r["tokens"] == NEW_TOKENS * len(prompts)
    loop = ev.evaluate_drafters(target, drafters, prompts, NEW_TOKENS, mode="loop", progress=False)
    assert loop["results"][0]["matches_greedy"]
    assert [p["acceptance_lengths"] for p in loop["results"][0]["prompts"]] == \
        [p["acceptance_lengths"] for p in r["prompts"]]


# -----------------------------------------------------------------------------
# 1. A tied lm_head: a fresh drafter does not start by drafting the mask token


def first_eval_loss(target, data, out, *flags):
    dflash.main(["--target", target, "--data", data, "--out", str(out), *SMALL, "--max_steps", "1", "--batch_size",
                 "2", "--grad_accum", "1", "--eval_fraction", "0.5", "--eval_walk_prompts", "0", "--device", "cpu",
                 "--no_progress", *flags])
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return next(r["eval_loss"] for r in records if r.get("step") == 0 and "eval_loss" in r)


def test_tied_target_first_loss_is_near_an_untied_ones(tmp_path, capsys):
    """Trained-scale embeddings (rows of norm ~3, as a pretrained model's): a fresh drafter's output at a masked
    offset is mostly its input, the mask token's embedding, which a tied lm_head scores highest, so every draft
    would be the mask token and the first loss ~3 ln V (14.9 measured, against 8.2 untied). Started off the mask
    token's row, the tied target's first held-out loss is no higher than the untied one's, and the run says why."""
    data = write_data(tmp_path / "d.jsonl", 32)
    untied = first_eval_loss(tiny_llama(tmp_path / "untied", initializer_range=0.5), data, tmp_path / "u")
    capsys.readouterr()
    tied = first_eval_loss(tiny_llama(tmp_path / "tied", initializer_range=0.5, tie_word_embeddings=True), data,
                           tmp_path / "t")
    out = capsys.readouterr().out
    print(f"first held-out loss: tied {tied:.3f}, untied {untied:.3f}")
    assert tied < untied + 0.5, (tied, untied)
    assert "tied" in out and "mask token" in out


def test_fresh_drafter_gives_the_mask_token_no_lead_on_a_tied_target(fam):
    """At a masked offset the fresh drafter's logit of the mask token is about zero, not the largest (Gemma3: tied
    and sqrt(D)-scaled); the untouched init (final norm 1) makes it the argmax of every masked offset."""
    _, target = fam("gemma3")
    row = target.embed.weight[VOCAB - 1].clone()
    with torch.no_grad():
        target.embed.weight[VOCAB - 1] *= 20  # a mask row of trained scale
    try:
        cfg = dflash.new_drafter_config(target, num_draft_layers=2, block_size=4, mask_token_id=VOCAB - 1,
                                        target_layer_ids=[1, 2], sliding_window=8)
        ids = torch.randint(3, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(0))
        anchors, valid = torch.tensor([[3, 7]]), torch.ones(1, 2, dtype=torch.bool)
        for start_off in (False, True):
            torch.manual_seed(0)
            drafter = dflash.DFlashDrafter(cfg)
            if start_off:
                dflash.start_off_mask(drafter, target)
            context, _ = dflash.target_features(target, ids, cfg.target_layer_ids)
            x = dflash.embed_blocks(target, dflash.block_input_ids(ids, anchors, 4, cfg.mask_token_id))
            with torch.no_grad():
                logits = target.lm_head(drafter(context, x, anchors, valid))[0, :, 1:]  # masked offsets
            argmax_is_mask = (logits.argmax(-1) == VOCAB - 1).all().item()
            assert argmax_is_mask != start_off, (start_off, logits[..., VOCAB - 1])
            if start_off:
                assert logits[..., VOCAB - 1].abs().max() < logits.std()
    finally:
        with torch.no_grad():
            target.embed.weight[VOCAB - 1] = row


# -----------------------------------------------------------------------------
# 2. A mask id that the data uses


def test_mask_id_the_data_uses_is_refused_with_its_count(tmp_path, capsys):
    """eos (2) as the mask token: counted while the data loads, refused with the count and an id the data never
    uses (one the tokenizer does not define, since this vocabulary has spare rows)."""
    target = tiny_qwen3(tmp_path / "t")
    rows = [{"input_ids": [5, 6, 7, 8, 2, 9, 10, 11, 2], "loss_mask": [0, 0, 1, 1, 1, 1, 1, 1, 1]}] * 20
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    line = one_error(capsys, dflash.main, ["--target", target, "--data", str(tmp_path / "d.jsonl"), "--out",
                                           str(tmp_path / "o"), *SMALL, "--mask_token_id", "2", "--no_progress"],
                     "--mask_token_id 2", "40 times", "an id the data never uses")
    assert not os.path.exists(tmp_path / "o" / "step_1")


def test_no_mask_token_is_one_line_with_the_flag(tmp_path, capsys):
    """A tokenizer that defines no mask token: one line naming --mask_token_id (no scan of the data for a hint)."""
    target = tiny_qwen3(tmp_path / "t", vocab_size=18)
    tiny_tokenizer().save_pretrained(target)
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], "loss_mask": [1] * 13}] * 4
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [a for a in SMALL if a not in ("--mask_token_id", str(VOCAB - 1))]
    one_error(capsys, dflash.main, ["--target", target, "--data", str(tmp_path / "d.jsonl"), "--out",
                                    str(tmp_path / "o"), *argv], "no mask token", "--mask_token_id")


# -----------------------------------------------------------------------------
# 3. A drafter trained for another target of the same shape


@pytest.fixture(scope="module")
def two_targets(tmp_path_factory, data):
    """Two Qwen3 targets of one shape (other seeds), a drafter trained one step against the first."""
    d = tmp_path_factory.mktemp("two")
    a = tiny_qwen3(d / "a")
    torch.manual_seed(1)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    b = str(d / "b")
    Qwen3ForCausalLM(Qwen3Config.from_pretrained(a)).save_pretrained(b)
    dflash.main(["--target", a, "--data", data, "--out", str(d / "run"), *SMALL, "--max_steps", "1",
                 "--batch_size", "2", "--grad_accum", "1", "--device", "cpu", "--no_progress"])
    return a, b, str(d / "run" / "step_1")


def test_checkpoint_records_its_target(two_targets):
    a, _, ckpt = two_targets
    rec = dflash.read_json(os.path.join(ckpt, dflash.TARGET_RECORD), "target record")
    assert rec["target"] == a and rec["fingerprint"] == dflash.target_record(dflash.load_target(a))["fingerprint"]
    # the fingerprint is of the target, not of its dtype or its path
    assert dflash.target_record(dflash.load_target(a, dtype=torch.bfloat16))["fingerprint"] == rec["fingerprint"]


def test_eval_refuses_a_drafter_of_another_target_unless_told(two_targets, tmp_path, capsys):
    a, b, ckpt = two_targets
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 9, 14, 3]}) + "\n")
    argv = ["--target", b, "--drafter", ckpt, "--prompts", str(prompts), "--max_new_tokens", "4", "--no_progress"]
    one_error(capsys, ev.main, argv, "trained against", a, "--allow_other_target")
    report = ev.main(argv + ["--allow_other_target"])
    assert report["results"][0]["drafter"] == ckpt
    assert "trained against" in capsys.readouterr().err  # still said, once, as a note
    ev.main(["--target", a] + argv[2:])
    assert "trained against" not in capsys.readouterr().err


def test_init_from_a_drafter_of_another_target_is_refused_unless_told(two_targets, data, tmp_path, capsys):
    _, b, ckpt = two_targets
    argv = ["--target", b, "--data", data, "--init_from", ckpt, "--max_steps", "1", "--batch_size", "2",
            "--grad_accum", "1", "--eval_fraction", "0", "--device", "cpu", "--no_progress"]
    one_error(capsys, dflash.main, argv + ["--out", str(tmp_path / "o1")], "--init_from", "trained against",
              "--allow_other_target")
    dflash.main(argv + ["--out", str(tmp_path / "o2"), "--allow_other_target"])
    assert os.path.isdir(tmp_path / "o2" / "step_1")


def test_resume_against_another_target_is_refused(two_targets, data, capsys):
    _, b, ckpt = two_targets
    one_error(capsys, dflash.main, ["--target", b, "--data", data, "--out", os.path.dirname(ckpt), *SMALL,
                                    "--max_steps", "2", "--batch_size", "2", "--grad_accum", "1", "--resume",
                                    "--no_progress"], f"checkpoint {ckpt}", "trained against", "--allow_other_target")


# -----------------------------------------------------------------------------
# 4. RoPE from the target's layers of the kind the drafter mirrors


def test_gemma3_drafter_rope_is_its_full_attention_layers(fam, capsys):
    """Gemma3's rope_parameters are per layer type (sliding 1e4, full 1e6): a new drafter takes the full-attention
    layers' base, whose geometry it mirrors, and says so."""
    _, target = fam("gemma3")
    cfg = dflash.new_drafter_config(target, num_draft_layers=2, block_size=4, mask_token_id=VOCAB - 1,
                                    target_layer_ids=[1, 2], sliding_window=8)
    assert cfg.rope_theta == 1e6
    out = capsys.readouterr().out
    assert "rope_theta 1000000" in out and "full_attention" in out
    _, llama = fam("llama_tied")
    assert dflash.new_drafter_config(llama, num_draft_layers=2, block_size=4, mask_token_id=VOCAB - 1,
                                     target_layer_ids=[1, 2]).rope_theta == 1e4


# -----------------------------------------------------------------------------
# 5. Refusals that say what to do


def test_gpt2_is_refused_naming_the_supported_families(tmp_path, capsys, monkeypatch):
    gpt2 = tiny_gpt2(tmp_path / "gpt2")
    devices = []
    load = dflash.load_target
    monkeypatch.setattr(dflash, "load_target", lambda name, device="cpu", *a, **k: devices.append(str(device)) or
                        load(name, device, *a, **k))
    line = one_error(capsys, dflash.main, ["--target", gpt2, "--data", str(tmp_path / "d.jsonl"), "--out",
                                           str(tmp_path / "o"), *SMALL], "gpt2", "not supported", "Llama", "Qwen3")
    assert "`layers`" not in line and devices == ["meta"]


@pytest.mark.parametrize("main,argv,typo,flag", [
    (dflash.main, [], "--mask_tokn_id", "--mask_token_id"),
    (dflash.main, [], "--max_step", "--max_steps"),          # a prefix is not taken silently
    (ev.main, ["--target", "t"], "--prompt", "--prompts"),
    (ev.main, ["--target", "t"], "--drafer", "--drafter"),
])
def test_flags_are_exact_with_the_closest_suggested(capsys, main, argv, typo, flag):
    line = one_error(capsys, main, argv + [typo, "5"], typo, f"did you mean {flag}")
    assert line.count("--") <= 3, line


REGENERATE = ["--server", "http://127.0.0.1:1/v1", "--model", "m", "--data", "d", "--out", "o"]


@pytest.mark.parametrize("tool,argv,typo,flag", [
    ("bench", [], "--jsn", "--json"),
    ("regenerate", REGENERATE, "--endpont", "--endpoint"),
    ("regenerate", REGENERATE, "--modle", "--model"),
])
def test_tool_parsers_are_exact_too(capsys, tool, argv, typo, flag):
    import importlib
    parser = importlib.import_module(f"dflash_tools.{tool}").get_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv + [typo, "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"did you mean {flag}" in err[0], err


# -----------------------------------------------------------------------------
# 6. Logs that read well when redirected


def test_redirected_training_log_has_no_progress_bar(tmp_path, data, capsys):
    """stderr is not a terminal here (pytest captures it): no bar redraws, one line per logged step on stdout."""
    target = tiny_qwen3(tmp_path / "t")
    capsys.readouterr()  # the set-up's own output (transformers' bar saving the target)
    dflash.main(["--target", target, "--data", data, "--out", str(tmp_path / "o"), *SMALL, "--max_steps", "3",
                 "--batch_size", "2", "--grad_accum", "1", "--device", "cpu"])
    cap = capsys.readouterr()
    assert "\r" not in cap.err and "it/s" not in cap.err, cap.err
    assert [line.split(":")[0] for line in cap.out.splitlines() if re.match(r"step \d+: loss", line)] == \
        ["step 1", "step 2", "step 3"]


def test_plan_of_a_small_model_counts_its_parameters_in_thousands(fam, capsys):
    path, _ = fam("llama_tied")
    with pytest.raises(SystemExit):  # --plan prints and exits
        dflash.main(["--target", path, "--plan", "--plan_gpu_gb", "80", *SMALL])
    out = capsys.readouterr().out
    assert re.search(r"drafter weights .* [0-9.]+K params", out) and "0.000B" not in out, out


def test_plan_counts_parameters_in_a_unit_that_fits():
    from dflash_tools.plan import params_text
    assert params_text(1_730_000_000) == "1.73B" and params_text(8_190_000) == "8.19M"
    assert params_text(45_100) == "45.10K" and params_text(512) == "512"
    assert params_text(122_400_000_000) == "122B"


def test_eval_table_keeps_whole_drafter_names():
    long = "runs/a-very-long-experiment-name/step_200"
    r = lambda name: {"drafter": name, "block_size": 2, "tau": 1.5, "tau_per_prompt": 1.5, "steps": 2,  # noqa: E731
                      "tokens": 3, "time_s": 0.1, "histogram": [1, 1], "per_offset_acceptance": [0.5]}
    report = {"target": "t", "mode": "exact", "num_prompts": 1, "max_new_tokens": 3,
              "timing": {"generate_s": 0.0, "features_s": 0.0}, "results": [r(long), r("b")]}
    import io
    f = io.StringIO()
    ev.print_report(report, f)
    header = next(line for line in f.getvalue().splitlines() if line.startswith("  L"))
    assert long in header
