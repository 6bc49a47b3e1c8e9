"""Memory options: the memory plan (--plan, from config.json alone), --grad_checkpoint; --zero runs are in
test_train.py with the other DDP runs."""
import json

import pytest
import torch

import dflash
from conftest import tiny_cfg
from dflash_tools.plan import memory_plan, plan_rows

# the published Qwen3.6-27B text geometry (transformers.Qwen3_5TextConfig field names)
QWEN36_27B = {"model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 64,
              "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16, "hidden_size": 5120,
              "intermediate_size": 17408, "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
              "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "vocab_size": 248320,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}


# a Qwen3.5-122B-A10B-class text config from its published facts (48 layers, 3:1 Gated DeltaNet / full attention,
# hidden 3072, 32 heads, 256 experts with 8 routed + 1 shared per token); the head and expert sizes are our assumption
QWEN35_122B = {**QWEN36_27B, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
               "num_hidden_layers": 48, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
               "hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 2, "linear_num_value_heads": 64,
               "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 1024,
               "shared_expert_intermediate_size": 1024}
del QWEN35_122B["intermediate_size"]


def config_dir(tmp_path_factory, config):
    d = tmp_path_factory.mktemp("target")
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


@pytest.fixture(scope="module")
def q36(tmp_path_factory):
    d = tmp_path_factory.mktemp("q36")
    (d / "config.json").write_text(json.dumps(QWEN36_27B))
    return str(d)


ZLAB_HEADS = ["--num_heads", "32", "--num_kv_heads", "8", "--head_dim", "128"]  # z-lab's drafter geometry


def plan_lines(capsys, argv):
    with pytest.raises(SystemExit) as e:
        dflash.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    return {line.strip().split("  ")[0]: line for line in out.splitlines()[1:]}


def test_plan_qwen36_27b_on_8x80gb(q36, capsys, tmp_path):
    """--plan from a directory holding only config.json: no weights, no --data; the terms and the verdicts."""
    rows = plan_lines(capsys, ["--target", q36, "--plan", "--mask_token_id", "248070", "--plan_world_size", "8",
                               "--plan_gpu_gb", "80", "--out", str(tmp_path / "out"), "--num_heads", "32",
                               "--num_kv_heads", "8", "--head_dim", "128"])  # z-lab's geometry, not the target's
    assert 53 <= float(rows["target weights"].split("GB")[0].split()[-1]) <= 55, rows["target weights"]
    params = float(rows["drafter weights"].split("GB")[1].split("B params")[0])
    assert 1.70 <= params <= 1.76, rows["drafter weights"]
    assert "does not fit" in rows["plain DDP"] and "does not fit" in rows["--zero"]
    assert rows["--zero --grad_checkpoint"].endswith(" fits")
    assert "fits with --zero --grad_checkpoint" in rows["verdict: does not fit; fits with --zero --grad_checkpoint"]
    assert not (tmp_path / "out").exists()


def test_plan_bad_input_and_cuda_refusal(q36, capsys):
    """One error line each: --plan without a target, --plan_world_size 0, a CUDA run whose plan cannot fit."""
    for argv, want in ((["--plan"], "--target is required"),
                       (["--target", q36, "--plan", "--plan_world_size", "0"], "outside its valid range")):
        with pytest.raises(SystemExit) as e:
            dflash.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and want in err, err
    meta = dflash.load_target(q36, "meta")
    args = vars(dflash.get_parser().parse_args(["--mask_token_id", "248070", "--plan_gpu_gb", "80"]))
    cfg = dflash.DFlashConfig()
    with pytest.raises(dflash.DFlashError, match=r"add --zero --grad_checkpoint \(or check with --plan\)"):
        memory_plan(args, cfg.__dict__, dflash.expected_shapes(cfg), meta, 8, torch.device("cuda"))
    capsys.readouterr()


def test_plan_shard_target(q36, tmp_path_factory, capsys, tmp_path):
    """--shard_target in the plan: Qwen3.6-27B on 8 x 48 GB fits only with it (with --zero), and the all-gather line
    says 42.6 GB per forward (7/8 of the bf16 decoder), hidden on NVLink, not on PCIe; a 122B MoE target fits 8 x 80
    GB with it alone, and its gathers are not hidden even on NVLink (a token runs through 8 of 256 experts)."""
    out = ["--out", str(tmp_path / "out"), "--plan_world_size", "8", *ZLAB_HEADS]
    rows = plan_lines(capsys, ["--target", q36, "--plan", "--mask_token_id", "248070", "--plan_gpu_gb", "48", *out])
    assert "fits with --zero --shard_target" in rows["verdict: does not fit; fits with --zero --shard_target"]
    assert rows["--zero --grad_checkpoint"].endswith("does not fit") and rows["--zero --shard_target"].endswith("fits")
    traffic = next(v for k, v in rows.items() if k.startswith("--shard_target: each"))
    assert "all-gathers 42.6 GB per rank: 0.12 s over NVLink" in traffic
    assert "hidden by the prefetch on NVLink, dominant on PCIe" in traffic
    rows = plan_lines(capsys, ["--target", q36, "--plan", "--mask_token_id", "248070", "--plan_gpu_gb", "80",
                               "--shard_target", *out])
    whole = 2 * 248320 * 5120 * 2 / 1e9  # the embedding and the lm_head, bf16, on every rank
    assert float(rows["target weights"].split("GB")[0].split()[-1]) == pytest.approx((53.79 - whole) / 8 + whole,
                                                                                   abs=0.02)
    assert float(rows["gathered target layers"].split("GB")[0].split()[-1]) > 1  # two whole layers
    big = config_dir(tmp_path_factory, QWEN35_122B)
    rows = plan_lines(capsys, ["--target", big, "--plan", "--mask_token_id", "248070", "--intermediate_size", "9216",
                               "--plan_gpu_gb", "80", *out])
    assert 121 < float(rows["target weights"].split("GB")[1].split("B params")[0]) < 123
    assert rows["--zero --grad_checkpoint"].endswith("does not fit")
    assert "verdict: does not fit; fits with --shard_target" in rows
    assert "not hidden on NVLink" in next(v for k, v in rows.items() if k.startswith("--shard_target: each"))
    one = plan_lines(capsys, ["--target", q36, "--plan", "--mask_token_id", "248070", "--plan_gpu_gb", "80",
                              "--out", str(tmp_path / "out"), "--plan_world_size", "1"])
    assert not any("--shard_target" in k for k in one)  # nothing to shard over on one rank


def test_plan_rows_is_plain_arithmetic():
    """plan_rows: plain dicts in, rows out (what a GPU script compares with torch.cuda.max_memory_allocated)."""
    d = dict(params=10**9, hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, head_dim=128, block_size=16, layer_kinds=[True, False], context_layers=2)
    t = dict(params=8 * 10**9, hidden_size=1024, intermediate_size=4096, vocab_size=32000, context_layers=2)
    run = dict(world=4, zero=True, grad_checkpoint=False, num_anchors=64, batch_size=1, max_len=1000,
               attention="flex", target_bytes=2, act_bytes=2)
    rows = dict((name, v) for name, v, _ in plan_rows(t, d, run))
    assert rows["target weights"] == 16e9 and rows["drafter weights"] == rows["drafter gradients"] == 4e9
    assert rows["AdamW moments"] == 2e9 and rows["DDP gradient buckets"] == 0
    ckpt = dict((name, v) for name, v, _ in plan_rows(t, d, {**run, "grad_checkpoint": True}))
    assert ckpt["drafter activations"] < rows["drafter activations"]
    # --shard_target: the decoder (7.5B of 8B) split over 4 ranks, the rest whole, two layers gathered in flight
    shard = dict((name, v) for name, v, _ in plan_rows({**t, "decoder_params": 75 * 10**8, "layer_params": 10**8}, d,
                                                       {**run, "shard_target": True}))
    assert shard["target weights"] == (75e8 / 4 + 5e8) * 2 and shard["gathered target layers"] == 4e8
    assert rows["gathered target layers"] == 0
    assert shard["peak per rank"] < rows["peak per rank"]


def test_grad_checkpoint_gradients_equal_plain(one_thread):
    """--grad_checkpoint recomputes each layer in backward: the same loss and gradients (within 1e-6)."""
    cfg = tiny_cfg()
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).train()
    g = torch.Generator().manual_seed(1)
    S, N, B, D = 24, 5, cfg.block_size, cfg.hidden_size
    context = torch.randn(2, S, len(cfg.target_layer_ids) * D, generator=g)
    x = torch.randn(2, N, B, D, generator=g)
    anchors = torch.randint(1, S - B, (2, N), generator=g)
    valid = torch.ones(2, N, dtype=torch.bool)
    grads = []
    for ckpt in (False, True):
        drafter.grad_checkpoint = ckpt
        drafter.zero_grad(set_to_none=True)
        drafter(context, x, anchors, valid).pow(2).mean().backward()
        grads.append({k: p.grad.clone() for k, p in drafter.named_parameters()})
    assert max((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0]) <= 1e-6


