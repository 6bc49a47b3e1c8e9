"""Losses beyond the paper's CE (--loss NAME, a name in LOSSES): D-PACE reweights the same hard cross-entropy by what
each block offset moves in the expected number of accepted drafts, computed from the drafter's own confidence without
gradient. A loss is a dflash.CE subclass (token_loss, weights, normaliser; target_logits = True also hands token_loss
the target's logits at the same rows, a chunk at a time); LOSSES maps its name to a function of the parsed flags that
builds it, and add_flags declares this module's flags (accepted only with one of its losses). A reweighted loss is
normalised per sequence of the global batch, as SpecForge does; NVIDIA Model-Optimizer divides by the sum of the
D-PACE weights and speculators by the number of tokens: the objective is shared, the normaliser is not."""
import torch

import dflash


def dpace_weights(q, valid, alpha, loss="dpace"):
    """D-PACE's weights (b, N, B) from q, the drafter's probability of each label (detached), on the valid positions
    (0 elsewhere). A block's expected number of accepted drafts is sum_m P_m, P_j = prod_{i<=j} s_i the chance its
    first j drafts all pass, with the confidence smoothed to s_i = (1-alpha) q_i + alpha (an invalid position counts
    as 1); offset j weighs what it moves in that sum, w_j = sum_{m>=j, m valid} P_m ("dpace") = P_j times the value
    of continuing; "dpace-prefix" keeps P_j alone, "dpace-continuation" w_j / P_j alone."""
    s = torch.where(valid, (1 - alpha) * q + alpha, 1.0)
    prefix = s.cumprod(-1)                                                         # P_j
    if loss == "dpace-prefix":
        return prefix * valid
    suffix = (prefix * valid).flip(-1).cumsum(-1).flip(-1)                         # sum_{m>=j, m valid} P_m
    if loss == "dpace":
        return suffix * valid
    return suffix / prefix.clamp(min=torch.finfo(prefix.dtype).tiny) * valid     # dpace-continuation


class DPACE(dflash.CE):
    """The CE per token, reweighted by dpace_weights from q = exp(log q); normalised by the number of sequences of
    the global batch with a real anchor."""

    def __init__(self, loss="dpace", alpha=0.5):
        self.loss, self.alpha = loss, alpha

    def weights(self, w, logq, valid):
        return dpace_weights(logq.exp(), valid, self.alpha, self.loss)

    def normaliser(self, w):
        return (w > 0).flatten(1).any(1).sum().float()


LOSSES = {name: (lambda args, name=name: DPACE(name, args.dpace_alpha))
          for name in ("dpace", "dpace-prefix", "dpace-continuation")}  # D-PACE, and its two factors alone


def add_flags(g):
    dflash.flag(g, "--dpace_alpha", 0.5, "D-PACE's smoothing of the drafter's confidence q: (1-alpha) q + alpha",
                float, hi=1)
