"""CPU compatibility layer for megatron-core: the one place where version and device shims live.

In: nothing (call `apply_cpu_compat()` once per process, before building a model).
Out: megatron-core 0.16+ runs forward/backward/optimizer on CPU with gloo. Every patch is a
no-op when CUDA is available, idempotent, and listed in `APPLIED` so tests can check each one.

Patches (why each exists is measured in DESIGN.md):
- rng_tracker: megatron's RNG tracker stores CUDA generator states; on CPU it tracks CPU states.
- cuda_stubs: torch.cuda.current_device (returns the CPU device) / synchronize / Stream /
  Event / memory queries / RNG state.
- cuda_to_cpu_mode: a TorchFunctionMode that maps device="cuda" (and integer devices) to CPU,
  makes `.cuda()` a no-op, and reports CPU float tensors as 'torch.cuda.FloatTensor' for the
  optimizer's type asserts.
- te_general_gemm: megatron 0.15/0.16 reference `moe_utils.te_general_gemm` without TE.
- gloo_all_to_all: gloo's all_to_all_single needs python-list split sizes (EP alltoall).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.overrides import TorchFunctionMode

APPLIED: list[str] = []
_MODE: "CudaToCpuMode | None" = None


def cuda_available() -> bool:
    return torch.cuda.is_available()


# --------------------------------------------------------------------------- rng tracker
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


def _patch_rng_tracker():
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = _cpu_tracker_class()
    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, tracker_cls):
        mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # checkpoint/restore of "cuda" RNG states (dist-ckpt saves them) map to the CPU generator
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


# --------------------------------------------------------------------------- cuda stubs
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


def _patch_cuda_stubs():
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


# --------------------------------------------------------------------------- device mode
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
        dev = kwargs.get("device")
        if _is_cuda_device(dev):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            out = func(*args)
            return out.replace("torch.", "torch.cuda.", 1) if out.startswith("torch.") else out
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda_device(a) and not isinstance(a, int) else a for a in args)
        return func(*args, **kwargs)


def _enter_device_mode():
    global _MODE
    if _MODE is None:
        _MODE = CudaToCpuMode()
        _MODE.__enter__()


# --------------------------------------------------------------------------- megatron internals
def _patch_te_general_gemm():
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _patch_gloo_all_to_all():
    """gloo's all_to_all_single rejects tensor split sizes; hand it python lists."""
    import torch.distributed as dist

    original = dist.all_to_all_single
    if getattr(original, "_skyrl_gloo_lists", False):
        return

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *a, **k):
        if isinstance(output_split_sizes, torch.Tensor):
            output_split_sizes = output_split_sizes.tolist()
        if isinstance(input_split_sizes, torch.Tensor):
            input_split_sizes = input_split_sizes.tolist()
        return original(output, input, output_split_sizes, input_split_sizes, *a, **k)

    all_to_all_single._skyrl_gloo_lists = True
    dist.all_to_all_single = all_to_all_single
    # megatron's tensor_parallel.mappings imported the function object directly
    from megatron.core.tensor_parallel import mappings

    if hasattr(mappings, "all_to_all_single"):
        mappings.all_to_all_single = all_to_all_single


def apply_cpu_compat(force: bool = False) -> list[str]:
    """Applies every CPU patch when CUDA is absent (or `force`). Returns the applied names."""
    if cuda_available() and not force:
        return APPLIED
    steps = [
        ("cuda_stubs", _patch_cuda_stubs),
        ("te_general_gemm", _patch_te_general_gemm),
        ("gloo_all_to_all", _patch_gloo_all_to_all),
        ("rng_tracker", _patch_rng_tracker),
        ("cuda_to_cpu_mode", _enter_device_mode),
    ]
    for name, fn in steps:
        if name not in APPLIED:
            fn()
            APPLIED.append(name)
    return APPLIED
