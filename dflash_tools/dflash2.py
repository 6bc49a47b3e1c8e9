"""DFlash2, a DFlash variant in one file: its config, layers, candidate selector, loss, draft rule, checks and
checkpoint layout (z-lab's released DFlash2DraftModel files). dflash.py imports it where --dflash2 or a config.json
naming DFlash2DraftModel asks for it; it subclasses DFlash's config and drafter and overrides their hooks.

DFlash2 adds two pieces to DFlash: a grouped dynamic causal convolution along each block's offsets on both sides of
every attention and MLP sublayer (identity at init), and a candidate selector that re-ranks the target head's top-k
tokens at each offset by S(a, b) = U(b) + <A[a] * H(h), Bc[b]> (a: the previous token of the block); the drafted
block is the selector's greedy path, and its CE on the teacher-forced path joins the loss (zero successor codebook
at init: a fresh DFlash2 drafter drafts what its DFlash backbone drafts).

Where the public sources disagree, the choice here (SpecForge's default wins where it has one), and why:
- gold token outside the top-k; teacher-forced predecessor: no selector loss; the anchor, then the previous offset's
  label (a recall miss is the backbone's, serving never sees it; while drafts are accepted, the walk's picks are the
  labels).
- selector term's denominator: the batch's Σw, shared with the CE (SpecForge; its own-denominator CE is logged as
  selector_loss).
- initialisation: zero successor codebook, identity convolutions (a fresh DFlash2 drafter is its DFlash drafter).
- output_multiplier, softcap in the CE; softcap 0: applied: the CE is on c·tanh(m·z/c); 0 refused, null is off (the
  unary logits DFlash2 serves (SpecForge too); the engines read 0 as off, SpecForge refuses it).
- causality inside the block: the config's rule (is_causal: false: bidirectional) (as z-lab and both engines serve
  released files).
- input_embedding_scale: read and applied; written only when ≠ 1 (SGLang ignores it: keep 1 for a portable drafter).
- vLLM's convolution block: 1 + num_speculative_tokens (serve with num_speculative_tokens = B − 1).
- top-k ties, lm_head bias: sorted top-k, the lowest slot wins; the head as it is (deterministic; z-lab's reference
  keeps the bias)."""
import math
from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from dflash import (CE, DecoderLayer, DFlashConfig, DFlashDrafter, DFlashError, accuracy_stats, flag, is_int, need,
                    vocab_chunk)

INTS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # all four, always
UNARY = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


@dataclass
class Config(DFlashConfig):
    conv_kernel_size: int = 2            # K taps along the block offsets (released: 2)
    conv_group_size: int = 16            # channels sharing one dynamic tap (released: 16)
    selector_rank: int = 256             # r of the selector's codebooks (released: 256)
    selector_top_k: int = 16             # k candidates per drafted offset (released: 16)
    output_multiplier: float = 1.0       # the unary logits c * tanh(m * z / c): m
    final_logit_softcapping: float | None = None  # c (None: no cap)
    input_embedding_scale: float = 1.0   # on the block embeddings
    architecture: ClassVar[str] = "DFlash2DraftModel"

    def problems(self):
        """DFlash's rules, then DFlash2's, as the engines and trainers that serve or train it enforce them: K <=
        block_size, the group size divides the hidden size, 1 <= top_k <= vocab, a positive multiplier and scale, a
        softcap null or > 0."""
        bad = super().problems()
        ints = {k: getattr(self, k) for k in INTS}
        bad += [f"{k} must be an integer >= 1, got {v!r}" for k, v in ints.items() if not (is_int(v) and v >= 1)]
        if bad:
            return bad
        K, gs, r, k = ints.values()
        m, c, s = self.output_multiplier, self.final_logit_softcapping, self.input_embedding_scale
        real = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf  # noqa: E731
        checks = [
            (K <= self.block_size, f"conv_kernel_size {K} is larger than block_size {self.block_size}: the "
                                   f"convolution runs along one block's offsets; use 1..{self.block_size}"),
            (self.hidden_size % gs == 0, f"conv_group_size {gs} does not divide hidden_size {self.hidden_size}"),
            (k <= self.vocab_size, f"selector_top_k {k} is larger than the vocabulary {self.vocab_size}"),
            (real(m), f"output_multiplier must be a positive finite number, got {m!r}"),
            (c is None or real(c), f"final_logit_softcapping must be null (off) or > 0, got {c!r} (z-lab and the "
                                   f"engines read 0 as off, SpecForge refuses it: write null)"),
            (real(s), f"input_embedding_scale must be a positive finite number, got {s!r}"),
        ]
        return [msg for ok, msg in checks if not ok]

    def dflash_config_keys(self):
        """config.json's dflash_config gets the four integers and each transform that is not the identity (the
        softcap only when set: never 0)."""
        return {**{k: getattr(self, k) for k in INTS},
                **{k: getattr(self, k) for k, plain in UNARY.items() if getattr(self, k) != plain}}