# -----------------------------------------------------------------------------
# The plan's drafter-side terms against what a training step actually holds (CPU, fp32, dense attention)

# (drafter overrides of tiny_cfg(), sequence length, anchors, batch): context shorter than 2 * CONTEXT_TILE, so the
# dense path computes every block against the whole context, as the plan counts
PLAN_SHAPES = ((dict(hidden_size=64, intermediate_size=192, head_dim=16, block_size=8), 128, 16, 1),
               (dict(hidden_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=16, block_size=8), 256, 24, 2))


def plan_terms(cfg, S, N, b, grad_checkpoint):
    """The plan's weights + gradients + AdamW and activation terms, in bytes (one rank, fp32, dense)."""
    import dataclasses
    from dflash_tools.plan import drafter_sizes
    d = drafter_sizes(dataclasses.asdict(cfg), dflash.expected_shapes(cfg))
    t = dict(params=0, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             vocab_size=cfg.vocab_size, context_layers=d["context_layers"])
    run = dict(world=1, zero=False, grad_checkpoint=grad_checkpoint, num_anchors=N, batch_size=b, max_len=S,
               attention="dense", target_bytes=4, act_bytes=4)
    rows = dict((name, v) for name, v, _ in plan_rows(t, d, run))
    return rows["drafter weights"] + rows["drafter gradients"] + rows["AdamW moments"], rows["drafter activations"]


