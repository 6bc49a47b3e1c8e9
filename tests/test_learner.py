"""What a learner sees of the visibility rule: the text picture above make_mask_mod and the README's figure
(dflash_tools/plot.py --mask) are both drawn from dflash.make_mask_mod itself, and say what dense_masks computes. And
the worked verification step at the walk is what tau_walk computes."""
import os

import pytest
import torch

import dflash
from dflash_tools import plot

# the pictured layers, and the two other kinds a config can give (causal full, bidirectional sliding)
KINDS = [(c, w) for _, c, w in plot.MASK_LAYERS] + [(True, None), (False, 2)]


@pytest.mark.parametrize("causal,window", KINDS)
@pytest.mark.parametrize("S,B,anchors", [(plot.MASK_S, plot.MASK_B, plot.MASK_ANCHORS), (11, 3, (0, 4, 9))])
def test_the_drawn_matrix_is_what_dense_masks_computes(S, B, anchors, causal, window):
    """The tool's (N*B, S + N*B) matrix: its context columns are dense_masks' context mask, each block's own columns
    its own-block mask, every other block's columns hidden, for the pictured example and another."""
    got = plot.mask_matrix(causal, window, S, B, anchors)
    N = len(anchors)
    a = torch.tensor([anchors])
    mod = dflash.make_mask_mod(a, torch.ones_like(a, dtype=torch.bool), S, B, causal, window)
    ctx, own = (m[0] for m in dflash.dense_masks(mod, 1, N, S, B, torch.device("cpu")))  # (N, B, S), (N, B, B)
    assert got.shape == (N * B, S + N * B)
    assert torch.equal(got[:, :S], ctx.reshape(N * B, S))
    for n in range(N):
        rows, cols = slice(n * B, (n + 1) * B), slice(S + n * B, S + (n + 1) * B)
        assert torch.equal(got[rows, cols], own[n])
        others = torch.ones(S + N * B, dtype=torch.bool)
        others[:S], others[cols] = False, False
        assert not got[rows][:, others].any(), f"block {n} sees another block's keys"
    assert got.any() and not got.all()


def test_pictured_example_by_hand():
    """A few cells of the pictured example spelled out (S=8, B=4, anchors 2 and 5, W=3)."""
    assert (plot.MASK_S, plot.MASK_B, plot.MASK_ANCHORS, plot.MASK_W) == (8, 4, (2, 5), 3)
    full, sliding = (plot.mask_matrix(c, w) for _, c, w in plot.MASK_LAYERS)
    assert full[4, :8].tolist() == [1, 1, 1, 1, 1, 0, 0, 0]          # block 1 (a=5) sees context 0..4, not 5
    assert full[0, 8:12].all() and not full[0, 12:].any()           # block 0, offset 0: its whole block, not block 1
    assert sliding[0, 8:12].tolist() == [1, 0, 0, 0]                 # causal: offset 0 sees only itself
    assert sliding[4, :8].tolist() == [0, 0, 0, 1, 1, 0, 0, 0]       # position 5 sees 3, 4: 5 - j < W
    assert sliding[3, 8:12].tolist() == [0, 1, 1, 1]                 # offset 3 at 5: block key at 2 is W back
    assert not sliding[3, :8].any()                                  # position 5: context 0, 1 are >= W back


def test_the_picture_in_dflash_py_is_the_rule():
    """The text picture above make_mask_mod is mask_picture's output, line for line: the comment cannot drift from
    the mask."""
    src = open(dflash.__file__).read()
    picture = "".join(f"#   {line}".rstrip() + "\n" for line in plot.mask_picture())
    assert picture in src, "the picture above make_mask_mod is stale: paste python -m dflash_tools.plot --mask's output"
    assert src.index(picture) < src.index("def make_mask_mod(")


def test_mask_figure_and_command(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "mask.png")
    plot.main(["--mask", path])
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == plot.mask_picture() and out[-1] == f"wrote {path}"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n" and os.path.getsize(path) > 5000
    with pytest.raises(SystemExit):
        plot.main([])
    assert capsys.readouterr().err.strip() == "error: give a run's OUT directory, or --mask PNG (one of the two)"


def test_the_worked_verification_step_is_what_tau_walk_computes():
    """The example above tau_walk: along s = [the, cat, sat, on, the, mat] the block anchored at s[0] drafts [cat,
    sat, in]: 2 accepted plus the target's "on", 3 tokens; the next block is anchored at s[3] (the walk reads no
    other block: the drafts are a dict holding only blocks 0 and 3)."""
    src = open(dflash.__file__).read()
    assert "One step, B = 4, s = [the, cat, sat, on, ...]:" in src
    s = ["the", "cat", "sat", "on", "the", "mat"]
    assert dflash.accepted_prefix(["cat", "sat", "in"], s[1:]) == 2
    lengths = dflash.tau_walk(s, {0: ["cat", "sat", "in"], 3: ["the", "mat", "."]})
    assert lengths == [3, 3]  # block 3: the rest of s, 2 drafts, accepted, plus the target's own next token
