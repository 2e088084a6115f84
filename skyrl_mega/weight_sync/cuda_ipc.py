"""CUDA IPC transport: trainer -> co-located engines on the same GPU (zero-copy where possible).

Data path: rank 0's HF tensors that are plain views of its own parameters ("direct": no TP/EP
gather and no conversion copy needed, e.g. everything at world size 1) are NOT packed: the
engine opens a CUDA IPC handle of the parameter storage (with megatron's distributed-optimizer
DDP that is one contiguous param buffer) and copies each tensor straight into its own weights:
one device-to-device copy per byte. Tensors that need a gather or a conversion (TP merges,
other EP ranks' experts, the q/k/v split) are packed by the exporter into ONE staging buffer
of about one bucket (`staging_bytes`, default the plan's bucket size or its largest bucket),
so peak extra memory stays near one bucket whatever the model size. Buckets accumulate into
the staging buffer until the next one does not fit; then a "round" goes out: one
update_weights call whose JSON names every tensor as (handle index, byte offset, dtype,
shape) plus the IPC handles (torch's CUDA IPC reduction, which also carries an event the
consumer waits on). The consumer answers after its copies finished (device synchronised), so
the staging buffer is reused only then. finish_weight_update(version) commits.
On CPU (tests and dry runs) the staging buffer is a /dev/shm file and nothing is direct.
Verification: the sender's checksums ride in each round; the receiver compares them with
checksums of what landed in its weights and fails the update on any mismatch.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..rollout.errors import WeightSyncError
from . import ipc_handles
from .base import BucketTransport
from .checksum import buffer_checksums, digest, tensor_checksum
from .plan import ALIGN, BucketPlan, BucketSpec

logger = logging.getLogger(__name__)


class CudaIpcTransport(BucketTransport):
    """Co-located engines: IPC handles to parameter storage + one staging buffer (see module doc)."""

    def __init__(self, control=None, receivers=(), *, zero_copy: bool | None = None,
                 staging_bytes: int | None = None, **kw):
        super().__init__(control, receivers, **kw)
        self.zero_copy = (self.device.type == "cuda") if zero_copy is None else bool(zero_copy)
        if self.zero_copy and self.device.type != "cuda":
            raise ValueError("zero-copy IPC needs CUDA (CPU tensors are not shareable in place)")
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._shm_path: str | None = None
        self._inited = False
        self.rounds = 0
        self.last_digest: str | None = None

    @property
    def layout(self) -> str:
        return "ipc" if self.zero_copy else "full"

    def init(self) -> None:
        if self._inited:
            return
        self._open_store()
        info = {"mode": "ipc", "device": str(self.device)}
        if self.device.type == "cuda":
            info["device_uuid"] = str(torch.cuda.get_device_properties(self.device).uuid)
        off = 0
        for c in self.clients:
            c.init(info, off)
            off += c.num_ranks()
        self._inited = True

    def _ensure_staging(self, plan: BucketPlan) -> None:
        need = max(self.staging_bytes or plan.bucket_bytes, max((self._nbytes(b) for b in plan.buckets), default=0))
        if self._staging is not None and self._staging.numel() >= need:
            return
        self._free_staging()
        if self.device.type == "cuda":
            self._staging = torch.empty(need, dtype=torch.uint8, device=self.device)
        else:
            self._staging, self._shm_path = ipc_handles.shm_buffer(need)

    def _free_staging(self) -> None:
        import os

        self._staging = None
        if self._shm_path:
            try:
                os.unlink(self._shm_path)
            except OSError:
                pass
            self._shm_path = None

    def _nbytes(self, b: BucketSpec) -> int:
        return b.nbytes if self.layout == "full" else b.ipc_nbytes

    # -- one update --------------------------------------------------------------------------------------
    def start(self, version, plan: BucketPlan | None = None) -> None:
        if plan is None:
            raise WeightSyncError("CudaIpcTransport.start needs the BucketPlan (use sync_weights)")
        self.init()
        self._version, self._plan = version, plan
        self._ensure_staging(plan)
        self._cursor, self._base = 0, 0
        self._entries: list[list] = []
        self._sums: list[torch.Tensor] = []
        self._direct_keys: dict[int, int] = {}
        self._direct_whole: list[torch.Tensor] = []
        self._round = 0
        self._next = 0
        self._sent_sums: dict[int, list[int]] = {}
        self._t_start = time.perf_counter()
        self.timings = {}
        self._pause()
        self._fanout(lambda c: c.start())
        self._touched = True

    def acquire(self, bucket: BucketSpec, nbytes: int) -> torch.Tensor:
        if self._cursor + nbytes > self._staging.numel():
            self._flush(last=False)
        self._base = self._cursor
        self._cursor += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return self._staging[self._base: self._base + nbytes]

    def send_bucket(self, b: BucketSpec, buf: torch.Tensor | None, direct=()) -> None:
        if self.fail_at_bucket is not None and b.index == self.fail_at_bucket:
            raise WeightSyncError(f"injected failure before bucket {b.index}")
        if b.index != self._next:
            raise WeightSyncError(f"bucket {b.index} sent out of order (expected {self._next})")
        base = self._base if buf is not None else 0
        packed = [t for t in b.tensors if not (self.layout == "ipc" and t.direct)]
        spans = []
        for t in packed:
            off = base + (t.offset if self.layout == "full" else t.ipc_offset)
            self._entries.append([t.name, t.dtype, list(t.shape), 0, off, t.nbytes, t.index])
            spans.append((off, t.nbytes))
        if self.verify and spans:
            self._sums.append(buffer_checksums(self._staging, spans))
        for t, src in direct:
            whole, off = ipc_handles.storage_bytes(src)
            key = whole.data_ptr()
            if key not in self._direct_keys:
                self._direct_keys[key] = len(self._direct_whole) + 1  # handle 0 is the staging buffer
                self._direct_whole.append(whole)
            self._entries.append([t.name, t.dtype, list(t.shape), self._direct_keys[key], off, t.nbytes, t.index])
            if self.verify:
                self._sums.append(tensor_checksum(src)[None])
        if self.corrupt_bucket is not None and b.index == self.corrupt_bucket and spans:
            o = spans[0][0]
            self._staging[o: o + 1].bitwise_xor_(0x5A)
        self._next += 1

    def _flush(self, last: bool) -> None:
        if not self._entries and not last:
            return
        t0 = time.perf_counter()
        handles = [ipc_handles.encode(self._staging, self._shm_path)]
        handles += [ipc_handles.encode(w) for w in self._direct_whole]
        info: dict[str, Any] = {"mode": "ipc", "version": self._version, "round": self._round, "last": last,
                                "verify": self.verify, "handles": handles, "tensors": self._entries}
        if self.verify:
            info["checksums"] = torch.cat(self._sums).cpu().tolist() if self._sums else []
            self._sent_sums.update({e[6]: row for e, row in zip(self._entries, info["checksums"])})
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self._fanout(lambda c: c.update(info))
        self._entries, self._sums = [], []
        self._direct_keys, self._direct_whole = {}, []
        self._cursor = 0
        self._round += 1
        self.rounds += 1
        self.timings["rounds"] = self._round
        self.timings["round_s"] = self.timings.get("round_s", 0.0) + time.perf_counter() - t0

    def finish(self) -> dict[str, Any]:
        if self._next != len(self._plan.buckets):
            raise WeightSyncError(f"update {self._version}: {self._next}/{len(self._plan.buckets)} buckets sent")
        self._flush(last=True)
        self.timings["transfer_s"] = time.perf_counter() - self._t_start
        report = self._commit(self._version)
        self.last_digest = (digest(torch.tensor([self._sent_sums[k] for k in sorted(self._sent_sums)],
                                                dtype=torch.int64)) if self.verify else None)
        self.last_report = report
        return report

    def abort(self) -> None:
        """Rounds already delivered stay loaded: engines stay paused on their old version."""
        self._entries, self._sums = [], []
        self._direct_keys, self._direct_whole = {}, []
        self._leave_paused()

    @property
    def _data_done(self) -> bool:
        return True

    def close(self) -> None:
        super().close()
        self._free_staging()