def measured_terms(cfg, S, N, b, grad_checkpoint):
    """One training step (forward, chunked loss, backward, AdamW), counted exactly: the parameters, gradients and
    AdamW state, and the bytes of every storage saved for backward (saved_tensors_hooks, each once, parameters and
    the lm_head excluded)."""
    g = torch.Generator().manual_seed(0)
    D, B = cfg.hidden_size, cfg.block_size
    torch.manual_seed(0)
    drafter = dflash.DFlashDrafter(cfg).train()
    drafter.grad_checkpoint = grad_checkpoint
    opt = torch.optim.AdamW(drafter.parameters())
    lm_head = torch.nn.Linear(D, cfg.vocab_size, bias=False).requires_grad_(False)
    loss_mask = torch.ones(b, S, dtype=torch.long)
    anchors, valid = (torch.stack(t) for t in zip(*[dflash.sample_anchors(loss_mask[0], N, g) for _ in range(b)]))
    weights = dflash.loss_weights(anchors, valid, loss_mask, B, gamma=4.0)
    labels = torch.randint(0, cfg.vocab_size, (b, N, B), generator=g)
    context = torch.randn(b, S, len(cfg.target_layer_ids) * D, generator=g)
    skip = {p.untyped_storage().data_ptr() for p in [*drafter.parameters(), lm_head.weight]}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = drafter(context, torch.randn(b, N, B, D, generator=g), anchors, valid)
        loss = dflash.weighted_ce(hidden, lm_head, labels, weights)[0] / weights.sum()
    loss.backward()
    opt.step()
    state = [*drafter.parameters(), *(p.grad for p in drafter.parameters())]
    state += [v for st in opt.state.values() for v in st.values() if v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in state), sum(saved.values())


@pytest.mark.parametrize("shape", range(len(PLAN_SHAPES)))
def test_plan_matches_a_measured_training_step(shape, one_thread):
    """Weights + gradients + AdamW exactly, the activations saved for backward within 10%. With --grad_checkpoint
    the hooks see only what lives outside the checkpointed layers (the layers' inputs are kept by the checkpoint
    itself): there the plan must cover what they count, and both must fall below half of the plain step's."""
    over, S, N, b = PLAN_SHAPES[shape]
    cfg = tiny_cfg(**over)
    (p_state, plan), (m_state, measured) = plan_terms(cfg, S, N, b, False), measured_terms(cfg, S, N, b, False)
    assert p_state == m_state
    assert 0.9 <= plan / measured <= 1.1, f"plan {plan} vs measured {measured} bytes saved for backward"
    (_, plan_ckpt), (_, measured_ckpt) = plan_terms(cfg, S, N, b, True), measured_terms(cfg, S, N, b, True)
    assert measured_ckpt <= plan_ckpt < plan / 2 and measured_ckpt < measured / 2