# -----------------------------------------------------------------------------
# The grouped dynamic causal convolution around each sublayer

class GroupedCausalConv(nn.Module):
    """DFlash2's convolution along the offsets of each block, one per sublayer (attention_conv, mlp_conv): side 0
    convolves the normed sublayer input, side 1 the sublayer's output. For offset t and channel c of group
    g(c) = c // group_size:  out[t, c] = sum_j (base_kernel[side, j, c] + delta[t, side, j, g(c)]) * x[t - j, c],
    x[t - j] = 0 for t < j: the taps read offsets t, t-1, ..., t-K+1 of the same block and never the previous block
    or the context. delta = kernel_projection(u[t]) (both sides from the same normed input u, at the output offset).
    Initialised as the identity (tap 0 = 1, the others 0, the projection 0): a fresh DFlash2 drafter is DFlash."""

    def __init__(self, hidden_size, kernel_size, group_size):
        super().__init__()
        self.K, self.gs, self.G = kernel_size, group_size, hidden_size // group_size
        base = torch.zeros(2, kernel_size, hidden_size)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)                                         # (side, tap, channel)
        with torch.random.fork_rng(devices=[]):  # built drawing nothing: the same seed gives DFlash's backbone
            self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.G, bias=False)  # side*K*G + j*G + g
        self.kernel_projection.identity_init = True  # DFlashDrafter's normal init leaves it at zero
        self.reset_identity()

    def reset_identity(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def dynamic(self, u):
        """u (b, N, B, D) normed sublayer input -> delta (b, N, B, 2, K, G): each group's dynamic taps, both sides."""
        return self.kernel_projection(u).unflatten(-1, (2, self.K, self.G))

    def forward(self, x, delta, side):
        """x (b, N, B, D) -> (b, N, B, D), convolved along dim -2 (the block offsets) with zero left padding."""
        B, out = x.shape[-2], 0
        for j in range(self.K):
            xj = F.pad(x, (0, 0, j, 0))[..., :B, :] if j else x                # x[t - j]: zero for t < j
            dyn = (delta[..., side, j, :, None] * xj.unflatten(-1, (self.G, self.gs))).flatten(-2)
            out = out + self.base_kernel[side, j] * xj + dyn
        return out.to(x.dtype)

class DFlash2DecoderLayer(DecoderLayer):
    """DFlash2's decoder layer: DecoderLayer with a GroupedCausalConv on both sides of each sublayer, inside the
    residual branch after the pre-norm: x + conv1(attn(conv0(norm(x)))), then the same around the MLP. The block's
    queries, keys and values come from the convolved input; the context keys/values are untouched."""

    def __init__(self, cfg, index):
        super().__init__(cfg, index)
        self.attention_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
        self.mlp_conv = GroupedCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        u = self.input_layernorm(x)
        delta = self.attention_conv.dynamic(u)
        y = self.self_attn(self.attention_conv(u, delta, 0), cos, sin, k_ctx, v_ctx, mask)
        x = x + self.attention_conv(y, delta, 1)
        u = self.post_attention_layernorm(x)
        delta = self.mlp_conv.dynamic(u)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(u, delta, 0)), delta, 1)

# -----------------------------------------------------------------------------
# The candidate selector over the target head's top-k

