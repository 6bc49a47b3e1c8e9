"""Sampling at temperature T > 0 (eval.py --temperature): the walk along continuations sampled from the target.

vLLM's default DFlash path and SGLang's plain DFlash accept the drafter's argmax d with probability p'(d) (p': the
target's distribution after temperature/top_k/top_p) and on a rejection emit a sample of the residual. Drawing x ~ p'
and accepting when x == d has the same law, so tau at T is the greedy rule's walk (dflash.walk_continuation) along
continuations sampled from the target. A draft rule that samples its block gives its probability of each true token
("q" among its tensors): sampled_lengths verifies it by rejection sampling. s: eval.py's Sampling."""
import math

import torch

import dflash

def sampling_probs(logits, s):
    """p' (..., V) float: softmax(logits / temperature) on the top_k largest logits (ties kept), then on the fewest
    most likely tokens holding top_p of the mass (vLLM's and transformers' order). In float64 from the largest logit
    down: the top logit stays 0 at any temperature (no inf - inf), and nothing rounds to 0 as in float32."""
    logits = logits.double()
    z = (logits - logits.max(-1, keepdim=True).values) / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        z = z.masked_fill(z < z.topk(s.top_k).values[..., -1:], -math.inf)
    if s.top_p < 1:
        p, order = z.softmax(-1).sort(-1, descending=True)
        drop = p.cumsum(-1) - p >= s.top_p  # the more likely tokens already hold top_p
        z = z.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return z.softmax(-1).float()

@torch.no_grad()
def sampled_continuation(target, prompt, max_new_tokens, eos, s, generator):
    """The target's own sampling with its cache (dense or hybrid): up to max_new_tokens tokens drawn from
    sampling_probs, stopping after an eos token. generator: a seeded torch.Generator on the target's device."""
    dev = target.lm_head.weight.device
    x, cache, out = torch.tensor([prompt], device=dev), None, []
    while len(out) < max_new_tokens and not (out and out[-1] in eos):
        step = target.model(input_ids=x, cache=cache, use_cache=True, logits_to_keep=1)
        cache = step.cache
        out.append(int(torch.multinomial(sampling_probs(step.logits[0, -1], s), 1, generator=generator)))
        x = torch.tensor([[out[-1]]], device=dev)
    return out

def truth_probs(target, final, prompt_len, continuation, s):
    """p'(s[j]) at j = 1..n-1 (1 at j = 0): the target's sampling_probs of each continuation token, from the hooked
    pass's final hidden states (position P+j-1 predicts s[j]), in chunks of positions (no (n, V) tensor)."""
    f, truth = final[0, prompt_len:prompt_len + len(continuation) - 1], torch.tensor(continuation[1:])
    chunk, p = dflash.vocab_chunk(target.vocab_size), [torch.ones(1)]
    for c in range(0, len(f), chunk):
        probs = sampling_probs(target.lm_head(f[c:c + chunk].to(target.lm_head.weight.dtype)), s).cpu()
        p.append(probs.gather(1, truth[c:c + chunk, None]).squeeze(1))
    return torch.cat(p)

def sampled_lengths(continuation, p_truth, q, generator):
    """The walk along a sampled continuation (p_truth: truth_probs) of a rule that samples its block, verified by
    rejection sampling (z-lab's reference). q (n, B-1): its probability of continuation[k+i] at offset i of block k,
    the true tokens before it given (its path while accepted). Coupled, with the same law: the target's x is the
    draft with probability min(1, q(x) / p'(x)): u * p'(x) < q(x) (u uniform); a rejection emits x (the residual's)."""
    at = (torch.arange(len(q))[:, None] + torch.arange(1, q.shape[1] + 1)).clamp(max=len(continuation) - 1)
    accept = (torch.rand(q.shape, generator=generator) * p_truth[at] < q.float().cpu()).tolist()
    return dflash.walk_steps(continuation, lambda k, truth: dflash.accepted_prefix(accept[k], [True] * len(truth)))
