"""--loss: the paper's weighted CE and D-PACE (with its two ablations), against an independent float64 reference
written from D-PACE's formulas (a Python loop over block positions): the weights, the loss and every drafter
gradient on a batch with padding anchors, blocks running past the end of a sequence and a loss mask with holes; a
training step split over micro-steps equals one batch; the tau estimate does not depend on the loss. The run's
record (logs, train_state, a refused resume with another loss): at the end. Two ranks: tests/test_shard.py."""
import copy
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

import dflash
from dflash_tools import losses
from conftest import SMALL, VOCAB, build_qwen3, one_error, tiny_cfg, torch_threads, write_data

DPACE = ("dpace", "dpace-prefix", "dpace-continuation")
B = 6  # block size: offsets 1..5 are drafted
DRAFTER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, vocab_size=VOCAB, block_size=B,
               mask_token_id=VOCAB - 1, target_layer_ids=[1, 3], num_target_layers=4,
               layer_types=["sliding_attention", "full_attention"], sliding_window=8)

pytestmark = pytest.mark.usefixtures("one_thread")


# -----------------------------------------------------------------------------
# The reference: D-PACE's formulas, position by position, in float64


def reference_weights(q, valid, alpha, loss):
    """One block: q[i] the drafter's probability of the label at offset i, valid[i] whether offset i is trained on.
    s_i = (1-alpha) q_i + alpha; P_j = prod_{i<=j} s_i with an invalid position counting as 1;
    w_j = sum_{m>=j, m valid} P_m (dpace), P_j (dpace-prefix), w_j / P_j (dpace-continuation); 0 where invalid."""
    s = [(1 - alpha) * q[i] + alpha if valid[i] else 1.0 for i in range(len(q))]
    P = [math.prod(s[:j + 1]) for j in range(len(q))]
    w = []
    for j in range(len(q)):
        suffix = sum(P[m] for m in range(j, len(q)) if valid[m])
        w.append(0.0 if not valid[j] else
                 {"dpace": suffix, "dpace-prefix": P[j], "dpace-continuation": suffix / P[j]}[loss])
    return w


def reference_loss(hidden, lm_head_weight, labels_all, loss_mask, anchors, anchor_valid, loss, alpha=0.5, gamma=4.0,
                   detach=True):
    """The loss of a batch from the drafter's hidden states (b, N, B, D) (float64, with gradient), one position at a
    time. Valid: offset i >= 1, a+i inside the sequence, loss_mask[a+i] = 1, a real anchor. CE: sum(w * CE) / sum(w),
    w = exp(-(i-1)/gamma). D-PACE: sum(w * CE) / (number of sequences), w from the probabilities exp(-CE), detached
    (or, detach=False, kept in the graph: not D-PACE). Returns (loss, the weights as nested lists of floats)."""
    b, N = anchors.shape
    S = loss_mask.shape[1]
    total, norm, weights = hidden.new_zeros(()), 0.0, []
    for r in range(b):
        norm += loss != "ce" and bool(anchor_valid[r].any())  # a sequence
        for n in range(N):
            a = int(anchors[r, n])
            valid = [bool(anchor_valid[r, n]) and i >= 1 and a + i < S and bool(loss_mask[r, a + i]) for i in range(B)]
            ce = [-F.log_softmax(hidden[r, n, i] @ lm_head_weight.T, -1)[labels_all[r, a + i]] if valid[i] else None
                  for i in range(B)]
            if loss == "ce":
                w = [math.exp(-(i - 1) / gamma) if valid[i] else 0.0 for i in range(B)]
                norm += sum(w)
            else:
                q = [0.0 if c is None else math.exp(-c.item()) if detach else (-c).exp() for c in ce]
                w = reference_weights(q, valid, alpha, loss)
            weights.append([float(x.detach()) if torch.is_tensor(x) else x for x in w])
            for i in range(B):
                if valid[i]:
                    total = total + w[i] * ce[i]
    return total / norm, weights