class CandidateSelector(nn.Module):
    """DFlash2's re-ranking of the k best unary tokens at each drafted offset: S(a, b) = U(b) + <A[a] * H(h), Bc[b]>,
    a the predecessor token (the anchor for offset 1, then the previous pick), U the unary logit of candidate b, A and
    Bc low-rank codebooks (V, r), H a projection of the drafter's final-normed hidden state h. Bc starts at zero, so
    a fresh selector ranks by U alone: its greedy path is the unary argmax."""

    def __init__(self, hidden_size, vocab_size, rank):
        super().__init__()
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)
        # plain parameters, not nn.Embedding: the released files name them without ".weight"
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))  # 0: the unary ranking at first

    def scores(self, h, pred, cand, unary):
        """h (..., D), pred (...,) predecessor ids, cand (..., k) candidate ids, unary (..., k) -> S (..., k) fp32."""
        # F.embedding, not indexing: its backward sums a row's repeats in a fixed order (indexing's scatter-add on
        # CPU threads does not, and two runs of one step would differ in the last bits)
        a = F.embedding(pred, self.predecessor_codebook) * self.hidden_projection(h)      # (..., r)
        dt = unary.dtype  # fp32 (float64 in the tests)
        return unary + torch.einsum("...r,...kr->...k", a.to(dt), F.embedding(cand, self.successor_codebook).to(dt))

    def greedy_path(self, h, cand, unary, anchor_ids):
        """The drafted block at T = 0: h (n, B-1, D), cand/unary (n, B-1, k), anchor_ids (n,) -> (n, B-1) ids, each
        offset's argmax over its candidates given the previous pick (lowest candidate slot on ties)."""
        pred, path = anchor_ids, []
        for i in range(cand.shape[1]):
            s = self.scores(h[:, i], pred, cand[:, i], unary[:, i])
            pred = cand[:, i].gather(1, s.argmax(-1, keepdim=True)).squeeze(1)
            path.append(pred)
        return torch.stack(path, 1) if path else anchor_ids.new_zeros(len(anchor_ids), 0)

def unary_logits(logits, multiplier=1.0, softcap=None):
    """DFlash2's unary logits z' = c * tanh(m * z / c) (m * z without a cap), in fp32: what its top-k, the selector's
    U and the base CE read."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if multiplier != 1:
        z = z * multiplier
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z

# -----------------------------------------------------------------------------
# The drafter: DFlash's hooks overridden

class Drafter(DFlashDrafter):
    """DFlash's drafter with DFlash2DecoderLayer layers and a CandidateSelector (initialised after DFlash's weights:
    a seed gives the same backbone). Drafts its selector's greedy path; its loss adds the selector's CE."""
    Layer = DFlash2DecoderLayer
    WALKS = ("unary",)  # walk_tau also walks the unary argmax's drafts (a diagnostic)
    schedule = (1.0, 0.0, 0.0)  # the selector term's (alpha, warmup_ratio, ramp_ratio): prepare() sets --selector_*
    stop_gradient = False
    alpha = 1.0  # the selector term's weight at the last training step

    def __init__(self, cfg, attention="dense"):
        super().__init__(cfg, attention)
        self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank)

    def blocks(self, x, anchors, anchor_valid, kv, S):
        scale = self.cfg.input_embedding_scale
        return super().blocks(x * scale if scale != 1 else x, anchors, anchor_valid, kv, S)

    def draft(self, logits, h, anchor_ids, truth=None, temperature=0.0):
        """The selector's greedy path over the unary top-k (one top-k over V serves the path and the details). With
        truth (n, B), the diagnostics: "unary" the unary argmax (n, B-1) (walked too: WALKS), "topk" whether each true
        token is among the k candidates and, at temperature > 0, "q": the selector's softmax(S / T) of the true token
        (0 when it is no candidate) with the previous true token as predecessor (while the drafts are accepted the
        path is the truth), the block drawn from q and verified by rejection sampling (eval.py --temperature)."""
        cfg = self.cfg
        top = unary_logits(logits, cfg.output_multiplier, cfg.final_logit_softcapping).topk(cfg.selector_top_k)
        drafts = self.candidate_selector.greedy_path(h, top.indices, top.values, anchor_ids)
        if truth is None:
            return drafts, {}
        hit = top.indices == truth[:, 1:, None]                                              # (n, B-1, k)
        out = {"unary": logits.argmax(-1), "topk": hit.any(-1)}
        if temperature > 0:
            s = self.candidate_selector.scores(h, truth[:, :-1], top.indices, top.values)   # (n, B-1, k)
            out["q"] = torch.where(hit, (s / temperature).softmax(-1), 0.0).sum(-1)
        return drafts, out

    def block_loss(self, hidden, lm_head, labels, weights, block_ids, loss=None, progress=None, final=None):
        need(loss is None or type(loss) is CE, "another --loss with a DFlash2 drafter is not implemented")
        return dflash2_weighted_ce(hidden, lm_head, labels, weights, self.cfg, self.candidate_selector,
                                   predecessors(block_ids, labels), self.alpha_at(progress), self.stop_gradient)

    def alpha_at(self, progress):
        """The selector term's weight at progress (step, total_steps), kept for summary; None: --selector_alpha."""
        if progress is not None:
            self.alpha = selector_alpha(*progress, *self.schedule)
        return self.alpha if progress else self.schedule[0]

    def logprobs(self, logits, h, prev, progress=None):
        """The distributions it drafts from: its unary softmax, and alpha times its selector's softmax over the unary
        top-k (prev: each row's predecessor), whose own log-probabilities a stage compares over those k tokens."""
        cfg = self.cfg
        z = unary_logits(logits, cfg.output_multiplier, cfg.final_logit_softcapping)
        top = z.topk(cfg.selector_top_k)
        hs, vals = (h.detach(), top.values.detach()) if self.stop_gradient else (h, top.values)
        s = self.candidate_selector.scores(hs, prev, top.indices, vals)
        return [(1.0, F.log_softmax(z, -1), None), (self.alpha_at(progress), F.log_softmax(s, -1), top.indices)]

    def summary(self, stats):
        """The selector's own CE (over the covered tokens), and the diagnostics: the unary argmax's tau and acc, the
        top-k recall; and the selector term's weight."""
        count = stats["count"].clamp(min=1)
        return {"selector_loss": (stats["sel_ce_w"] / stats["sel_w"].clamp(min=1e-9)).item(),
                "unary_tau": 1.0 + (stats["unary_accepted"] / stats["blocks"].clamp(min=1)).item(),
                "unary_acc": (stats["unary_correct"] / count).tolist()[1:],
                "topk_recall": (stats["covered"][1:].sum() / stats["count"][1:].sum().clamp(min=1)).item(),
                "selector_alpha": float(self.alpha)}

