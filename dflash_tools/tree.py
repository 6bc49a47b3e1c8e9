"""Tree verification (DDTree's rule, greedy): the acceptance rule eval.py's --tree_budget and training's
--eval_walk_tree_budget walk the drafter's blocks with. At each anchor the drafter's block gives, for each depth
d = 1..B-1, log-probabilities log q_d over the vocabulary (depth marginals); the top-K per depth build a best-first
tree of `budget` nodes, and the target accepts the longest prefix of its greedy continuation that is a path of it.
A chain is the special case K = 1, budget B-1."""
import heapq

from dflash import walk_steps


def tree_nodes(logq, budget):
    """DDTree's best-first draft tree at one anchor. logq[d][r]: log q of the r-th best token at depth d+1 (the
    drafter's block offset d+1), ranked best first, K per depth; q_d is a depth marginal, so a path's score is the sum
    of its tokens' log q. A node is a rank tuple (r_1, ..., r_d). Best-first from the depth-1 top token: each pop
    adds the node and pushes its next sibling (r_d + 1) and its first child (rank 0 one depth down), until `budget`
    nodes. Every node's parent is added before it, so the tree is prefix-closed. Returns the nodes in order added."""
    D, K = len(logq), len(logq[0])
    heap, nodes = [(-logq[0][0], (0,))], []  # (minus the score, ranks): heapq pops the best score first
    while heap and len(nodes) < budget:
        neg, ranks = heapq.heappop(heap)
        nodes.append(ranks)
        d, r = len(ranks) - 1, ranks[-1]
        if r + 1 < K:
            heapq.heappush(heap, (neg + logq[d][r] - logq[d][r + 1], ranks[:-1] + (r + 1,)))
        if d + 1 < D:
            heapq.heappush(heap, (neg - logq[d + 1][0], ranks + (0,)))
    return nodes

def tree_accept(logq, tokens, truth, budget):
    """Accepted drafts at one anchor under tree verification: the length of the longest prefix of the truth (the
    target's greedy tokens after the anchor) that is a path of the tree_nodes(logq, budget) tree. tokens[d][r]: the
    token of rank r at depth d+1 (logq's ranking). The target follows its argmax down the tree, so this is what it
    accepts. A chain is K = 1, budget B-1."""
    tree, path = set(tree_nodes(logq, budget)), ()
    for d, t in enumerate(truth[:len(tokens)]):
        if t not in tokens[d] or path + (tokens[d].index(t),) not in tree:
            break  # the target's token is not among this node's children
        path += (tokens[d].index(t),)
    return len(path)

def tree_walk(continuation, logq, tokens, budget):
    """Acceptance lengths of greedy tree verification along the greedy continuation: tau_walk with tree_accept.
    logq, tokens (n, B-1, K): the drafter's top-K log-probabilities and tokens per depth at every anchor (from
    draft_every_anchor(..., rule=topk_rule(K))); K >= budget is the exact DDTree tree (no node ranks deeper)."""
    logq, tokens = logq.cpu(), tokens.cpu()  # rows read one by one as the walk visits them
    return walk_steps(continuation, lambda k, truth: tree_accept(logq[k].tolist(), tokens[k].tolist(), truth, budget))

def rule(budgets, vocab_size):  # dflash.walk_continuation's draft rule for tree walks of these budgets
    return topk_rule(min(max(budgets), vocab_size))

def walks(continuation, more, budgets):  # dflash.walk_continuation's tree walks: {budget: acceptance lengths}
    return {b: tree_walk(continuation, more["logq"], more["tokens"], b) for b in budgets}

def topk_rule(K):
    """A draft rule for draft_every_anchor: the argmax drafts, and per block offset the K best tokens with their
    log-probabilities, best first ("logq", "tokens", each (n, B-1, K)): what tree verification builds its trees from."""
    def rule(logits, h, anchor_ids, truth=None, temperature=0.0):
        top = logits.topk(K)
        return logits.argmax(-1), {"logq": top.values.float() - logits.float().logsumexp(-1, keepdim=True),
                                   "tokens": top.indices}
    return rule
