"""megatron-core on CPU (gloo): the CPU shims of the registry in __init__.py.

In:  `apply_cpu_shims()` once per process before a model is built (megatron/parallel.py).
Out: megatron-core runs forward / backward / optimizer / dist-ckpt on CPU with gloo: CUDA calls
     answered on CPU, CUDA RNG states kept as CPU generator states, cuda devices mapped to CPU,
     gloo's collective limits worked around. Without CUDA only; each shim where its guard holds.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

from ..guard import mark_applied
from . import CPU_SHIMS, SHIMS_BY_NAME

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
