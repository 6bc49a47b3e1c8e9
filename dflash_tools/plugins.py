"""Plug-ins: the contract (how one is named, declares its flags and refuses input: dflash.py's "Plug-ins: the
contract"), then what each kind supplies, hook by hook:
- A variant (--variant NAME). `class Config(DFlashConfig)`: its fields; problems() (super()'s, plus a line per
  problem); dflash_config_keys() -> {field: value} of each field it adds, under its own name (config.json's
  dflash_config; one left out loads back at its default); `architecture: ClassVar[str] = "XDraftModel"` on one line
  (how a checkpoint finds its module); `Config.Drafter = Drafter`. `class Drafter(DFlashDrafter)` overrides the hooks
  it changes; training, the walk and eval.py call them alike (forward is not one, refused):
    Layer(cfg, index) -> layer index's module: (x (b, N, B, D), cos, sin, k_ctx, v_ctx, mask) -> x
    context_kv(features (b, S, m*D), start=0) -> kv: per layer (k, v), each (b, S, hk, hd), at positions start..
    blocks(x (b, N, B, D), anchors (b, N), anchor_valid (b, N), kv, S) -> the final hidden state (b, N, B, D)
    draft(logits (n, B-1, V), h (n, B-1, D), anchor_ids (n,), truth=None (n, B), temperature=0.0) -> drafts (n, B-1),
      {name: (n, B-1, ...)}, diagnostics given truth; "q": its chance of drafting each true token (the truth before
      given) makes eval.py --temperature verify by rejection sampling; a name in the class's WALKS is walked too
    block_loss(hidden (b, N, B, D), lm_head, labels, weights, block_ids (b, N, B), loss=None, progress=None or (step,
      total), final=None or (b, N, B, D) when the loss asks) -> sum(w * loss), a stage's stats (below)
    summary(summed stats) -> {name: number or list}, logged beside loss, tau and acc
    logprobs(logits (T, V) fp32, h (T, D) final-normed, prev (T,) the token before each, progress=None) -> [(weight,
      log q (T, K), ids (T, K) or None: all V)], what it drafts from (a stage compares each with p over its ids)
  An nn.Linear with identity_init = True keeps the weights its module gave it. Optional: configure(cfg, args) -> its
  Config (args holds its flags, at their defaults when absent, as under --init_from without --variant);
  prepare(drafter, cfg, args) -> drafter (default: DFlash's fields and weights carried over).
- A loss (--loss NAME: a name in dflash_tools/losses.py's LOSSES, or MODULE_OR_PATH.py:NAME): LOSSES maps NAME to
  f(args) -> a CE subclass. weighted_ce is sum(weights * token_loss), over the global sum of normalisers:
    token_loss(logits (T, V) fp32, labels (T,)[, target_logits (T, V)]) -> (T,), its gradient by autograd, T a chunk
      of rows; target_logits = True (on the class): the target's logits too (p at a+i; --features: --store_final's)
    weights(w (b, N, B), logq (b, N, B) log q(label) detached, valid: w > 0) -> the weights (b, N, B)
    normaliser(w (b, N, B)) -> a scalar tensor, this micro-batch's part; reweigh(w, logq (T,), sel (T,) the flat
      indices of w > 0) -> (weights, normaliser), how weighted_ce calls both. Engines serve what it trains.
- A training stage (--stage NAME): `class Stage(SFT)`, Stage(args, state) once a run; state: a dict (None, bool, int,
  float, str, tensors, lists, tuples, dicts) saved, checked, in each checkpoint; optional check(args) first. A step:
    plan(inp, micro_batches) -> per micro-batch (shares {name: scalar tensor, a part of a normaliser}, work)
    loss(inp, mb, work, totals: each share summed over micro-batches and ranks) -> (the scalar to backward, over
      totals; stats {name: tensor}, summed over micro-batches and ranks, the same on every rank): block_loss's w and
      ce_w (loss = ce_w / w; a non-finite ce_w skips the step), correct and count (B,), accepted, blocks at least;
      after(summed stats), optional, follows the optimizer step
  inp: a StepInputs namedtuple (SFT at another gamma: inp._replace(gamma=g)): model (the drafter, maybe compiled or
  DDP-wrapped: call it), target (Target, or a capture with its embed, lm_head, target_features), cfg, num_anchors (a
  row), gamma, loss_kw: dflash_loss's keywords {raw_model: the drafter itself (call its hooks), loss: --loss's object,
  progress: (step, total_steps), noise_std, labels, pad_to}; mb: collate's {input_ids, loss_mask (b, S), tokens,
  keys}. Stage.runs_target = False: it reads only what a capture holds (features, labels, f), so it trains from
  --features; unset, it runs the target, and --features is refused.
- An on-policy divergence (--onpolicy_accepted/_rejected M:NAME): M's DIVERGENCES[NAME], as onpolicy.py's registry.

Those of dflash_tools/ are found from their files without importing them (dflash.py lists them for --help
and an unknown flag's owner, and finds the module of a variant checkpoint's architecture here); and those outside it,
a module or a .py path, imported when trusted. A checkpoint of a variant outside dflash_tools/ names its module in
config.json (dflash_module: a module by its name, a .py file by its real path): loading it takes --trust_variant_code
unless --variant names it; where the module moved, --variant NEWPATH (dflash.py, eval.py, --init_from) reads its
architecture's checkpoints.

It also holds what dflash.py does only for a plug-in: the plug-ins a command line names, a variant's default set-up,
a plug-in's exception named in one line, and the check that a plug-in saves nothing a checkpoint cannot hold."""
import hashlib
import importlib.util
import os
import pathlib
import re
import sys
import traceback
from dataclasses import fields

