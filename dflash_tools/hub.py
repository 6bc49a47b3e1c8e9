"""
Hub ids where a drafter directory goes: `eval.py --drafter z-lab/Qwen3.6-27B-DFlash`, `dflash.py --init_from ...`.
A path that exists is used as it is; otherwise a name shaped like owner/name is downloaded once through
huggingface_hub.snapshot_download (config.json and the safetensors files) into the Hugging Face cache, whose
directory is then used. Offline or missing: one error line that says what to do instead.
"""

import os
import re

from dflash_tools.plumbing import DFlashError

HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def resolve_drafter(path, flag="--drafter"):
    """The local drafter directory for `path`: itself if it exists, else the downloaded snapshot of hub id `path`."""
    if os.path.exists(path):
        return path
    if not HUB_ID.fullmatch(path) or path.endswith(".") or ".." in path:
        raise DFlashError(f"{flag} {path!r} does not exist; give a drafter directory or a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DFlashError(f"{flag} {path!r} is not a local directory; downloading it as a hub id needs "
                          f"huggingface_hub (pip install huggingface_hub)") from None
    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors"])
    except Exception as e:  # offline, no such repository, gated, ...
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise DFlashError(f"{flag} {path!r} is not a local directory, and downloading it from the hub failed "
                          f"({why}); when offline, download it elsewhere (huggingface-cli download {path} "
                          f"--local-dir DIR) and pass DIR") from None
