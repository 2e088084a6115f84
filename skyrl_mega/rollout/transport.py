"""WeightTransport: how the trainer's new weights reach every rollout engine.

One interface, one class per data path (the CPU shared-memory one is in cpu_transport.py;
NCCL broadcast and CUDA IPC implement the same three calls later, through vLLM's native
init_weight_transfer_engine / start_weight_update / update_weights / finish_weight_update):

    transport.start(version)          # engines paused (the transport's pause mode)
    for bucket in buckets:            # HF-named tensors, e.g. one expert-grouped bucket
        transport.send(bucket)        #   iterable of (name, tensor)
    report = transport.finish()       # engines loaded them, report `version`, resume

or `with transport.update(version) as send: send(bucket) ...` which calls finish() on
success and abort() on an exception. `finish()` returns {server_url: [per-worker report]}
and raises WeightSyncError unless every worker of every engine reports `version`.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Iterable, Iterator, Tuple

NamedTensors = Iterable[Tuple[str, Any]]  # (HF parameter name, torch.Tensor)


class WeightTransport(abc.ABC):
    """Trainer side of one weight update to all engines; one update at a time."""

    @abc.abstractmethod
    def start(self, version: int | str) -> None:
        """Begins update `version`: prepares buffers and pauses generation as configured."""

    @abc.abstractmethod
    def send(self, named_tensors: NamedTensors) -> None:
        """Ships one bucket of HF-named tensors (may be called many times per update)."""

    @abc.abstractmethod
    def finish(self) -> dict[str, Any]:
        """Makes every engine load what was sent, checks the reported version, resumes."""

    def abort(self) -> None:
        """Drops a half-done update (default: nothing to clean up)."""

    @contextlib.contextmanager
    def update(self, version: int | str) -> Iterator:
        self.start(version)
        try:
            yield self.send
        except BaseException:
            self.abort()
            raise
        self.last_report = self.finish()
