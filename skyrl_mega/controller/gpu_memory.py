"""GPU memory per phase, on the controller's GPU (rank 0): what a phase freed or took, and the
trainer's peak.

In: a phase name and the code of the phase. Out: metrics in GiB, e.g. for "engine/sleep"
`engine/sleep_freed_gib` (device-wide free memory after minus before: what a sleeping engine
gave back, counting every process on the GPU) and `time/engine/sleep_s`; for a trainer phase
`mem/<phase>_trainer_peak_gib` (torch's peak in this process) and `mem/<phase>_device_used_gib`
(device-wide, every process, at the phase's end). On CPU only the times are reported.
"""

from __future__ import annotations

import contextlib
import time

import torch

GIB = float(1 << 30)


def _free_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@contextlib.contextmanager
def freed(name: str):
    """Yields a dict that holds `<name>_freed_gib` and `time/<name>_s` once the block ran."""
    out: dict = {}
    before, t0 = _free_bytes(), time.perf_counter()
    yield out
    after = _free_bytes()
    out[f"time/{name}_s"] = time.perf_counter() - t0
    if before is not None and after is not None:
        out[f"{name}_freed_gib"] = (after - before) / GIB


@contextlib.contextmanager
def phase(name: str):
    """Yields a dict that holds the trainer's peak and the device's use during/after the block."""
    out: dict = {}
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    yield out
    if cuda:
        free, total = torch.cuda.mem_get_info()
        out[f"mem/{name}_trainer_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        out[f"mem/{name}_device_used_gib"] = (total - free) / GIB