import torch

import dflash
from dflash import NAMED, TOOLS, TRUSTED, DFlashConfig, DFlashError, Unreadable, first_line, need


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


def chosen(given, loss, every):
    """dflash.chosen_plugins' [(title, module)]: given {flag: name} (every: all dflash_tools/' too), NAMED set."""
    if loss:
        module, name = dflash.loss_plugin(loss)
        known = getattr(module, "LOSSES", {})
        need(name in known, f"--loss {loss}: no such loss; give ce or one of {', '.join(known) or 'none'}")
    picked = {(f, m) for f, m, _ in (tool_plugins() if every else [])} | {(f, m) for f, m in given.items() if m}
    modules = [(f, m, dflash.plugin(m, f"{f} {m}")) for f, m in sorted(picked)]
    NAMED.update({mod.Config.architecture: mod for f, _, mod in modules if f == "--variant" and hasattr(mod, "Config")})
    return [(f"{f} {'|'.join(mod.LOSSES) if f == '--loss' else m} ({mod.__name__})", mod) for f, m, mod in modules
            if hasattr(mod, "add_flags")]


def config_class(d, where):
    """dflash.config_class's: the variant's Config config.json names (--variant's of its architecture, its
    dflash_module, else the dflash_tools/ module declaring its architecture), or DFlashConfig."""
    known = {arch: m for _, m, arch in tool_plugins() if arch}
    named = next((NAMED[a] for a in (d.get("architectures") or []) if a in NAMED), None)  # (the module moved)
    if named or isinstance(d.get("dflash_module"), str):  # a variant outside dflash_tools/, as transformers' auto_map
        return (named or dflash.plugin(d["dflash_module"], f"{where} ({(d.get('architectures') or ['?'])[0]})")).Config
    arch = next((a for a in (d.get("architectures") or []) if a in known), None)
    return dflash.import_tool(known[arch], f"{where} ({arch})").Config if arch else DFlashConfig


def configure(spec, cfg, args):
    """(variant, its Config) of a run: --variant spec's module, else the one cfg's class comes from (--init_from's);
    args gets its flags' defaults where unnamed; its configure(cfg, args), else its Config of cfg's DFlash fields."""
    variant = dflash.plugin(spec, f"--variant {spec}") if spec else sys.modules[type(cfg).__module__]
    vars(args).update({**dflash.flag_dests(variant), **vars(args)})
    if hasattr(variant, "configure"):
        return variant, variant.configure(cfg, args)
    return variant, cfg if isinstance(cfg, variant.Config) else variant.Config(**{
        f.name: getattr(cfg, f.name) for f in fields(DFlashConfig)})


