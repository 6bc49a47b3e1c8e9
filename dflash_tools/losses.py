"""Losses beyond the paper's CE (--loss): D-PACE reweights the same hard cross-entropy by what each block offset
moves in the expected number of accepted drafts, computed from the drafter's own confidence without gradient.
dflash.weighted_ce calls reweight(q, valid) -> weights; a reweighted loss is normalised per sequence of the global
batch (dflash.loss_normaliser), as SpecForge does; NVIDIA Model-Optimizer divides by the sum of the D-PACE weights
and speculators by the number of tokens: the objective is shared, the normaliser is not."""
import torch

LOSSES = ("dpace", "dpace-prefix", "dpace-continuation")  # D-PACE, and its two factors alone


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

def reweight(loss, alpha):
    """The weights function of --loss (one of LOSSES) with smoothing alpha, for dflash.weighted_ce."""
    assert loss in LOSSES, loss
    return lambda q, valid: dpace_weights(q, valid, alpha, loss)

def reweight_of(args):
    """--loss and --dpace_alpha's weights function (dflash.build_drafter)."""
    return reweight(args.loss, args.dpace_alpha)
