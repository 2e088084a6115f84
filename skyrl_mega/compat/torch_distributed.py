"""torch.distributed shims for ranks that talk through gloo on CUDA (SKYRL_DIST_BACKEND=gloo:
several ranks sharing one GPU); applied by megatron/parallel.init_distributed in that mode only.

In:  an explicit `apply_gloo_cuda_broadcast()` call.
Out: `torch.distributed.broadcast` takes a parameter that requires grad: gloo's CUDA broadcast
     copies the received host buffer back into the tensor on gloo's worker thread, where grad mode
     is on, so an in-place copy into a leaf that requires grad raises ("a leaf Variable that
     requires grad is being used in an in-place operation"); mbridge's export broadcasts every
     parameter over the pipeline group. The shim hands gloo `tensor.detach()` (same storage, the
     values land in the parameter; autograd is not involved). NCCL and CPU tensors never copy back.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .guard import Shim, mark_applied

SHIMS = (
    Shim("torch_distributed", "gloo_cuda_leaf_broadcast", "torch", ">=2.0", "2.11 (ProcessGroupGloo "
         "AsyncBroadcastCUDAWork::run copies back on the worker thread), 2.13",
         "gloo's CUDA broadcast into a parameter that requires grad fails on its copy back; the shim "
         "broadcasts a detached view of it",
         "tests/test_compat.py::test_gloo_cuda_leaf_broadcast_lands_in_the_parameter",
         "SKYRL_DIST_BACKEND=gloo with CUDA"),
)
_LEAF_BROADCAST = SHIMS[0]


def _detached_broadcast(broadcast):
    @functools.wraps(broadcast)
    def wrapper(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
            tensor = tensor.detach()
        return broadcast(tensor, *args, **kwargs)

    wrapper._skyrl_detached = True
    return wrapper


def apply_gloo_cuda_broadcast() -> list[str]:
    """Idempotent; returns the names applied now or before."""
    if not _LEAF_BROADCAST.needed_here():
        return []
    if not getattr(dist.broadcast, "_skyrl_detached", False):
        dist.broadcast = _detached_broadcast(dist.broadcast)
    mark_applied(_LEAF_BROADCAST)
    return [_LEAF_BROADCAST.name]
