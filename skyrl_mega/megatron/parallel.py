"""Process groups for Megatron ranks.

In: the ParallelConfig and torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).
Out: torch.distributed initialised (NCCL with CUDA, gloo without), megatron-core's
TP/PP/CP/EP/ETP groups, and seeded RNG trackers. Without CUDA megatron-core's CPU shims
(skyrl_mega/compat/megatron_core/cpu.py) are applied first.

SKYRL_DIST_BACKEND=gloo with CUDA: the ranks talk through gloo (host copies, slow) and share the
GPUs round-robin (LOCAL_RANK % GPUs), so a layout of more ranks than GPUs runs on one GPU for
checking its numerics (NCCL refuses two ranks on one GPU). Not for speed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..compat import megatron_core as mcore_compat
from ..compat import torch_distributed as torch_dist_compat
from ..ports import free_port


def init_distributed(timeout_minutes: int = 10) -> tuple[int, int]:
    """Initialises the default process group from torchrun's env (or a 1-rank group)."""
    mcore_compat.apply_cpu_shims()  # a no-op with CUDA
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    backend = dist_backend()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count() if backend == "gloo" else local)
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))
    if backend == "gloo" and torch.cuda.is_available():
        mcore_compat.apply_gloo_cuda_shims()  # gloo has no coalesced all-reduce for CUDA tensors
        torch_dist_compat.apply_gloo_cuda_broadcast()  # gloo's CUDA broadcast into a leaf parameter
    return dist.get_rank(), dist.get_world_size()


def dist_backend() -> str:
    """nccl with CUDA, gloo without; SKYRL_DIST_BACKEND (nccl | gloo) overrides it with CUDA."""
    from ..config.validate import ConfigError, dist_backend_problems

    problems = dist_backend_problems()  # also checked by validate_config before any rank starts
    if problems:
        raise ConfigError(problems[0])
    if not torch.cuda.is_available():
        return "gloo"
    return os.environ.get("SKYRL_DIST_BACKEND", "").strip().lower() or "nccl"


def init_model_parallel(parallel, seed: int = 1234) -> None:
    """megatron-core parallel groups from a ParallelConfig, then the model-parallel seeds."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp if parallel.etp is not None else parallel.tp,
        create_gloo_process_groups=False,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def init_layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int | None = None,
                seed: int = 1234) -> tuple[int, int]:
    """init_distributed + init_model_parallel for a layout given by its sizes (tests, benches)."""
    from types import SimpleNamespace

    rank, world = init_distributed()
    init_model_parallel(SimpleNamespace(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp), seed=seed)
    return rank, world


def destroy() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
