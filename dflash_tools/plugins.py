"""Plug-ins: those of dflash_tools/, found from their files without importing them (dflash.py lists them for --help
and an unknown flag's owner, and finds the module of a variant checkpoint's architecture here); and those outside it,
a module or a .py path, imported when trusted. A checkpoint of a variant outside dflash_tools/ names its module in
config.json (dflash_module: a module by its name, a .py file by its real path): loading it takes --trust_variant_code
unless --variant names it; where the module moved, --variant NEWPATH (dflash.py, eval.py, --init_from) reads its
architecture's checkpoints."""
import hashlib
import importlib.util
import os
import pathlib
import re
import sys

from dflash import TOOLS, TRUSTED, Unreadable, first_line, need


def outside(spec, why):
    """The trusted plug-in spec, a module or a .py path (DFLASH_MODULE: its key, as a checkpoint saves it)."""
    key = os.path.realpath(spec) if spec.endswith(".py") else spec  # as a checkpoint names it: from any dir or link
    need(TRUSTED & {key, "*"}, f"{why} is code from {spec!r}; pass --variant or --trust_variant_code", Unreadable)
    need(os.path.isfile(key) or not key.endswith(".py"), f"{why}: no file {spec}; give --variant its path", Unreadable)
    name = "dflash_plugin_" + hashlib.sha256(key.encode()).hexdigest()[:12]  # one module a file
    try:
        module = importlib.import_module(key) if not key.endswith(".py") else sys.modules.get(name)
    except ModuleNotFoundError as e:
        raise Unreadable(f"{why}: no module {spec!r} ({first_line(e)}); copy dflash_tools/ beside {sys.argv[0]}, or "
                         f"give a module or a .py path") from None
    if module is None:  # a .py path, imported once
        loader = importlib.util.spec_from_file_location(name, key)
        module = sys.modules[name] = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    module.DFLASH_MODULE = key
    return module


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
