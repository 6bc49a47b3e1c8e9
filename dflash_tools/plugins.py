"""The plug-ins of dflash_tools/, found from their files without importing them: dflash.py lists them for --help
and an unknown flag's owner, and finds the module of a variant checkpoint's architecture here."""
import os
import pathlib
import re

from dflash import TOOLS


def tool_plugins():
    """dflash_tools/' (flag, module, architecture): a Config names an architecture, a loss LOSSES, a stage Stage"""
    found = []
    for f in sorted(os.listdir(TOOLS)):
        text = pathlib.Path(TOOLS, f).read_text(errors="replace") if f.endswith(".py") else ""
        arch = re.search(r'^ +architecture: ClassVar\[str\] = "(\w+)"', text, re.M)
        kind = "--variant" if arch else "--loss" if re.search(r"^LOSSES = ", text, re.M) else "--stage" if re.search(
            r"^class Stage\(", text, re.M) else None
        found += [(kind, f[:-3], arch and arch[1])] if kind else []
    return found
