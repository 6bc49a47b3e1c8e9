"""Hub ids where a drafter directory goes (eval.py --drafter, dflash.py --init_from): snapshot_download is
monkeypatched, nothing touches the network."""

import sys
import types

import pytest

import dflash
import eval as ev
from dflash import DFlashError
from dflash import resolve_drafter


def fake_hub(monkeypatch, result):
    """huggingface_hub whose snapshot_download returns `result` (a directory) or raises it (an exception)."""
    calls = []

    def snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    return calls


def test_local_paths_win_and_hub_ids_download(tmp_path, monkeypatch):
    calls = fake_hub(monkeypatch, str(tmp_path))
    assert resolve_drafter(str(tmp_path)) == str(tmp_path) and not calls      # an existing path: used as is
    assert resolve_drafter("z-lab/Qwen3.6-27B-DFlash") == str(tmp_path)       # owner/name: downloaded
    assert calls[0][0] == "z-lab/Qwen3.6-27B-DFlash" and "*.safetensors" in calls[0][1]["allow_patterns"]
    with pytest.raises(DFlashError, match="does not exist; give a drafter directory or a hub id"):
        resolve_drafter(str(tmp_path / "missing" / "dir"))                     # neither: one clear line
    assert len(calls) == 1


def test_offline_or_missing_is_one_line(monkeypatch):
    fake_hub(monkeypatch, OSError("We couldn't connect to 'https://huggingface.co'\nmore detail"))
    with pytest.raises(DFlashError, match=r"--drafter 'z-lab/x' is not a local directory.*couldn't connect.*"
                                          r"huggingface-cli download z-lab/x --local-dir DIR") as e:
        resolve_drafter("z-lab/x")
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(DFlashError, match="needs huggingface_hub"):
        resolve_drafter("z-lab/x")


def test_eval_and_train_resolve_hub_ids(tmp_path, monkeypatch):
    calls = fake_hub(monkeypatch, str(tmp_path / "snapshot"))
    with pytest.raises(DFlashError, match="snapshot"):  # eval.py reads the downloaded directory
        ev.load_drafters(["z-lab/Qwen3-8B-DFlash-b16"], target=None, dtype=None)
    assert calls[-1][0] == "z-lab/Qwen3-8B-DFlash-b16"
    fake_hub(monkeypatch, ConnectionError("offline"))
    args = dflash.get_parser().parse_args(["--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.jsonl"),
                                           "--init_from", "z-lab/Qwen3.6-27B-DFlash", "--out", str(tmp_path / "o")])
    with pytest.raises(DFlashError, match="--init_from 'z-lab/Qwen3.6-27B-DFlash' is not a local directory"):
        dflash.train(args)


def test_offline_hub_is_one_line(monkeypatch):
    """HF_HUB_OFFLINE and a hub id that is not in the cache: one line with the fix, no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DFlashError, match="HF_HUB_OFFLINE is set.*huggingface-cli download"):
        resolve_drafter("nobody/no-such-drafter")
