"""A small pool of reusable uint8 buffers, each handed out again only after the work using it ended.

In: byte counts (`acquire`) and the asynchronous operations that read a handed-out buffer
(`fence`: a broadcast, a point-to-point send). Out: buffers of at least that size on one
device. The NCCL transport packs bucket k+1 into one slot while bucket k is on the wire from
the other; a pipeline stage leader keeps its finished bucket in one while it is sent to rank 0.
"""

from __future__ import annotations

import torch


class SlotPool:
    """`n` reusable uint8 buffers; a buffer is handed out again only after the work fenced on it ended.
    `wait(work)`: how to wait for a fenced work (default: work.wait())."""

    def __init__(self, device, n: int = 2, wait=None):
        self.device = torch.device(device)
        self.n = n
        self._wait = wait or (lambda w: w.wait())
        self.bufs: list[torch.Tensor | None] = [None] * n
        self.pending: list[list] = [[] for _ in range(n)]
        self.next = 0
        self.last = -1

    def acquire(self, nbytes: int) -> torch.Tensor:
        i = self.next
        self.next = (i + 1) % self.n
        for w in self.pending[i]:
            self._wait(w)
        self.pending[i] = []
        if self.bufs[i] is None or self.bufs[i].numel() < nbytes:
            self.bufs[i] = None
            self.bufs[i] = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.last = i
        return self.bufs[i][:nbytes]

    def fence(self, work) -> None:
        """`work` (has .wait()) uses the buffer handed out last."""
        if work is not None and self.last >= 0:
            self.pending[self.last].append(work)

    def busy(self) -> bool:
        """Is a fenced work still pending (not waited for, not completed)?"""
        return any(not w.is_completed() for ws in self.pending for w in ws)

    def drain(self) -> None:
        for i in range(self.n):
            for w in self.pending[i]:
                self._wait(w)
            self.pending[i] = []

    def release(self) -> None:
        self.drain()
        self.bufs = [None] * self.n