Config.Drafter = Drafter

# -----------------------------------------------------------------------------
# The loss: the selector's term beside DFlash's CE

def selector_ce(selector, h, pred, vals, idx, labels, stop_gradient=False):
    """DFlash2's teacher-forced selector term per token: h (T, D) final-normed hidden states, pred (T,) predecessor
    ids, vals/idx (T, k) the unary top-k, labels (T,). Returns ce (T,) (0 where the label is not a candidate: a
    recall miss is the backbone's, it carries no selector gradient), covered (T,) bool, and pick (T,) the selector's
    argmax. stop_gradient: the selector CE trains the selector alone (h and U detached here only)."""
    if stop_gradient:
        h, vals = h.detach(), vals.detach()
    s = selector.scores(h, pred, idx, vals)                                             # (T, k)
    hit = idx == labels[:, None]
    covered = hit.any(-1)
    ce = s.logsumexp(-1) - torch.where(hit, s, 0.0).sum(-1)
    pick = idx.gather(1, s.argmax(-1, keepdim=True)).squeeze(1)
    return torch.where(covered, ce, 0.0), covered, pick

def selector_alpha(step, total_steps, alpha, warmup_ratio=0.0, ramp_ratio=0.0):
    """The selector term's weight at (0-based) optimizer step `step`: 0 during the first floor(warmup_ratio * total)
    steps, then a linear ramp over floor(ramp_ratio * total) steps up to alpha (at once when that is 0)."""
    warm, ramp = math.floor(total_steps * warmup_ratio), math.floor(total_steps * ramp_ratio)
    if step < warm:
        return 0.0
    if ramp <= 0:
        return alpha
    return alpha * min(max((step - warm + 1) / ramp, 0.0), 1.0)

def predecessors(block_ids, labels):
    """Teacher-forced predecessors (b, N, B): offset 1's is the anchor token, offset i >= 2's the label of offset i-1
    (the target's greedy token under --labels target: what the walk's pick is while its drafts are accepted)."""
    return torch.cat([block_ids[..., :1], block_ids[..., :1], labels[..., 1:-1].clamp(min=0)], -1)

