"""megatron-core's optimizer without apex / transformer-engine: the optimizer shims of the
registry in __init__.py.

In:  `apply_optimizer_shims()` before an optimizer is built and `use_fused_torch_adam(optimizer)`
     after (megatron/optimizer.py); `ensure_optimizer_state(optimizer)` / `restore_adam_steps(
     optimizer)` around a dist-ckpt optimizer load (checkpoint/dist_ckpt.py).
Out: the grad norm without a device sync per tensor, torch AdamW's fused kernel, and a resumed
     torch Adam that continues with the uninterrupted run's bias correction.
"""

from __future__ import annotations

import torch

from ..guard import mark_applied
from . import SHIMS_BY_NAME

# --------------------------------------------------------------------------- foreach_grad_norm
def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """amp_C.multi_tensor_l2norm's contract (the total L2 norm of tensor_lists[0] as a float32
    [1] tensor, None) from torch's multi-tensor norm, on the tensors' device, without a sync."""
    tensors = tensor_lists[0]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms])).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """amp_C.multi_tensor_scale's contract: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    src, dst = tensor_lists
    if all(a is b for a, b in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def apply_optimizer_shims() -> list[str]:
    """Before building an optimizer: megatron's grad-norm fallbacks -> foreach ones where the
    `foreach_grad_norm` guard holds; idempotent. Returns the names applied now or before."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    shim = SHIMS_BY_NAME["foreach_grad_norm"]
    if not shim.needed_here():
        return []
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale
    if clip_grads.l2_norm_impl is foreach_l2_norm:
        mark_applied(shim)
        return ["foreach_grad_norm"]
    return []


# --------------------------------------------------------------------------- optimizer state
def _torch_adam_in_use() -> bool:
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def _inner_optimizers(optimizer):
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield inner


def ensure_optimizer_state(optimizer) -> None:
    """Before building a dist-ckpt load request: gives a fresh torch Adam its per-parameter state
    by one zero-gradient inner step (as megatron does for its FSDP path); the loaded state then
    replaces it. Skipped where the `optimizer_state` guard does not hold."""
    shim = SHIMS_BY_NAME["optimizer_state"]
    if not (shim.needed_here() and _torch_adam_in_use()):
        return
    for inner in _inner_optimizers(optimizer):
        if len(inner.state) > 0:
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.numel():
                    p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad()
    mark_applied(shim)


def use_fused_torch_adam(optimizer) -> bool:
    """After building the optimizer: torch AdamW's param groups -> its fused kernel where the
    `fused_torch_adam` guard holds and every parameter is a float tensor on one device type that
    torch's fused Adam takes. Before the first step only (the state it makes then lives on the
    parameters' device). True when switched."""
    shim = SHIMS_BY_NAME["fused_torch_adam"]
    if not (shim.needed_here() and _torch_adam_in_use()):
        return False
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    inners = [o for o in _inner_optimizers(optimizer) if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]
    params = [p for o in inners for g in o.param_groups for p in g["params"]]
    if not inners or any(len(o.state) for o in inners) or not params:
        return False
    supported = set(_get_fused_kernels_supported_devices())
    if any(p.device.type not in supported or not p.is_floating_point() for p in params):
        return False
    for o in inners:
        for group in o.param_groups:
            group["foreach"], group["fused"] = False, True
    mark_applied(shim)
    return True


def restore_adam_steps(optimizer) -> None:
    """After a dist-ckpt load: sets torch Adam's per-parameter 'step' from its param group's
    (the checkpoint's), so bias correction after a resume equals the uninterrupted run's.
    Skipped where the `adam_steps` guard does not hold."""
    shim = SHIMS_BY_NAME["adam_steps"]
    if not (shim.needed_here() and _torch_adam_in_use()):
        return
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                if p in inner.state and "step" in inner.state[p]:
                    # fused / capturable Adam keeps its step as float32 on the parameter's device
                    on_device = group.get("fused") or group.get("capturable")
                    inner.state[p]["step"] = (torch.tensor(float(group["step"]), dtype=torch.float32, device=p.device)
                                              if on_device else torch.tensor(float(group["step"])))
    mark_applied(shim)
