"""megatron-core when its ranks talk through gloo on CUDA (SKYRL_DIST_BACKEND=gloo: several
ranks on one GPU): the gloo_cuda_grad_sync shim of the registry in __init__.py.

In:  `apply_gloo_cuda_shims()` from megatron/parallel.init_distributed in that mode.
Out: megatron's grad buffer issues its all-reduces one by one (gloo has no coalesced all-reduce
     for CUDA tensors).
"""

from __future__ import annotations

import contextlib

from ..guard import mark_applied
from . import SHIMS_BY_NAME

# --------------------------------------------------------------------------- gloo_cuda_grad_sync
class _Issued:
    """The handle megatron keeps from a coalescing manager whose ops already ran."""

    def wait(self):
        return True


@contextlib.contextmanager
def one_op_at_a_time(group=None, device=None, async_ops=False):
    """torch.distributed._coalescing_manager's contract for megatron's synchronous grad sync:
    the collectives called inside run as they are called (not batched at exit)."""
    if async_ops:
        raise RuntimeError("SKYRL_DIST_BACKEND=gloo on CUDA takes a synchronous grad sync only "
                           "(ddp overlap_grad_reduce / overlap_param_gather off), or use nccl")
    yield _Issued()


def apply_gloo_cuda_shims() -> list[str]:
    """When the ranks talk through gloo on CUDA (parallel.dist_backend): megatron's grad buffer
    issues its all-reduces one by one. Idempotent; returns the names applied now or before."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    shim = SHIMS_BY_NAME["gloo_cuda_grad_sync"]
    if not shim.needed_here() or not hasattr(pgb, "_coalescing_manager"):
        return []
    pgb._coalescing_manager = one_op_at_a_time
    mark_applied(shim)
    return ["gloo_cuda_grad_sync"]