# -----------------------------------------------------------------------------
# A tiny target, a drafter, and a batch with every kind of invalid position


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with torch_threads(1):
        path = str(tmp_path_factory.mktemp("q3"))
        model = build_qwen3().eval()
        model.save_pretrained(path)
        target = dflash.load_target(path)
        torch.manual_seed(0)
        drafter = dflash.DFlashDrafter(tiny_cfg(DRAFTER))
        for p in drafter.parameters():  # larger weights than the init's: confident, uneven drafts, so the
            p.data.normal_(0, 0.3 if p.dim() > 1 else 1.0)  # D-PACE weights differ from any fixed decay
        g = torch.Generator().manual_seed(3)
        ids = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (20, 12)]
        masks = [[0] * 4 + [1] * 6 + [0] * 2 + [1] * 8,  # a hole at 10, 11
                 [0] * 3 + [1] * 9]                      # shorter: padded to 20 with loss_mask 0
        batch = dflash.collate(list(zip(ids, masks)), pad_id=0, keys=[11, 22])
        # by hand: a block over the hole (a=8), blocks past the sequence end (a=18: S=20; row 1 a=10: its end at 12),
        # padding anchors (valid False)
        anchors = torch.tensor([[4, 8, 9, 13, 16, 18, 0], [3, 6, 9, 10, 0, 0, 0]])
        valid = torch.tensor([[True] * 6 + [False], [True] * 4 + [False] * 3])
        with torch.no_grad():  # labels_all[t]: the target's greedy token at t, from its logits at t - 1
            logits = model(batch["input_ids"]).logits
        labels_all = F.pad(logits.argmax(-1)[:, :-1], (1, 0), value=-1)
    return {"target": target, "model": model, "drafter": drafter, "batch": batch, "anchors": anchors, "valid": valid,
            "labels_all": labels_all}


def ours(setup, loss, alpha=0.5, drafter=None):
    """dflash_loss's loss, stats and drafter gradients (fp32)."""
    d = drafter or setup["drafter"]
    d.zero_grad(set_to_none=True)
    w = dflash.loss_weights(setup["anchors"], setup["valid"], setup["batch"]["loss_mask"], B, 4.0)
    out, stats = dflash.dflash_loss(d, d.cfg, setup["target"], setup["batch"], setup["anchors"], setup["valid"], w,
                                    noise_std=0.0, loss=None if loss == "ce" else losses.DPACE(loss, alpha))
    out.backward()
    return out.item(), stats, {k: p.grad.clone() for k, p in d.named_parameters()}


def reference(setup, loss, alpha=0.5, detach=True):
    """The reference loss and drafter gradients: a float64 copy of the drafter, the positions walked one by one."""
    d64 = copy.deepcopy(setup["drafter"]).double()
    batch, anchors, valid, target = setup["batch"], setup["anchors"], setup["valid"], setup["target"]
    context, _ = dflash.target_features(target, batch["input_ids"], d64.cfg.target_layer_ids)
    blocks = torch.full((*anchors.shape, B), d64.cfg.mask_token_id)
    blocks[..., 0] = batch["input_ids"].gather(1, anchors)  # [tok[a], M, ..., M]
    x = setup["model"].get_input_embeddings()(blocks).detach().double()
    hidden = d64(context.double(), x, anchors, valid)
    out, weights = reference_loss(hidden, setup["model"].lm_head.weight.detach().double(), setup["labels_all"],
                                  batch["loss_mask"], anchors, valid, loss, alpha, detach=detach)
    out.backward()
    return out.item(), weights, {k: p.grad for k, p in d64.named_parameters()}


def test_the_batch_has_every_kind_of_invalid_position(setup):
    """The premise of the comparisons below: padding anchors, a hole inside a block, blocks past the sequence end
    and past the end of a shorter row, and a block whose every offset is valid."""
    zeros = torch.zeros(2, 7, B, 4, dtype=torch.float64), torch.zeros(VOCAB, 4, dtype=torch.float64)
    _, weights = reference_loss(*zeros, setup["labels_all"], setup["batch"]["loss_mask"], setup["anchors"],
                                setup["valid"], "ce")
    valid = [[w > 0 for w in blk] for blk in weights]
    assert valid[1] == [False, True, False, False, True, True]    # a=8: the hole at 10, 11
    assert valid[5] == [False, True] + [False] * 4                # a=18: 20.. outside the sequence
    assert valid[7 + 3] == [False, True] + [False] * 4            # row 1, a=10: 12.. is padding
    assert not any(valid[6]) and not any(valid[7 + 4])            # padding anchors
    assert valid[0] == [False] + [True] * 5                       # a=4: a whole block


@pytest.mark.parametrize("loss", DPACE)
@pytest.mark.parametrize("alpha", [0.0, 0.35, 1.0])
def test_dpace_weights_match_the_reference(loss, alpha):
    g = torch.Generator().manual_seed(1)
    q = torch.rand(3, 4, B, generator=g, dtype=torch.float64)
    valid = torch.rand(3, 4, B, generator=g) > 0.3
    valid[..., 0] = False
    w = losses.dpace_weights(q, valid, alpha, loss)
    expected = [reference_weights(q[r, n].tolist(), valid[r, n].tolist(), alpha, loss) for r in range(3)
                for n in range(4)]
    torch.testing.assert_close(w.flatten(0, 1), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)