def dflash2_weighted_ce(hidden, lm_head, labels, weights, cfg, selector, pred, alpha, stop_gradient, chunk=None):
    """weighted_ce for DFlash2: sum(w * CE(z')) + alpha * sum(w * covered * CE_selector) over the block tokens, the
    unary CE on DFlash2's unary logits z' (the logits it serves; SpecForge trains on them too) and the selector's CE
    over their top-k, both from one chunked lm_head pass. The caller divides the sum by the batch's sum(w): one
    denominator for both terms (SpecForge's rule: the selector's weight follows its top-k coverage). pred (b, N, B)
    predecessor ids. Stats: the tau estimate and acc walk the selector's teacher-forced picks (while they are right
    they are the greedy walk's picks too), the unary argmax's and the top-k recall beside them, and the selector's
    CE over the covered tokens (sel_ce_w / sel_w)."""
    sel = (weights.flatten() > 0).nonzero().squeeze(1).to(hidden.device)  # (weights on the CPU in training: no sync)
    weights = weights.to(hidden.device)
    w = weights.flatten()
    h, y = hidden.reshape(-1, hidden.shape[-1])[sel], labels.flatten()[sel].clamp(min=0)
    ce, unary_pred, vals, idx = ChunkedLMHeadTopK.apply(h, lm_head.weight, lm_head.bias, y,
                                                        chunk or vocab_chunk(lm_head.weight.shape[0]),
                                                        cfg.selector_top_k, cfg.output_multiplier,
                                                        cfg.final_logit_softcapping)
    sce, covered, pick = selector_ce(selector, h, pred.flatten()[sel], vals, idx, y, stop_gradient)
    ce_w, sel_w = (ce * w[sel]).sum(), (sce * w[sel]).sum()
    valid = weights > 0

    def per_token(hit):  # (b, N, B) bool, False off the selected tokens
        full = torch.zeros(valid.numel(), dtype=torch.bool, device=hidden.device)
        full[sel] = hit
        return full.view_as(valid) & valid
    unary = accuracy_stats(per_token(unary_pred == y), valid)
    return ce_w + alpha * sel_w, {
        "w": weights.sum().detach(), "ce_w": ce_w.detach(), **accuracy_stats(per_token(pick == y), valid),
        "unary_correct": unary["correct"], "unary_accepted": unary["accepted"],
        "covered": per_token(covered).sum((0, 1)).float(), "sel_ce_w": sel_w.detach(),
        "sel_w": (w[sel] * covered).sum().detach()}

