"""Looking at results: the measurement settings every tau carries (eval.py's report and table), --compare refusing
tau measured differently, eval.py --plot's histograms and dflash_tools/plot.py's picture of a run."""

import json
import sys

import pytest

import dflash
import eval as ev
from conftest import tiny_qwen3, tiny_tokenizer
from dflash import DFlashError

pytestmark = pytest.mark.usefixtures("one_thread_module")

# a template that reads enable_thinking as Qwen3's does: thinking unless enable_thinking is false (then an empty
# think block opens the answer)
THINKING = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> "
            "{% if enable_thinking is defined and enable_thinking is false %}a b {% endif %}{% endif %}")


def plt_or_skip():
    pytest.importorskip("matplotlib")  # in requirements.txt's optional extras: CI has it


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny Qwen3 target directory with a word-level tokenizer whose chat template reads enable_thinking."""
    path = tmp_path_factory.mktemp("t") / "target"
    tiny_qwen3(path)
    tiny_tokenizer(THINKING).save_pretrained(path)
    return str(path)


def test_measurement_settings():
    tok, plain, none = tiny_tokenizer(THINKING), tiny_tokenizer(), tiny_tokenizer(False)
    m = dflash.measurement(tok, None, 64)
    assert m["thinking"] == "on"  # the template's default, resolved: it renders as enable_thinking=True
    assert m == dflash.measurement(tok, True, 64) != dflash.measurement(tok, False, 64)
    off = dflash.measurement(tok, False, 64)
    assert off["thinking"] == "off" and off["template"] != m["template"]  # the generation prompt differs
    assert dflash.generation_prompt(tok, {"enable_thinking": False}) == "<|assistant|> a b "
    assert dflash.measurement(plain, None, 64)["thinking"] == "n/a" and dflash.measurement(none, None, 64)["template"] == "none"
    assert dflash.measurement(plain, None, 64)["template"] not in (m["template"], "none")  # another template
    assert dflash.measurement(tok, None, 64)["max_new_tokens"] == 64 and m["serving"] == "greedy"
    s = ev.Sampling(0.7, top_p=0.9, top_k=20, samples=3)
    assert ev.measured(tok, None, 64, s) == {**m, "serving": "sampled T=0.7 top_p=0.9 top_k=20"}
    a, b = (dflash.measurement(tok, None, 64, prompts=p)["prompts"] for p in ([[1, 2], [3]], [[1, 2], [4]]))
    assert a != b and a == dflash.measurement(tok, None, 64, prompts=[[1, 2], [3]])["prompts"]
    with pytest.raises(DFlashError, match="measured with max_new_tokens 32, a with 64"):
        ev.check_same_measurement({"a": {"measured": m}, "b": {"measured": dflash.measurement(tok, None, 32)}})
    with pytest.raises(DFlashError, match="thinking off, a with on"):
        ev.check_same_measurement({"a": {"measured": m}, "b": {"measured": off}})


def run_eval(target, tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    ev.main(["--target", target, "--drafter", "prompt-lookup", "--prompts", str(tmp_path / "prompts.jsonl"),
             "--no_progress", "--json", str(out), *flags])
    return out


def test_eval_reports_settings_compare_and_plot(target, tmp_path, capsys):
    plt_or_skip()
    from PIL import Image
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                    for p in ("hi there", "good day", "hello world a b c")))
    a = run_eval(target, tmp_path, "a", "--max_new_tokens", "12", "--no-enable_thinking", "--plot",
                 str(tmp_path / "a.png"))
    printed = capsys.readouterr().out
    report = json.loads(a.read_text())
    m = report["measured"]
    assert m == dflash.measurement(tiny_tokenizer(THINKING), False, 12, prompts=ev.load_prompts(
        str(tmp_path / "prompts.jsonl"), tiny_tokenizer(THINKING), False))
    assert m["thinking"] == "off" and m["max_new_tokens"] == 12 and m["serving"] == "greedy"
    assert ev.measured_line(m) in printed  # the table says it too
    with Image.open(tmp_path / "a.png") as im:
        assert im.format == "PNG" and im.size[0] > 200
    r = report["results"][0]
    from dflash_tools.plot import histogram_shares
    shares = histogram_shares(r)
    lengths = [n for e in r["prompts"] for n in e["acceptance_lengths"]]
    assert len(shares) == r["block_size"] + 1 and shares[0] == 0
    assert shares == [lengths.count(b) / len(lengths) for b in range(r["block_size"] + 1)]  # z-lab's histogram

    b = run_eval(target, tmp_path, "b", "--max_new_tokens", "12", "--no-enable_thinking", "--block_size", "4")
    c = run_eval(target, tmp_path, "c", "--max_new_tokens", "12")  # thinking: the template's default (on)
    d = run_eval(target, tmp_path, "d", "--max_new_tokens", "16", "--no-enable_thinking")
    capsys.readouterr()
    both = ev.main(["--compare", str(a), "--compare", str(b), "--json", str(tmp_path / "ab.json")])
    printed = capsys.readouterr().out
    assert [x["drafter"] for x in both["results"]] == [f"{a}:prompt-lookup", f"{b}:prompt-lookup"]
    assert [x["block_size"] for x in both["results"]] == [16, 4] and ev.measured_line(m) in printed
    for other, why in ((c, "thinking on"), (d, "max_new_tokens 16")):
        with pytest.raises(SystemExit):
            ev.main(["--compare", str(a), "--compare", str(other)])
        err = capsys.readouterr().err
        assert f"error: {other} was measured with {why}" in err and "not comparable" in err
    with pytest.raises(SystemExit):
        ev.main(["--compare", str(a), "--drafter", "prompt-lookup"])
    assert "drop --drafter" in capsys.readouterr().err


def test_plot_needs_matplotlib_before_the_target_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    with pytest.raises(SystemExit):
        ev.main(["--target", str(tmp_path / "no-such-target"), "--plot", str(tmp_path / "h.png")])
    assert capsys.readouterr().err.strip() == "error: plots need matplotlib: pip install matplotlib"


RECORDS = [  # the keys dflash.py logs: training steps, then held-out evaluations
    {"step": 0, "eval_loss": 3.0, "eval_tau": 1.1, "eval_acc": [0.1, 0.0, 0.0], "eval_walk_tau": 1.0},
    {"step": 1, "loss": 3.2, "tau": 1.05, "acc": [0.05, 0.0, 0.0], "lr": 1e-3, "tokens_per_s": 10.0, "peak_mb": 1.0},
    {"step": 2, "loss": 2.5, "tau": 1.4, "acc": [0.3, 0.1, 0.0], "lr": 2e-3, "tokens_per_s": 10.0, "peak_mb": 1.0},
    {"step": 2, "eval_loss": 2.4, "eval_tau": 1.5, "eval_acc": [0.4, 0.2, 0.1], "eval_walk_tau": 1.3,
     "eval_walk_tree_tau": 1.6, "eval_walk_acceptance": [0.3, 0.05, 0.0], "measured": {"thinking": "n/a"}},
    {"step": 3, "loss": 2.0, "tau": 1.7, "acc": [0.5, 0.3, 0.1], "lr": 1.5e-3, "tokens_per_s": 10.0, "peak_mb": 1.0},
    {"step": 3, "loss": 1.9, "tau": 1.8, "acc": [0.6, 0.3, 0.1], "lr": 1.5e-3, "tokens_per_s": 9.0, "peak_mb": 1.0},
]


def test_run_picture(tmp_path, capsys):
    plt_or_skip()
    from dflash_tools import plot
    assert plot.curve(RECORDS, "loss") == ([1, 2, 3], [3.2, 2.5, 1.9])  # a step logged twice keeps the last value
    assert plot.curve(RECORDS, "eval_walk_tau") == ([0, 2], [1.0, 1.3])
    fig = plot.draw_run(RECORDS)
    ax_loss, ax_tau, ax_acc, ax_lr = fig.axes
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax_loss.lines + ax_tau.lines}
    assert lines["training loss"] == ([1, 2, 3], [3.2, 2.5, 1.9]) and lines["held-out loss"] == ([0, 2], [3.0, 2.4])
    assert lines["walked tau (held out, exact)"] == ([0, 2], [1.0, 1.3]) and lines["tree tau (held out)"] == ([2], [1.6])
    assert lines["training tau estimate"][1] == [1.05, 1.4, 1.8]
    assert [p.get_height() for p in ax_acc.patches] == [0.3, 0.05, 0.0] and "step 2" in ax_acc.get_title()
    assert list(ax_acc.lines[0].get_ydata()) == [0.4, 0.2, 0.1]  # the estimate's accuracy beside the walk's
    assert list(ax_lr.lines[0].get_ydata()) == [1e-3, 2e-3, 1.5e-3]
    plot.pyplot().close(fig)
    assert plot.last_offsets(RECORDS[1:3]) == (2, {"accuracy at offset k (training)": [0.3, 0.1, 0.0]})

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    plot.main([str(out)])
    assert capsys.readouterr().out.strip() == f"wrote {out / 'metrics.png'}"
    from PIL import Image
    with Image.open(out / "metrics.png") as im:
        assert im.format == "PNG"
    for argv, msg in (([str(tmp_path / "none")], "does not exist"), ([str(out), "--out", str(out)], "cannot write")):
        with pytest.raises(SystemExit):
            plot.main(argv)
        assert msg in capsys.readouterr().err