def test_dpace_weights_by_hand():
    """B=4, alpha=0.5, q = 0.6, 0.2 (a hole), 0.8: s = 0.8, 1, 0.9; P = 0.8, 0.8, 0.72."""
    q = torch.tensor([[[0.0, 0.6, 0.2, 0.8]]], dtype=torch.float64)
    valid = torch.tensor([[[False, True, False, True]]])
    by_hand = {"dpace": [0, 0.8 + 0.72, 0, 0.72], "dpace-prefix": [0, 0.8, 0, 0.72],
               "dpace-continuation": [0, (0.8 + 0.72) / 0.8, 0, 1.0]}
    for loss, w in by_hand.items():
        torch.testing.assert_close(losses.dpace_weights(q, valid, 0.5, loss)[0, 0], torch.tensor(w).double())


@pytest.mark.parametrize("loss", ("ce",) + DPACE)
def test_loss_and_every_gradient_match_the_reference(setup, loss):
    """dflash_loss (fp32, chunked lm_head CE, the weights from its own pass) equals the float64 position loop: the
    loss, and the gradient of every drafter parameter (the D-PACE weights carry none: detached)."""
    alpha = 0.35
    mine, stats, grads = ours(setup, loss, alpha)
    ref, weights, ref_grads = reference(setup, loss, alpha)
    assert mine == pytest.approx(ref, rel=1e-5)
    assert dflash.summarize(stats)["loss"] == pytest.approx(ref, rel=1e-5)
    assert stats["w"].item() == pytest.approx(2 if loss != "ce" else sum(map(sum, weights)), rel=1e-6)
    assert set(grads) == set(ref_grads) and len(grads) > 10
    for k, g in grads.items():
        assert ref_grads[k].abs().max() > 0, k
        err = ((g.double() - ref_grads[k]).norm() / ref_grads[k].norm()).item()
        assert err < 1e-4, (k, err)


def test_the_losses_differ_and_detaching_matters(setup):
    """The premise of the test above: the four losses give four different gradients on this batch, and D-PACE's
    gradient is not that of its weights kept in the graph (the reference detaches them; so does dflash_loss)."""
    fc = {loss: ours(setup, loss, 0.35)[2]["fc.weight"].double() for loss in ("ce",) + DPACE}
    for a in fc:
        for b in fc:
            assert a == b or (fc[a] - fc[b]).norm() > 0.01 * fc[a].norm(), (a, b)
    for loss in DPACE:
        in_graph = reference(setup, loss, 0.35, detach=False)[2]["fc.weight"]
        assert (in_graph - fc[loss]).norm() > 0.01 * fc[loss].norm(), loss


def test_tau_estimate_and_accuracy_do_not_depend_on_the_loss(setup):
    """The per-offset accuracy, accepted drafts and blocks (the tau estimate) come from the valid positions and the
    argmax alone: the same numbers, bit for bit, whichever loss (and alpha) weighs the CE."""
    ref = ours(setup, "ce")[1]
    for loss, alpha in [(loss, a) for loss in DPACE for a in (0.0, 0.5, 1.0)]:
        stats = ours(setup, loss, alpha)[1]
        for k in ("correct", "count", "accepted", "blocks"):
            assert torch.equal(stats[k], ref[k]), (loss, alpha, k)
        assert dflash.summarize(stats)["tau"] == dflash.summarize(ref)["tau"]


def test_a_training_step_split_into_micro_steps_equals_one_batch(setup):
    """train_step normalises every micro-step by the whole global batch's normaliser (D-PACE: its number of
    sequences), counted before any forward: 2 micro-batches of 1 row give one batch of 2 rows' update, which is
    the reference gradient of the whole batch (plain SGD at lr 1, so the update is the gradient itself)."""
    target, batch = setup["target"], setup["batch"]
    rows = [dflash.collate([(batch["input_ids"][r, :n].tolist(), batch["loss_mask"][r, :n].tolist())], 0,
                           keys=[batch["keys"][r]]) for r, n in ((0, 20), (1, 12))]
    kw = dict(gamma=4.0, noise_std=0.0, labels="target", pad_to=None, loss=losses.DPACE("dpace", 0.5))
    deltas = []
    for micro in (rows, [batch]):
        d = copy.deepcopy(setup["drafter"])
        before = {k: p.detach().clone() for k, p in d.named_parameters()}
        opt = torch.optim.SGD(d.parameters(), lr=1.0)
        total, _, ok = dflash.train_step(d, opt, target, d.cfg, micro, 1.0, 5, 1e9, 1, **kw)
        assert ok
        deltas.append(({k: before[k] - p.detach() for k, p in d.named_parameters()}, dflash.summarize(total)["loss"]))
    # the reference on the anchors train_step drew (keyed by the sample: the same either way)
    anchors, valid = dflash.batch_anchors(batch, 5)
    ref, _, ref_grads = reference({**setup, "anchors": anchors, "valid": valid}, "dpace", 0.5)
    for delta, loss in deltas:
        assert loss == pytest.approx(ref, rel=1e-5)
        for k, g in delta.items():
            err = ((g.double() - ref_grads[k]).norm() / ref_grads[k].norm()).item()
            assert err < 1e-4, (k, err)