class ChunkedLMHeadTopK(torch.autograd.Function):
    """ChunkedLMHead's CE on the unary logits z' (see unary_logits), also returning their top-k (values, differentiable
    w.r.t. h, and ids) from the same chunked pass: no (T, V) tensor is kept."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, chunk, topk, multiplier, softcap):
        T = h.shape[0]
        ce = torch.empty(T, dtype=torch.float32, device=h.device)
        pred = torch.empty(T, dtype=torch.long, device=h.device)
        vals = torch.empty(T, topk, dtype=torch.float32, device=h.device)
        idx = torch.empty(T, topk, dtype=torch.long, device=h.device)
        grad = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for s in range(0, T, chunk):
            hs, ys = h[s:s + chunk].to(weight.dtype), labels[s:s + chunk]
            logits = F.linear(hs, weight, bias).float()
            z = unary_logits(logits, multiplier, softcap)
            lse = z.logsumexp(-1)
            ce[s:s + chunk] = lse - z.gather(1, ys[:, None]).squeeze(1)
            pred[s:s + chunk] = z.argmax(-1)
            top = z.topk(topk)
            vals[s:s + chunk], idx[s:s + chunk] = top.values, top.indices
            if grad is not None:
                p = (z - lse[:, None]).exp_()
                p[torch.arange(len(ys), device=h.device), ys] -= 1.0
                p = p * unary_slope(z, multiplier, softcap)
                grad[s:s + chunk] = (p.to(weight.dtype) @ weight).to(h.dtype)
                del p
            del logits, z
        ctx.save_for_backward(grad, vals, idx, weight)
        ctx.chunk, ctx.multiplier, ctx.softcap = chunk, multiplier, softcap
        ctx.mark_non_differentiable(pred, idx)
        return ce, pred, vals, idx

    @staticmethod
    def backward(ctx, grad_ce, grad_pred, grad_vals, grad_idx):
        grad, vals, idx, weight = ctx.saved_tensors
        g = grad * grad_ce[:, None].to(grad.dtype)
        if grad_vals is not None:  # d vals / d h = t'(z) * W[idx]: k rows of the head per token, in chunks
            slope = grad_vals * unary_slope(vals, ctx.multiplier, ctx.softcap)
            for s in range(0, len(g), ctx.chunk):
                rows = weight[idx[s:s + ctx.chunk]].float()                          # (chunk, k, D)
                g[s:s + ctx.chunk] += torch.einsum("tk,tkd->td", slope[s:s + ctx.chunk], rows).to(g.dtype)
        return g, None, None, None, None, None, None, None

def unary_slope(z, multiplier, softcap):
    """dz'/dz of unary_logits at transformed values z': m * (1 - (z' / c)^2) with a cap, m without."""
    slope = torch.full_like(z, float(multiplier))
    if softcap:
        slope = slope * (1 - (z / softcap).square())
    return slope

# -----------------------------------------------------------------------------
# Set-up from the flags (dflash.check_run, dflash.build_drafter)

def add_flags(g):
    flag(g, "--conv_kernel_size", None, "K, the convolution's taps along the block (default 2)", int, lo=1, hi=256)
    flag(g, "--conv_group_size", None, "channels sharing one dynamic tap (default 16)", int, lo=1, hi=65536)
    flag(g, "--selector_rank", None, "rank of the selector's codebooks (default 256)", int, lo=1, hi=8192)
    flag(g, "--selector_top_k", None, "candidates per drafted offset (default 16)", int, lo=1, hi=1024)
    flag(g, "--selector_alpha", None, "weight of the selector's CE (default 1; 0: not trained)", float)
    flag(g, "--selector_warmup_ratio", None, "fraction of the steps with the selector at 0 (default 0)", float, hi=1)
    flag(g, "--selector_ramp_ratio", None, "fraction of the steps of its linear ramp to alpha (default 0)", float, hi=1)
    flag(g, "--selector_stop_gradient", False, "the selector's CE trains the selector alone", action="store_true")

DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}

def configure(cfg, args):
    """--variant dflash2: the drafter config with DFlash2's fields from the flags (released geometry by default: K 2,
    group 16, rank 256, top-k 16); a drafter that already is DFlash2 (--init_from one) keeps its own. Refused: a tree
    budget (no source defines tree verification for DFlash2: its selector drafts one chain) and another --loss (its
    selector's term is defined beside the CE)."""
    geometry = {k: getattr(args, k, None) for k in INTS}  # (none: --init_from's DFlash2)
    if not isinstance(cfg, Config):
        base = {f.name for f in fields(DFlashConfig)}
        try:
            cfg = Config(**{k: v for k, v in asdict(cfg).items() if k in base},
                         **{k: DEFAULTS[k] if v is None else v for k, v in geometry.items()})
        except DFlashError as e:
            raise DFlashError("\n".join(f"--variant dflash2: {p}" for p in str(e).splitlines())) from None
    need(not args.eval_walk_tree_budget, "--eval_walk_tree_budget: a DFlash2 drafter's selector drafts one chain, and "
         "no tree verification is defined for it; drop --eval_walk_tree_budget")
    need(args.loss == "ce", f"--loss {args.loss} with a DFlash2 drafter is not implemented (its selector's term is "
         f"defined beside the CE); drop --loss")
    return cfg

def prepare(drafter, cfg, args):
    """The DFlash2 drafter to train: --init_from a DFlash drafter gives that drafter holding its weights, its own
    pieces fresh (identity convolutions, a zero successor codebook), so that at step 0 it drafts exactly what that
    drafter drafts; and the selector term's schedule from --selector_* (alpha 0: the selector is not trained)."""
    if not isinstance(drafter, Drafter):
        w = drafter.fc.weight
        new = Drafter(cfg, drafter.attention).to(w.device, w.dtype)
        missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("candidate_selector.") or "_conv." in k for k in missing)
        drafter = new
    get = lambda k: getattr(args, f"selector_{k}", None)  # noqa: E731 (none: --init_from's DFlash2, no --variant)
    alpha = 1.0 if get("alpha") is None else get("alpha")
    drafter.schedule = (alpha, get("warmup_ratio") or 0.0, get("ramp_ratio") or 0.0)
    drafter.alpha, drafter.stop_gradient = alpha, bool(get("stop_gradient"))
    if alpha == 0:
        drafter.candidate_selector.requires_grad_(False)
    return drafter
