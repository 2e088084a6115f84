"""What a conversion reports on rank 0's stderr: progress lines and every rank's peak memory.

In:  the totals (tensors, bytes) and each step's done counts; /proc/self/status (VmHWM, VmRSS).
Out: `[convert] 12/40 tensors, 1.20/4.00 GiB (30%), 210 MiB/s` at most every `every` seconds and
     at the end; `peak_rss()` / `rss()` in bytes; `report_peak` (collective) one line with each
     rank's peak resident memory.
"""

from __future__ import annotations

import sys
import time

GIB = 1 << 30


def _status(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    return _status("VmHWM")


def rss() -> int:
    return _status("VmRSS")


class Progress:
    def __init__(self, what: str, tensors: int, nbytes: int, show: bool, every: float = 2.0, stream=None):
        self.what, self.total, self.total_bytes, self.show, self.every = what, tensors, nbytes, show, every
        self.stream = stream or sys.stderr
        self.done = self.done_bytes = 0
        self.start = self.last = time.monotonic()

    def add(self, tensors: int, nbytes: int) -> None:
        self.done += tensors
        self.done_bytes += nbytes
        if time.monotonic() - self.last >= self.every:
            self.line()

    def line(self) -> None:
        self.last = time.monotonic()
        if not self.show:
            return
        rate = self.done_bytes / max(self.last - self.start, 1e-9) / (1 << 20)
        pct = 100 * self.done_bytes / max(self.total_bytes, 1)
        print(f"[convert] {self.what}: {self.done}/{self.total} tensors, {self.done_bytes / GIB:.2f}/"
              f"{self.total_bytes / GIB:.2f} GiB ({pct:.0f}%), {rate:.0f} MiB/s", file=self.stream, flush=True)


def report_peak(before: int) -> None:
    """Collective: rank 0 prints every rank's peak RSS (and its RSS before converting)."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor([peak_rss(), before], dtype=torch.int64)
    parts = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    if dist.get_rank() == 0:
        shown = ", ".join(f"rank {r} {int(p[0]) / GIB:.2f} GiB (before {int(p[1]) / GIB:.2f})"
                          for r, p in enumerate(parts))
        print(f"[convert] peak RSS: {shown}", file=sys.stderr, flush=True)