# -----------------------------------------------------------------------------
# The run's record: the logs and the checkpoint say which loss trained it; a resume with another is refused


def test_the_run_records_its_loss_and_refuses_another_on_resume(tmp_path, capsys):
    d = tmp_path
    model_dir = d / "q3"
    build_qwen3().save_pretrained(model_dir)
    data = write_data(d / "data.jsonl", 24)
    out = str(d / "run")
    base = ["--target", str(model_dir), "--data", data, *SMALL[:-2], "--eval_fraction", "0.25",
            "--eval_walk_prompts", "2", "--eval_walk_tokens", "8", "--batch_size", "2", "--grad_accum", "1"]
    run = base + ["--out", out, "--loss", "dpace", "--dpace_alpha", "0.25"]
    dflash.main(run + ["--max_steps", "2"])
    printed = capsys.readouterr().out
    assert "loss dpace (dpace_alpha 0.25)" in printed and "eval loss" in printed and "(dpace)" in printed
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 2] and len(records) == 4
    assert all(r["loss_type"] == "dpace" for r in records)
    state = torch.load(os.path.join(out, "step_2", "train_state.pt"), weights_only=False)
    assert (state["loss"], state["args"]["dpace_alpha"]) == ("dpace", 0.25)
    for flags, needles in ((["--loss", "ce"], ("--loss dpace", "--loss ce")),  # (run's --dpace_alpha dropped below)
                           (["--loss", "dpace-prefix"], ("--loss dpace", "--loss dpace-prefix")),
                           (["--dpace_alpha", "0.5"], ("--dpace_alpha 0.25", "--dpace_alpha 0.5"))):
        argv = run[:-2] if flags[1] == "ce" else run  # --dpace_alpha goes only with D-PACE's losses
        one_error(capsys, dflash.main, argv + flags + ["--max_steps", "3", "--resume"], "cannot resume", "step_2",
                  *needles)
    dflash.main(run + ["--max_steps", "3", "--resume"])  # the same loss: it continues
    assert "resumed from" in capsys.readouterr().out
    # a checkpoint from before --loss existed (no "loss" in its train_state) was trained with the CE
    del state["loss"]
    torch.save(state, os.path.join(out, "step_3", "train_state.pt"))
    one_error(capsys, dflash.main, run + ["--max_steps", "4", "--resume"], "cannot resume", "--loss ce",
              "--loss dpace")
    one_error(capsys, dflash.main, base + ["--out", out, "--max_steps", "4", "--resume", "--dpace_alpha", "0.9"],
              "--dpace_alpha is a flag of --loss dpace", "drop --dpace_alpha")  # ce: only D-PACE's losses take it
    dflash.main(base + ["--out", out, "--max_steps", "4", "--resume"])
    assert "resumed from" in capsys.readouterr().out


def test_loss_flags_are_checked_where_they_are_parsed(capsys):
    p = dflash.get_parser()
    assert (p.parse_args([]).loss, p.parse_args(["--loss", "dpace"]).dpace_alpha) == ("ce", 0.5)
    for bad in (["--loss", "kl"], ["--loss", "dpace", "--dpace_alpha", "1.5"], ["--loss", "dpace", "--dpace_alpha", "-0.1"],
                ["--dpace_alpha", "0.3"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert len(err) == 1 and err[0].startswith("error: ") and bad[-2] in err[0], err


def test_held_out_loss_counts_real_sequences_only(setup):
    """evaluate fills a short last batch with empty rows (one shape for every batch): they are not sequences, so
    the held-out D-PACE loss is the same whatever the batch size, and its tau estimate is the CE run's."""
    batch = setup["batch"]
    samples = [(batch["input_ids"][r, :n].tolist(), batch["loss_mask"][r, :n].tolist()) for r, n in ((0, 20), (1, 12))]
    samples.append(samples[0])
    args = (setup["target"], samples)
    kw = dict(num_anchors=5, pad_id=0, seed=0, rank=0, world=1, gamma=4.0, noise_std=0.0, labels="target")
    setup["drafter"].eval()
    m = {(bs, loss): dflash.evaluate(setup["drafter"], *args, bs, loss=losses.DPACE(loss, 0.5) if loss != "ce" else None,
                                         **kw)
         for bs in (1, 2) for loss in ("ce", "dpace")}
    setup["drafter"].train()
    assert m[2, "dpace"]["loss"] == pytest.approx(m[1, "dpace"]["loss"], rel=1e-6)  # 3 sequences, not 4
    assert m[1, "dpace"]["loss"] != pytest.approx(m[1, "ce"]["loss"], rel=1e-3)
    assert m[2, "dpace"]["tau"] == m[2, "ce"]["tau"] and m[2, "dpace"]["acc"] == m[2, "ce"]["acc"]
