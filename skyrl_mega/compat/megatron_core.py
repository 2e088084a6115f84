"""megatron-core shims: running on CPU (gloo), and the distributed optimizer's torch-Adam state.

In:  nothing at import (no side effects). `apply_cpu_shims()` once per process before a model is
     built; `apply_optimizer_shims()` before an optimizer is built;
     `ensure_optimizer_state(optimizer)` / `restore_adam_steps(optimizer)` around a dist-ckpt
     optimizer load.
Out: megatron-core runs forward / backward / optimizer / dist-ckpt on CPU with gloo, and a
     resumed torch Adam continues with the uninterrupted run's bias correction. Each shim is
     applied only where its guard holds (`SHIMS`: version range read from megatron-core's source,
     plus its run-time condition) and recorded in `skyrl_mega.compat.applied()`.

Version ranges were set from megatron-core 0.16.1 (installed here, identical to tag core_v0.16.1)
and 0.19 (branch core_r0.19.0, what the GPU machines run); "needed >=0.16.1" means the code that
makes it necessary is unchanged in 0.19.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

from .guard import Shim, mark_applied

_READ = "0.16.1, 0.19 (core_r0.19.0)"
_TEST = "tests/test_compat.py::"
_NO_CUDA = "torch.cuda.is_available() is False"
_TORCH_ADAM = "megatron's distributed optimizer uses torch Adam (distrib_optimizer.HAVE_APEX_OR_TE is False)"

SHIMS = (
    Shim("megatron_core", "cuda_stubs", "megatron-core", ">=0.16.1", _READ,
         "torch.cuda.current_device (the CPU device) / synchronize / Stream / Event / memory / RNG "
         "state that megatron calls unconditionally", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "te_general_gemm", "megatron-core", ">=0.16.1,<0.17", _READ,
         "moe_utils references te_general_gemm without defining it when transformer-engine is "
         "absent (0.17 sets it to None itself)", _TEST + "test_patch_behaviour",
         _NO_CUDA + " and moe_utils has no te_general_gemm"),
    Shim("megatron_core", "gloo_all_to_all", "megatron-core", ">=0.16.1", _READ,
         "the EP token dispatcher passes CPU tensors as all_to_all_single split sizes; gloo "
         "takes only python lists", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "gloo_uneven_all_gather", "megatron-core", ">=0.16.1", _READ,
         "with expert tensor parallelism the alltoall dispatcher all-gathers each TP rank's token "
         "count (output_split_sizes: uneven sizes); gloo's all_gather takes equal sizes only",
         _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "rng_tracker", "megatron-core", ">=0.16.1", _READ,
         "CudaRNGStatesTracker keeps CUDA generator states; on CPU it keeps CPU generator states "
         "(also for dist-ckpt's saved 'cuda' RNG states)", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "cuda_to_cpu_mode", "megatron-core", ">=0.16.1", _READ,
         "device='cuda' / integer devices / .cuda() in megatron map to CPU, and CPU float tensors "
         "report 'torch.cuda.FloatTensor' for the optimizer's type asserts",
         _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "optimizer_state", "megatron-core", ">=0.16.1", _READ,
         "a fresh torch Adam has no state; DistributedOptimizer.sharded_state_dict(is_loading) "
         "asserts one 'step' across its states", "tests/test_compat.py::test_optimizer_state_shims",
         _TORCH_ADAM),
    Shim("megatron_core", "adam_steps", "megatron-core", ">=0.16.1", _READ,
         "after a dist-ckpt load torch Adam's per-parameter 'step' is not the checkpoint's; it is "
         "reset from the param group's step", "tests/test_compat.py::test_optimizer_state_shims",
         _TORCH_ADAM),
    Shim("megatron_core", "foreach_grad_norm", "megatron-core", ">=0.16.1", _READ,
         "without apex / TE, clip_grads falls back to utils.local_multi_tensor_l2_norm, which builds "
         "a host tensor from every gradient's norm (one device sync per parameter tensor, ~1000 a "
         "step on a 64-expert model) and scales gradients one kernel per tensor; clip_grads' "
         "l2_norm_impl / multi_tensor_scale_impl become torch._foreach versions (no sync)",
         _TEST + "test_foreach_grad_norm_equals_megatron_local_norm",
         "clip_grads uses megatron's local fallbacks (no apex / TE)"),
    Shim("megatron_core", "fused_torch_adam", "megatron-core", ">=0.16.1", _READ,
         "without apex / TE, get_megatron_optimizer builds torch AdamW with its default multi-tensor "
         "(foreach) implementation: several passes over parameters, gradients and both moments a "
         "step; the param groups are switched to torch's fused kernel (one pass, same update)",
         _TEST + "test_fused_torch_adam_equals_float64_adam", _TORCH_ADAM),
    Shim("megatron_core", "gloo_cuda_grad_sync", "megatron-core", ">=0.16.1", _READ,
         "DDP's grad sync issues its all-reduces inside torch's _coalescing_manager, which ends in "
         "allreduce_coalesced: gloo has none for CUDA tensors; param_and_grad_buffer's manager issues "
         "each op as it is called instead (synchronous grad sync only)",
         _TEST + "test_gloo_cuda_grad_sync_issues_each_op", "SKYRL_DIST_BACKEND=gloo with CUDA"),
    Shim("megatron_core", "packed_gdn", "megatron-core", ">=0.16.1,<0.18", "0.16.1, 0.19.2",
         "GatedDeltaNet.forward raises NotImplementedError for packed (THD) sequences before 0.18; "
         "the spec builds megatron/gated_delta_net.PackedGatedDeltaNet, a subclass whose forward "
         "takes them", "tests/test_qwen3_5.py::test_packed_equals_unpacked_with_state_reset",
         "a packed (THD) micro-batch reaches a Gated DeltaNet layer"),
)
SHIMS_BY_NAME = {s.name: s for s in SHIMS}
# the CPU shims, in the order apply_cpu_shims applies them
CPU_SHIMS = ("cuda_stubs", "te_general_gemm", "gloo_all_to_all", "gloo_uneven_all_gather", "rng_tracker",
             "cuda_to_cpu_mode")

# megatron-core config for CPU: no fused kernels (they need CUDA, apex or TE) and CPU init
CPU_CONFIG = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
    moe_grouped_gemm=False,
    attention_backend="local",
)

_CPU_APPLIED: list[str] = []
_MODE: "CudaToCpuMode | None" = None


# --------------------------------------------------------------------------- rng_tracker
@functools.lru_cache(maxsize=None)
def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's named RNG states, kept as CPU generator states."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


def _rng_tracker() -> bool:
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = _cpu_tracker_class()
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, tracker_cls):
        mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # dist-ckpt saves / restores "cuda" RNG states through these two
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    return True


# --------------------------------------------------------------------------- cuda_stubs
class _CpuStream:
    def __init__(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _CpuEvent()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuEvent:
    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _cuda_stubs() -> bool:
    c = torch.cuda
    # a device object, not 0: allocations such as `torch.empty(..., device=current_device())`
    # also run in autograd's backward, where the TorchFunctionMode below is not active
    c.current_device = lambda: torch.device("cpu")
    c.synchronize = lambda *a, **k: None
    c.Stream = _CpuStream
    c.Event = _CpuEvent
    c.current_stream = lambda *a, **k: _CpuStream()
    c.default_stream = lambda *a, **k: _CpuStream()
    c.stream = lambda s=None: contextlib.nullcontext()
    c.set_device = lambda *a, **k: None
    c.memory_allocated = lambda *a, **k: 0
    c.max_memory_allocated = lambda *a, **k: 0
    c.memory_reserved = lambda *a, **k: 0
    c.empty_cache = lambda: None
    c.get_rng_state = lambda *a, **k: torch.get_rng_state()
    c.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    return True


# --------------------------------------------------------------------------- cuda_to_cpu_mode
def _is_cuda_device(dev) -> bool:
    if dev is None:
        return False
    if isinstance(dev, int):
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Runs code written for CUDA on CPU: cuda devices become cpu, `.cuda()` is identity."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            out = func(*args)
            return out.replace("torch.", "torch.cuda.", 1) if out.startswith("torch.") else out
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        return func(*args, **kwargs)


def _cuda_to_cpu_mode() -> bool:
    global _MODE
    if _MODE is None:
        _MODE = CudaToCpuMode()
        _MODE.__enter__()
    return True


# --------------------------------------------------------------------------- te_general_gemm
def _te_general_gemm() -> bool:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):  # transformer-engine imported: nothing to fix
        return False
    moe_utils.te_general_gemm = None
    return True


# --------------------------------------------------------------------------- gloo_all_to_all
def _gloo_all_to_all() -> bool:
    import torch.distributed as dist

    original = dist.all_to_all_single
    if getattr(original, "_skyrl_gloo_lists", False):
        return True

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    all_to_all_single._skyrl_gloo_lists = True
    # megatron calls it as torch.distributed.all_to_all_single (0.16.1 and 0.19: no module holds
    # its own reference), so replacing the attribute covers every call site
    dist.all_to_all_single = all_to_all_single
    return True


def _gloo_uneven_all_gather() -> bool:
    import torch.distributed as dist

    original = dist.all_gather
    if getattr(original, "_skyrl_uneven", False):
        return True

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        rows = [t.shape[0] if t.dim() else 0 for t in tensor_list]
        if async_op or tensor.dim() == 0 or len(set(rows)) <= 1:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        # uneven first dims: gather each rank's tensor padded to the longest, then trim
        longest = max(rows)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        full = [tensor.new_empty((longest, *tensor.shape[1:])) for _ in tensor_list]
        work = original(full, padded, group=group)
        for out, got, n in zip(tensor_list, full, rows):
            out.copy_(got[:n])
        return work

    all_gather._skyrl_uneven = True
    # megatron calls it as torch.distributed.all_gather (mappings._gather_along_first_dim)
    dist.all_gather = all_gather
    return True


_CPU_STEPS = {"cuda_stubs": _cuda_stubs, "te_general_gemm": _te_general_gemm,
              "gloo_all_to_all": _gloo_all_to_all, "gloo_uneven_all_gather": _gloo_uneven_all_gather,
              "rng_tracker": _rng_tracker,
              "cuda_to_cpu_mode": _cuda_to_cpu_mode}


def apply_cpu_shims() -> list[str]:
    """Applies each CPU shim whose guard holds (no CUDA, megatron-core in its range); idempotent.
    Returns the names applied in this process (empty with CUDA)."""
    if torch.cuda.is_available():
        return list(_CPU_APPLIED)
    for name in CPU_SHIMS:
        shim = SHIMS_BY_NAME[name]
        if name in _CPU_APPLIED or not shim.needed_here():
            continue
        if _CPU_STEPS[name]():
            _CPU_APPLIED.append(name)
            mark_applied(shim)
    return list(_CPU_APPLIED)


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
