"""WeightTransport: how the trainer's buckets reach every rollout engine. One interface, every transport.

sync_weights() (sync.py) drives any transport with the same calls, on trainer rank 0:

    transport.start(version, plan)          begin update `version` of `plan` (engines paused)
    buf = transport.acquire(bucket, n)      where the exporter packs bucket `bucket` (n bytes)
    transport.send_bucket(bucket, buf, direct)   ship it (`direct`: tensors left in the sender's
                                            parameters, layout "ipc" only)
    report = transport.finish()             engines load everything, report `version`, resume
    transport.abort()                       after a failure: engines keep their old version
    transport.reset()                       an engine was restarted: forget what it held
    transport.close()

`layout` says how the exporter fills the buffers ("full": every tensor packed at its plan
offset; "ipc": direct tensors stay in place, the rest packed at their compact IPC offsets);
`bucket_first` is the bucket kind the transport wants sent first (None: keep the plan's).
`timings` (seconds per phase) and `last_report` are read after each update.

Implementations: shm.SharedMemoryTransport (CPU engines: safetensors in /dev/shm + reload),
nccl.NcclBroadcastTransport (disaggregated: NCCL broadcast, gloo on CPU) and
cuda_ipc.CudaIpcTransport (co-located: CUDA IPC handles, /dev/shm files on CPU); the last two
share transfer_api.WeightTransferTransport (vLLM's native weight-transfer calls).
"""

from __future__ import annotations

import abc
from typing import Any

import torch

from ..plan import BucketPlan, BucketSpec


class WeightTransport(abc.ABC):
    """Trainer side of one weight update to all engines; one update at a time."""

    layout: str = "full"
    bucket_first: str | None = None

    def __init__(self):
        self.timings: dict[str, float] = {}
        self.last_report: Any = None

    @abc.abstractmethod
    def start(self, version: int | str, plan: BucketPlan | None = None) -> None:
        """Begins update `version` of `plan`: prepares buffers and pauses generation as configured."""

    @abc.abstractmethod
    def acquire(self, bucket: BucketSpec, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of `nbytes` for the exporter to pack `bucket` into."""

    @abc.abstractmethod
    def send_bucket(self, bucket: BucketSpec, buf: torch.Tensor | None, direct=()) -> None:
        """Ships one packed bucket (buckets come in plan order, each once)."""

    @abc.abstractmethod
    def finish(self) -> dict[str, Any]:
        """Makes every engine load what was sent, checks the reported version, resumes."""

    def abort(self) -> None:
        """Drops a half-done update (default: nothing to clean up)."""

    def reset(self) -> None:
        """An engine was restarted: forget what the engines held (default: nothing held)."""

    def close(self) -> None:
        """Releases connections and buffers (default: none)."""
