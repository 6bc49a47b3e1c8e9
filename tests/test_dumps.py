"""dflash_tools/dumps.py: the feature dumps speculators (vLLM's extract_hidden_states) and SpecForge
(prepare_hidden_states.py) write, made here in their documented layouts from a tiny target, read back equal to what
dflash.target_features and dflash.greedy_labels give for the same tokens; and every refusal one line."""
import gzip
import os

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

import dflash
from conftest import build_qwen3, refused
from dflash_tools.dumps import dump_kind, open_dump

L, D, V = 4, 32, 96  # conftest's tiny Qwen3
CONFIG = dict(num_hidden_layers=L, hidden_size=D, vocab_size=V)


@pytest.fixture(scope="module")
def target(one_thread_module):
    m = build_qwen3()
    return dflash.Target(m, dflash.find_decoder(m), m.get_input_embeddings(), m.get_output_embeddings(), None, "tiny")


@pytest.fixture(scope="module")
def samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for S in (9, 14, 11):
        ids = torch.randint(3, V, (S,), generator=g)
        mask = torch.zeros(S, dtype=torch.long)
        mask[S // 3:] = 1
        out.append((ids, mask))
    return out


def ours(target, ids, layer_ids):
    """Our features and labels for one sample: (S, m*D), (S,)."""
    ctx, final = dflash.target_features(target, ids[None], layer_ids)
    return ctx[0], dflash.greedy_labels(final, target.lm_head)[0]


# SpecForge captures a row inside its padded batch: a forward over another shape, equal to ours in exact arithmetic
# but not in the last bit on every CPU (kernels block and vectorise by length). Such rows are compared within a few
# fp32 ulps of these ~0.1-sized states (measured: <= 1e-8 apart, 6e-7 on the ~3-sized final state); the row as long
# as its batch is the same computation as ours and stays bitwise.
PADDED = dict(atol=1e-6, rtol=1e-5)


def same_as_ours(s, target, ids, layer_ids, padded):
    """A SpecForge row's features (and labels, if read) against ours: bitwise unpadded, within PADDED padded. A label
    may only differ where the target's top two logits are closer than the padding's rounding could move them."""
    feats, labels = ours(target, ids, layer_ids)
    if not padded:
        assert torch.equal(s["features"], feats) and (s["labels"] is None or torch.equal(s["labels"], labels))
        return
    torch.testing.assert_close(s["features"], feats, **PADDED)
    if s["labels"] is not None:
        _, final = dflash.target_features(target, ids[None], layer_ids)
        top2 = target.lm_head(final[0, :-1]).topk(2, dim=-1).values
        clear = torch.cat([torch.tensor([True]), top2[:, 0] - top2[:, 1] > 1e-4])
        assert clear.float().mean() > 0.9 and torch.equal(s["labels"][clear], labels[clear])


@torch.no_grad()
def vllm_streams(target, ids):
    """vLLM's layer ids 0..L as its EagleModelMixin records them: id k is the residual stream entering decoder layer k
    (0: the embedding's output), id L the last layer's output before the final norm. Hugging Face's hidden_states
    are those for k < L; its last is after the norm, so the norm is lifted out for this pass."""
    decoder = target.backbone
    norm, decoder.norm = decoder.norm, nn.Identity()
    try:
        return decoder(input_ids=ids[None], output_hidden_states=True).hidden_states  # L+1 of (1, S, D)
    finally:
        decoder.norm = norm


@torch.no_grad()
def hf_states(target, ids):
    """(Hugging Face's hidden_states, the final hidden state after the norm): SGLang's "after layer k" is [k+1]."""
    out = target.backbone(input_ids=ids[None], output_hidden_states=True)
    return out.hidden_states, out.last_hidden_state


def write_speculators(root, target, samples, vllm_ids, dtype=torch.float32, rows=None):
    """prepare_data.py's save_to_disk dataset at root (input_ids, loss_mask, seq_len; in torch format, as its
    build_eagle3_dataset sets it) and vLLM's ExampleHiddenStates connector's files
    root/hidden_states/hs_{i}.safetensors: token_ids [S], hidden_states [S, n, D], one slot per launch id, in layer
    order."""
    from datasets import Dataset
    ds = Dataset.from_dict({"input_ids": [ids.tolist() for ids, _ in samples],
                            "loss_mask": [mask.tolist() for _, mask in samples],
                            "seq_len": [len(ids) for ids, _ in samples]})
    ds.set_format("torch")
    ds.save_to_disk(str(root))
    os.makedirs(root / "hidden_states", exist_ok=True)
    for i, (ids, _) in enumerate(samples):
        if rows is None or i in rows:
            hs = vllm_streams(target, ids)
            stack = torch.stack([hs[k][0] for k in sorted(vllm_ids)], dim=1).to(dtype)
            save_file({"hidden_states": stack.contiguous(), "token_ids": ids.clone()},
                      str(root / "hidden_states" / f"hs_{i}.safetensors"))
    return str(root)


def write_specforge(root, target, samples, layer_ids, record="dflash", compress=False, group=2000):
    """prepare_hidden_states.py's output: root/rows_{a}-{a+group}/data_{i}.ckpt(.gz), a torch.save dict a sample:
    input_ids, loss_mask and DFlash's hidden_states [1, S, m*D] (DSpark: plus target_last_hidden_states) or EAGLE3's
    aux_hidden_state and hidden_state; each a row of its padded batch (token 0, loss 0 on the right up to the
    batch's longest, captured as well)."""
    longest = max(len(s[0]) for s in samples)
    for i, (ids, mask) in enumerate(samples):
        pad = longest - len(ids)
        ids, mask = torch.cat([ids, ids.new_zeros(pad)]), torch.cat([mask, mask.new_zeros(pad)])
        hs, final = hf_states(target, ids)
        aux = torch.cat([hs[k + 1] for k in sorted(layer_ids)], dim=-1)  # (1, S, m*D)
        rec = {"input_ids": ids.clone(), "loss_mask": mask.clone()}
        if record == "eagle3":
            rec.update(aux_hidden_state=aux, hidden_state=final)
        else:
            rec["hidden_states"] = aux
            if record == "dspark":
                rec["target_last_hidden_states"] = final
        a = i // group * group
        d = root / f"rows_{a}-{a + group}"
        os.makedirs(d, exist_ok=True)
        f = d / f"data_{i}.ckpt{'.gz' if compress else ''}"
        with gzip.open(f, "wb") if compress else open(f, "wb") as out:
            torch.save(rec, out)
    return str(root)


def test_speculators_layer_shift_and_labels_equal_a_capture(tmp_path, target, samples):
    """vLLM launched with --target-layer-ids 1 2 3 (launch_vllm.py appends L = 4): its id k is our layer k-1, its
    id 4 (before the final norm) our layer 3 and the labels' source."""
    path = write_speculators(tmp_path / "prep", target, samples, [1, 2, 3, 4])
    assert dump_kind(path) == "speculators" and dump_kind(os.path.join(path, "hidden_states")) == "speculators"
    dump = open_dump(path, [0, 2, 3], [1, 2, 3], CONFIG, lm_head=target.lm_head, norm=target.norm)
    assert len(dump) == 3
    m = dump.manifest
    assert (m["kind"], m["target_layer_ids"], m["dump_layer_ids"], m["available_layer_ids"]) == (
        "speculators", [0, 2, 3], [1, 2, 3, 4], [0, 1, 2, 3])
    assert (m["hidden_size"], m["dtype"], m["num_samples"], m["missing"]) == (D, "float32", 3, 0)
    for i, (ids, mask) in enumerate(samples):
        s = dump.sample(i)
        feats, labels = ours(target, ids, [0, 2, 3])
        assert torch.equal(s["input_ids"], ids) and torch.equal(s["loss_mask"], mask.bool())
        assert s["features"].shape == (len(ids), 3 * D) and torch.equal(s["features"], feats)
        assert torch.equal(s["labels"], labels) and s["labels"][0] == -1
    # read without the shift, id k as our layer k, the features would be another layer's
    shifted = torch.cat([vllm_streams(target, samples[0][0])[k][0] for k in (0, 2, 3)], dim=-1)
    assert not torch.allclose(shifted, ours(target, samples[0][0], [0, 2, 3])[0])
    # from the dataset's own directory given as data=, the hidden states elsewhere
    moved = tmp_path / "elsewhere"
    os.rename(os.path.join(path, "hidden_states"), moved)
    again = open_dump(str(moved), [1], [1, 2, 3, 4], CONFIG, labels=False, data=path)
    assert torch.equal(again.sample(1)["features"], ours(target, samples[1][0], [1])[0])
    assert again.sample(1)["labels"] is None


def test_speculators_bf16_rows_vllm_skipped_and_files_being_written(tmp_path, target, samples):
    """vLLM writes bf16; rows whose request failed have no file and one with a .lock is still being written: both
    counted as missing, the others read in row order."""
    path = write_speculators(tmp_path / "prep", target, samples, [2, 4], dtype=torch.bfloat16, rows={0, 2})
    open(os.path.join(path, "hidden_states", "hs_1.safetensors"), "wb").write(b"half")
    open(os.path.join(path, "hidden_states", "hs_1.safetensors.lock"), "wb").close()
    dump = open_dump(path, [1, 3], [2], CONFIG, lm_head=target.lm_head, norm=target.norm)
    assert (len(dump), dump.manifest["missing"], dump.manifest["dtype"]) == (2, 1, "bfloat16")
    s = dump.sample(1)
    feats, labels = ours(target, samples[2][0], [1, 3])
    assert s["features"].dtype == torch.bfloat16 and torch.equal(s["features"], feats.to(torch.bfloat16))
    assert torch.equal(s["input_ids"], samples[2][0])
    agree = (s["labels"] == labels).float().mean()  # labels from bf16 states: the same argmax almost everywhere
    assert agree >= 0.8, agree


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_dflash_records(tmp_path, target, samples, compress):
    """SpecForge's DFlash records hold the draft config's target_layer_ids, already ours, and no final state."""
    path = write_specforge(tmp_path / "hs", target, samples, [0, 2], compress=compress, group=2)
    assert dump_kind(path) == "specforge"
    dump = open_dump(path, [2, 0], [0, 2], CONFIG, labels=False)
    assert len(dump) == 3 and dump.files[2].endswith(f"rows_2-4/data_2.ckpt{'.gz' if compress else ''}")
    longest = max(len(ids) for ids, _ in samples)
    for i, (ids, mask) in enumerate(samples):
        s = dump.sample(i)
        assert s["labels"] is None
        same_as_ours(s, target, ids, [2, 0], padded=len(ids) < longest)
        assert torch.equal(s["input_ids"], ids) and torch.equal(s["loss_mask"], mask.bool())
    refused(lambda: open_dump(path, [0, 2], [0, 2], CONFIG, lm_head=target.lm_head), "no final hidden state",
            "--labels data")


@pytest.mark.parametrize("record", ["eagle3", "dspark"])
def test_specforge_final_state_gives_our_labels(tmp_path, target, samples, record):
    """EAGLE3's hidden_state and DSpark's target_last_hidden_states are after the final norm: lm_head alone."""
    path = write_specforge(tmp_path / "hs", target, samples, [1, 2], record=record)
    dump = open_dump(path, [1, 2], [2, 1], CONFIG, lm_head=target.lm_head)
    assert (dump.manifest["final"], dump.manifest["record"]) == ("after the final norm", record)
    longest = max(len(ids) for ids, _ in samples)
    for i, (ids, _) in enumerate(samples):
        same_as_ours(dump.sample(i), target, ids, [1, 2], padded=len(ids) < longest)


def test_refusals_name_what_the_dump_lacks(tmp_path, target, samples):
    spec = write_speculators(tmp_path / "prep", target, samples, [1, 3, 4])
    forge = write_specforge(tmp_path / "hs", target, samples, [0, 2])
    lm = dict(lm_head=target.lm_head, norm=target.norm)
    refused(lambda: open_dump(str(tmp_path), [0], [1], CONFIG), "holds neither our features nor a dump")
    refused(lambda: open_dump(spec, [0], None, CONFIG), "do not record which target layers",
            "speculators' files", "launch_vllm.py --target-layer-ids; its default for this 4-layer target: 2 2 1 4")
    refused(lambda: open_dump(forge, [0], [], CONFIG), "dflash_config.target_layer_ids")
    refused(lambda: open_dump(spec, [0, 1], [1, 3], CONFIG, **lm), "asks for target layer(s) [1]", "[0, 2, 3]")
    refused(lambda: open_dump(forge, [1], [0, 2], CONFIG, labels=False), "asks for target layer(s) [1]")
    refused(lambda: open_dump(spec, [0], [1, 2, 3, 4], CONFIG, **lm), "holds 3 layers, but 4 ids")
    refused(lambda: open_dump(spec, [0], [1, 3], dict(CONFIG, hidden_size=64), **lm).sample(0), "hidden size 32",
            "another target")
    refused(lambda: open_dump(spec, [0], [1, 3], dict(CONFIG, vocab_size=50), **lm).sample(0), "outside the target's "
            "vocabulary")
    nolast = write_speculators(tmp_path / "nolast", target, samples, [1, 3])  # launch_vllm.py --no-include-last-layer
    refused(lambda: open_dump(nolast, [0], [1, 3], CONFIG, **lm), "no final hidden state", "--labels data")
    assert open_dump(nolast, [0, 2], [1, 3], CONFIG, labels=False).manifest["final"] is None
    # the dataset without its loss mask, or with other tokens than the hidden states were made from
    from datasets import Dataset
    bare = tmp_path / "bare"
    Dataset.from_dict({"input_ids": [s[0].tolist() for s in samples]}).save_to_disk(str(bare))
    os.symlink(os.path.join(spec, "hidden_states"), bare / "hidden_states")
    refused(lambda: open_dump(str(bare), [0], [1, 3], CONFIG, **lm), "no loss_mask column", "prepare_data.py")
    refused(lambda: open_dump(os.path.join(spec, "hidden_states"), [0], [1, 3], CONFIG, **lm, data=str(tmp_path)),
            "cannot read speculators' dataset")
    other = tmp_path / "other"
    write_speculators(other, target, [samples[1], samples[0], samples[2]], [1, 3, 4])
    os.replace(os.path.join(spec, "hidden_states", "hs_0.safetensors"), other / "hidden_states" / "hs_0.safetensors")
    refused(lambda: open_dump(str(other), [0], [1, 3], CONFIG, **lm).sample(0), "hs_0.safetensors: its token_ids "
            "differ from row 0", "first at position 0")
    lone = tmp_path / "lone"
    os.makedirs(lone)
    os.symlink(other / "hidden_states" / "hs_1.safetensors", lone / "hs_1.safetensors")
    refused(lambda: open_dump(str(lone), [0], [1, 3], CONFIG, **lm), "without their dataset")
    # a SpecForge record without its loss mask
    f = os.path.join(forge, "rows_0-2000", "data_0.ckpt")
    rec = torch.load(f)
    del rec["loss_mask"]
    torch.save(rec, f)
    refused(lambda: open_dump(forge, [0], [0, 2], CONFIG, labels=False), "data_0.ckpt has no loss_mask")


@pytest.mark.parametrize("kind", ["speculators", "specforge", "specforge-gz"])
def test_a_truncated_file_is_named_when_read(tmp_path, target, samples, kind):
    """The dump opens reading no sample, the good samples read, and the truncated one is one line naming it;
    speculators' tokens(i), the index training builds before its first step, checks each file's header against its
    size."""
    if kind == "speculators":
        path = write_speculators(tmp_path / "prep", target, samples, [1, 4])
        bad = os.path.join(path, "hidden_states", "hs_1.safetensors")
        ids = [1]
    else:
        path = write_specforge(tmp_path / "hs", target, samples, [0, 1], compress=kind.endswith("gz"))
        bad = os.path.join(path, "rows_0-2000", f"data_1.ckpt{'.gz' if kind.endswith('gz') else ''}")
        ids = [0, 1]
    with open(bad, "r+b") as f:
        f.truncate(os.path.getsize(bad) // 2)
    dump = open_dump(path, [0], ids, CONFIG, labels=False)
    assert dump.sample(0) is not None and dump.sample(2) is not None
    refused(lambda: dump.sample(1), f"cannot read {bad}", "truncated or corrupt", "rerun the capture")
    if kind == "speculators":
        assert torch.equal(dump.tokens(0), samples[0][0])
        refused(lambda: dump.tokens(1), f"cannot read {bad}", "truncated or corrupt")


def test_nan_sample_is_skipped_and_counted(tmp_path, target, samples, capsys):
    path = write_specforge(tmp_path / "hs", target, samples, [0, 2], record="dspark")
    f = os.path.join(path, "rows_0-2000", "data_1.ckpt")
    rec = torch.load(f)
    rec["hidden_states"][0, 3, 5] = float("nan")
    torch.save(rec, f)
    g = os.path.join(path, "rows_0-2000", "data_0.ckpt")  # inf in the final state the labels come from
    rec = torch.load(g)
    rec["target_last_hidden_states"][0, 2, 7] = float("-inf")
    torch.save(rec, g)
    dump = open_dump(path, [0, 2], [0, 2], CONFIG, lm_head=target.lm_head)
    assert dump.sample(1) is None and dump.sample(1) is None and dump.sample(0) is None
    assert dump.skipped == {f: "NaN or inf in its hidden states", g: "NaN or inf in its hidden states"}
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"note: {f}: NaN or inf in its hidden states; skipped (1 so far)",
                   f"note: {g}: NaN or inf in its hidden states; skipped (2 so far)"], err
    assert open_dump(path, [0, 2], [0, 2], CONFIG, labels=False).sample(0) is not None  # no labels: its final unread
    same_as_ours(dump.sample(2), target, samples[2][0], [0, 2], padded=True)  # its batch was 14 tokens long


def test_dflash_trains_from_a_speculators_dump_as_online(tmp_path, capsys):
    """dflash.py --data PREP --features PREP on a speculators dump (prepare_data.py's torch-format dataset read as
    written; vLLM ids 2, 3 = our layers 1, 2; id 4 = L, the labels through the target's own final norm, read alone):
    the same losses as online training over the same data, to fp32 rounding (the dump's states come from unpadded
    passes); the dataset's digest leaves out the hidden states; a row past --max_len is refused naming the --max_len
    that trains; the dump's flags only beside --features."""
    import json
    from conftest import SMALL, tiny_qwen3, torch_threads, write_data
    q3, data = tiny_qwen3(tmp_path / "q3"), write_data(tmp_path / "data.jsonl", 16)
    rows = [(torch.tensor(ids), torch.tensor(mask)) for ids, mask in dflash.load_samples(data, None, 3072,
                                                                                         say=lambda *a: None)]
    dump = write_speculators(tmp_path / "dump", dflash.load_target(q3), rows, [2, 3, 4])
    run = ["--target", q3, "--data", data, *SMALL, "--max_steps", "3", "--batch_size", "2", "--no_progress",
           "--eval_walk_prompts", "0"]

    def losses(out, *extra):
        with torch_threads(1):
            dflash.main([*run, *extra, "--out", str(out)])
        return [json.loads(line)["loss"] for line in open(out / "metrics.jsonl") if '"loss"' in line]
    online = losses(tmp_path / "online")
    assert dflash.load_samples(dump, None, 3072, say=lambda *a: None) == rows_as_lists(rows)
    digest = dflash.path_digest(dump)
    open(os.path.join(dump, "hidden_states", "hs_99.safetensors.lock"), "w").close()
    assert dflash.path_digest(dump) == digest
    readme = ["--data", dump, "--features", dump, "--dump_layer_ids", "2,3,4"]  # the README's command
    dumped = losses(tmp_path / "dumped", *readme)
    assert len(online) == len(dumped) == 3 and dumped == pytest.approx(online, rel=1e-4)
    from conftest import fails_with
    err = fails_with(capsys, [*run, *readme, "--max_len", "20", "--out", str(tmp_path / "short")], "longest row has "
                     "24 tokens, past --max_len 20", "pass --max_len 24")
    fix = err.split("pass ")[-1].split(" or more")[0].split()
    assert losses(tmp_path / "fixed", *readme, *fix) == pytest.approx(online, rel=1e-4)
    with pytest.raises(SystemExit):  # a dump's flag without --features: unknown here
        dflash.main([*run, "--dump_layer_ids", "2,3,4", "--out", str(tmp_path / "x")])


def rows_as_lists(rows):
    return [(ids.tolist(), mask.tolist()) for ids, mask in rows]


def test_a_dump_is_indexed_by_its_tokens_alone(tmp_path, target, samples, monkeypatch):
    """Opening a dump for training reads each sample's tokens, never its hidden states (those are read when a batch
    needs them): speculators' from its dataset, SpecForge's from the record, equal to sample()'s input_ids."""
    dump = open_dump(write_speculators(tmp_path / "s", target, samples, [2, 3, L]), [1, 2], [2, 3, L], CONFIG,
                     target.lm_head, target.norm)
    monkeypatch.setattr(type(dump), "read", lambda self, i: pytest.fail("hidden states read for an index"))
    assert [dump.tokens(i).tolist() for i in range(len(dump))] == [s[0].tolist() for s in samples]
    monkeypatch.undo()
    assert all(torch.equal(dump.tokens(i), dump.sample(i)["input_ids"]) for i in range(len(dump)))
