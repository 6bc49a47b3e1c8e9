"""--shard_target: the frozen target's decoder layers split over the ranks (FSDP2), imported by dflash.load_target
only under that flag."""
import torch
import torch.distributed as dist
import torch.nn as nn

from dflash import DFlashError, first_line


def shard_target(target, device):
    """--shard_target: each decoder layer's weights split 1/world per rank (FSDP2 fully_shard, frozen: no gradient or
    optimizer state), all-gathered one layer at a time while the target runs, the next layer prefetched, and freed
    again after its forward. The rest (embedding, final norm, lm_head, rotary buffers) stays whole on every rank: the
    drafter calls target.embed and target.lm_head itself. The target arrives on the CPU in its final dtype (real
    weights: a meta-device build would leave RoPE buffers unset and untie a tied lm_head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    layers, kind = target.layers, type(target.layers[0]).__name__
    whole = set(target.backbone.parameters()) - set(layers.parameters())  # embedding, final norm (, tied lm_head)
    owner = {}  # a weight shared by two layers: torch 2.13's FSDP2 refuses it, 2.11's does not; refused here alike
    for i, layer in enumerate(layers):
        for p in layer.parameters():
            if owner.setdefault(p, i) != i:
                raise DFlashError(f"--shard_target: cannot shard the {kind} layers of {target.name!r} (a weight is "
                                  f"shared by layers {owner[p]} and {i}); drop --shard_target")
    target.backbone.layers = nn.ModuleList()  # everything but the decoder layers onto the device, whole
    target.model.to(device)
    target.backbone.layers = layers
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))  # all ranks, on every node
    try:
        for layer in layers:  # reshard_after_forward: gathered for its forward only
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        # one root over the layers, so they share one all-gather stream; it owns no weights of its own
        fully_shard(target.backbone, mesh=mesh, reshard_after_forward=True, ignored_params=whole)
        for layer, after in zip(layers, layers[1:]):  # layer i's forward starts gathering layer i+1
            layer.set_modules_to_forward_prefetch([after])
        with torch.no_grad():  # FSDP checks the layers at the first forward (one token, on every rank): now
            target.backbone(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    except (ValueError, TypeError, RuntimeError, AssertionError, NotImplementedError) as e:
        raise DFlashError(f"--shard_target: cannot shard the {kind} layers of {target.name!r} "
                          f"({first_line(e)}); drop --shard_target") from None
    target.sharded = True
    return target
