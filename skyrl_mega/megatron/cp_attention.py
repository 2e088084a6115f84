"""Context-parallel causal attention over THD-packed sequences, without transformer-engine.

In:  this CP rank's q [t, Hq, D] and k / v [t, Hkv, D] in megatron's THD context-parallel layout
     (every padded sequence cut into 2*cp equal chunks, rank r holding chunks r and 2*cp-1-r of
     each, sequence by sequence: packing.cp_zigzag_positions), the global padded cu_seqlens, the
     CP process group, and `attend(q, k, v, q_offset)`: causal attention of a query block whose
     first row sits at key position `q_offset` (keys 0..q_offset+i visible to row i).
Out: [t, Hq, D], this rank's queries attending causally over their whole sequences.

K / V exchange: every rank all-gathers the group's K and V (`all_gather_cp`: autograd function,
backward = sum of the gradients of every rank's use, then this rank's slice), puts them back in
sequence order, and each of its query chunks attends to its sequence's prefix up to the chunk's
end. The zig-zag split balances the work: chunk r and chunk 2*cp-1-r together see 2*cp+1 chunks
of keys on every rank. RoPE is applied before this by megatron's THD path, which takes the same
CP layout (rope_utils._get_thd_freqs_on_this_cp_rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .packing import cp_zigzag_positions


class _AllGatherCP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.world = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # gloo has no reduce-scatter
        n = grad.shape[0] // ctx.world
        return grad[ctx.rank * n:(ctx.rank + 1) * n], None


def all_gather_cp(x: torch.Tensor, group) -> torch.Tensor:
    """[t, ...] per rank -> [world * t, ...], rank order, with the gradient sent back to each rank."""
    return _AllGatherCP.apply(x, group)


def sequence_order(cu_seqlens_padded: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Index into the rank-ordered gathered rows that puts them in packed-row (sequence) order."""
    held = torch.cat([cp_zigzag_positions(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    return torch.argsort(held)


def cp_packed_attention(q, k, v, cu_seqlens_padded: torch.Tensor, group, attend) -> torch.Tensor:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = [int(x) for x in cu_seqlens_padded.tolist()]
    if q.shape[0] * cp != cu[-1]:
        raise ValueError(f"CP rank holds {q.shape[0]} tokens; cu_seqlens end at {cu[-1]} for cp={cp}")
    order = sequence_order(cu_seqlens_padded, cp).to(q.device)
    k_all, v_all = (all_gather_cp(x, group)[order] for x in (k, v))
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        c = (b - a) // (2 * cp)
        if c == 0:
            continue
        local = a // cp
        for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
            rows = slice(local + half * c, local + (half + 1) * c)
            end = a + (chunk + 1) * c
            outs.append(attend(q[rows], k_all[a:end], v_all[a:end], chunk * c))
    return torch.cat(outs, 0)
