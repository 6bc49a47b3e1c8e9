"""The README's commands, as a user copies them from its ```bash blocks: every flag a command gives one of this
project's scripts is a flag that script's --help lists (flag drift is how a README rots), and the commands on the tiny
target (.cache/tiny_qwen35, which dflash_tools/tiny_target.py builds in minutes) run as written, with a tiny target
and its data at those paths and only flags appended that make them small (argparse: the last value wins).

Checked by their flags alone: commands that need a GPU, the network or many minutes (the demo, the real targets,
regeneration, serving, tiny_target.py itself, the recipe) and the other tools' commands (pip, vllm, SGLang,
speculators' scripts, pytest), whose flags are theirs."""
import os
import re
import runpy
import shlex
import sys

import pytest

import dflash
import eval as ev
from conftest import ROOT, VOCAB, tiny_qwen3, tiny_tokenizer, write_data

README = os.path.join(ROOT, "README.md")
TINY = ".cache/tiny_qwen35"  # the README's tiny target; its data beside it
# programs the README runs that are not this project's: their flags are not checked here
EXTERNAL = {"pip", "vllm", "torchrun", "pytest", "sglang.launch_server", "scripts/launch_vllm.py",
            "scripts/data_generation_offline.py"}
PENDING = {"dflash_tools/recipe.py"}  # the SmolLM2 recipe, being written beside this README: checked once it exists
# flags appended to the commands run on the tiny target, by script: small shapes, few steps, no held-out walk
SMALL = {"dflash.py": ["--mask_token_id", str(VOCAB - 1), "--block_size", "4", "--num_anchors", "4", "--max_len", "32",
                       "--batch_size", "2", "--eval_every", "0", "--save_every", "0", "--eval_walk_prompts", "0",
                       "--eval_fraction", "0", "--log_every", "50", "--no_progress"],
         "eval.py": ["--max_new_tokens", "8", "--limit", "2", "--no_progress"],
         "dflash_tools/features.py": ["--max_len", "32", "--batch_size", "4", "--eval_walk_prompts", "0",
                                      "--eval_fraction", "0"]}
FEW_STEPS = ["--max_steps", "2"]  # for the runs no later command reads (eval.py and --init_from read runs/small's)


def readme_commands():
    """Each command of the README's ```bash blocks as argv: lines joined at a trailing backslash, comments and
    leading VAR=value assignments dropped."""
    text = open(README).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            while argv and re.fullmatch(r"\w+=\S*", argv[0]):
                argv = argv[1:]
            if argv:
                out.append(argv)
    return out


def program(argv):
    """(the program, its arguments): our scripts by their path in the repository (python -m dflash_tools.x is
    dflash_tools/x.py); torchrun's by the script it starts; another program by its name."""
    if argv[0] == "torchrun" and any(a.endswith(".py") for a in argv):
        i = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return argv[i], argv[i + 1:]
    if argv[0] == "python" and argv[1] == "-m":
        mod = argv[2]
        return (mod.replace(".", "/") + ".py" if mod.startswith("dflash_tools.") else mod), argv[3:]
    if argv[0] in ("python", "bash"):
        return argv[1], argv[2:]
    return argv[0], argv[1:]


def script_help(script, args, monkeypatch, capsys):
    """script's --help, as `python script ... --help` prints it (run here, in this process): features.py's of the
    command's subcommand; dflash.py's with every plug-in's flags (--features adds its own to those of dflash_tools/'
    variants, losses and stages, which --help lists)."""
    sub = [args[0]] if script == "dflash_tools/features.py" and args and not args[0].startswith("-") else []
    extra = ["--features", "x"] if script == "dflash.py" else []
    monkeypatch.setattr(sys, "argv", [script, *sub, *extra, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    assert e.value.code == 0, (script, capsys.readouterr())
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def commands():
    found = readme_commands()
    assert len(found) >= 20, found
    return found


def test_every_readme_flag_is_in_its_scripts_help(commands, monkeypatch, capsys):
    """Every --flag of every README command of ours is one its script's --help lists."""
    ours = [(program(c), c) for c in commands if program(c)[0] not in EXTERNAL]
    for (script, _), c in ours:
        assert script.endswith((".py", ".sh")), f"not a command of this project, nor a known tool: {shlex.join(c)}"
        assert os.path.isfile(os.path.join(ROOT, script)) or script in PENDING, f"the README runs {script}, which " \
            f"does not exist"
    helps = {}
    for (script, args), c in ours:
        if script in PENDING and not os.path.isfile(os.path.join(ROOT, script)):
            continue
        key = (script, args[0] if script == "dflash_tools/features.py" else None)
        if key not in helps and script.endswith(".sh"):  # a shell script's: the literals it compares arguments with
            helps[key] = open(os.path.join(ROOT, script)).read()
        elif key not in helps:
            helps[key] = script_help(script, args, monkeypatch, capsys)
        listed = set(re.findall(r"--[\w-]+", helps[key]))
        given = {a.split("=")[0] for a in args if a.startswith("--")}
        assert given <= listed, f"{shlex.join(c)}: {sorted(given - listed)} not in {script} --help"


def test_readme_commands_on_the_tiny_target_run_as_written(commands, tmp_path, monkeypatch, capsys, one_thread):
    """The tiny target's commands in README order, from a fresh directory holding a tiny target and its data at the
    README's paths: they train (then from features captured once, then on-policy from the first drafter), and
    eval.py measures the first drafter. One that names the tiny target and is not run here fails the test."""
    from dflash_tools import features
    tiny = [c for c in commands if TINY in c or f"{TINY}_regen.jsonl" in c]
    assert tiny, "the README's tiny-target commands are gone"
    monkeypatch.chdir(tmp_path)
    target = tiny_qwen3(tmp_path / TINY)
    tiny_tokenizer().save_pretrained(target)
    write_data(tmp_path / f"{TINY}_regen.jsonl", 16)
    mains = {"dflash.py": dflash.main, "eval.py": ev.main, "dflash_tools/features.py": features.main}
    ran = []
    for c in tiny:
        script, args = program(c)
        if script == "dflash_tools/tiny_target.py":
            continue  # builds the real tiny target: minutes (its flags are checked above)
        assert script in mains, f"a tiny-target command this test does not run: {shlex.join(c)}"
        few = FEW_STEPS if script == "dflash.py" and "runs/small" not in args else []
        few += ["--onpolicy_tokens", "8"] if "onpolicy" in args else []
        mains[script](args + SMALL[script] + few)
        ran.append(script)
        for a in args:  # what a command writes, the next one reads
            if a.startswith("runs/"):
                assert os.path.isdir(tmp_path / a) or script == "eval.py", (a, shlex.join(c))
    assert ran.count("dflash.py") >= 4 and {"eval.py", "dflash_tools/features.py"} <= set(ran), ran
    assert "tau" in capsys.readouterr().out