def prepare(variant, drafter, cfg, args):
    """The variant's prepare(drafter, cfg, args), else its Drafter holding drafter's weights (DFlash's carried over)."""
    if hasattr(variant, "prepare"):
        return variant.prepare(drafter, cfg, args)
    if isinstance(drafter, variant.Drafter):
        return drafter
    new = variant.Drafter(cfg, drafter.attention).to(drafter.fc.weight.device)
    new.load_state_dict(drafter.state_dict(), strict=False)
    return new


def check_config_keys(cfg, keys):
    """A variant's dflash_config_keys() (keys): each own field under its name (left out: only at its default)."""
    own = {f.name: f.default for f in fields(cfg)[len(fields(DFlashConfig)):]}
    bad = [f"returns {k!r}" for k in keys if k not in own] + [f"leaves out {k}" for k, v in own.items() if k not in keys
                                                                and getattr(cfg, k) != v]
    need(not bad, f"{type(cfg).__name__}.dflash_config_keys() {bad and bad[0]}; return each own field under its name")


def plugin_args(args):
    """The flags of --loss's and --stage's modules, by dest (what a resume must keep)."""
    modules = ([dflash.loss_plugin(args.loss)[0]] if args.loss != "ce" else []) + (
        [dflash.plugin(args.stage, "--stage")] if args.stage else [])
    return {k: getattr(args, k) for m in modules for k in dflash.flag_dests(m)}


def blame(e, tb, modules, step, out):
    """An exception raised in the code of one of the run's plug-ins (modules): its traceback, then one line naming the
    plug-in, the step and the last complete checkpoint. Raised elsewhere: nothing (it goes on as it was)."""
    files = {os.path.realpath(m.__file__): getattr(m, "DFLASH_MODULE", m.__name__) for m in modules}
    who = [files.get(os.path.realpath(f.f_code.co_filename)) for f, _ in traceback.walk_tb(tb)]
    if any(who):
        traceback.print_exception(e)
        raise DFlashError(f"plug-in {[w for w in who if w][-1]} raised {type(e).__name__} in step {step}: "
                          f"{first_line(e)}; {dflash.last_complete(out)}") from None


def unsaveable(x, where):  # where x holds a value torch.load(weights_only) refuses (a numpy scalar, a lambda), or None
    if type(x) in (dict, list, tuple):  # (exact types: a namedtuple, a numpy float, a float subclass, are refused)
        pairs = x.items() if type(x) is dict else enumerate(x)
        return next(filter(None, (unsaveable(k, f"a key of {where}") or unsaveable(v, f"{where}[{k!r}]")
                                  for k, v in pairs)), None)
    ok = x is None or type(x) in (bool, int, float, str) or torch.is_tensor(x)
    return None if ok else f"{where} is a {type(x).__module__}.{type(x).__qualname__}"


def check_saveable(state, step):
    """A training state holding only what torch.load(weights_only) reads back: a plug-in's flag values and a stage's
    state are the only places anything else could come from."""
    need(not (bad := unsaveable(state, "train_state")), f"cannot save step_{step}: {bad}; a checkpoint holds only "
         f"None, bool, int, float, str, tensors, and lists, tuples and dicts of them (a stage's state too)")


def other_architecture(d, saved, cfg):
    """Refuse to resume checkpoint d, of saved's architecture, in a run of cfg's: the flag that fits it."""
    was, v = saved.architecture, sys.modules[type(saved).__module__]
    v = getattr(v, "DFLASH_MODULE", v.__name__.split(".")[-1])
    fix = "drop --variant" if was == DFlashConfig.architecture else f"pass --variant {v}"
    raise DFlashError(f"cannot resume {d}: it is a {was}, not a {cfg.architecture}; {fix}, or give a new --out")
