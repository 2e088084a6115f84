"""CUDA IPC transport: trainer -> co-located engines on the same GPU (zero-copy where possible).

Data path: rank 0's HF tensors that are plain views of its own parameters ("direct": no TP/EP
gather and no conversion copy needed, e.g. everything at world size 1) are NOT packed: the
engine opens a CUDA IPC handle of the parameter storage (with megatron's distributed-optimizer
DDP that is one contiguous param buffer) and copies each tensor straight into its own weights:
one device-to-device copy per byte. Tensors that need a gather or a conversion (TP merges,
other EP ranks' experts, the q/k/v split) are packed by the exporter into ONE staging buffer
of about one bucket (`acquire`; `staging_bytes`, default the plan's bucket size or its
largest bucket), so peak extra memory stays near one bucket whatever the model size.
send_bucket adds each bucket to a "round" (`_seal`, with its checksums when verifying); the
round goes out (`_ship`) when it holds `round_bytes` (default: no limit), where the expert
buckets end (the dense ones after them cost the CPU conversions, which then overlap the
engine's copies) or when the next bucket does not fit the staging buffer: one update_weights
call whose JSON names every tensor as (handle index, byte offset, dtype, shape) plus the IPC
handles (typed JSON of torch's CUDA IPC reduction, ipc_handles.py: no pickle) and a CUDA IPC
event recorded after the sender's work for the round: the engine's stream waits on it, so
neither side blocks its CPU on the other's GPU work. Rounds are posted from a background
thread, in order, so the engine copies round k while the trainer walks the buckets of round
k+1. A round that used the staging buffer is answered only after the engine's copies finished
(device synchronised; "sync": true), and the staging buffer is refilled only after every such
answer came back. The last round goes out from finish(), once every rank's check of the plan
passed, and carries the commit: one call per engine does the copies and finish_weight_update
(version), answered only after every copy finished (any finish, an abort's too: the trainer may
then change its parameters and the staging buffer).
Steady state: the exporter hands out cached direct tensors (plan.DirectRefs) and the round's
tensor table is named by its id, so nothing walks the tensors before a round leaves.
On CPU (tests and dry runs) the staging buffer is a /dev/shm file and nothing is direct.
Verification: the sender's checksums ride in each round; the receiver compares them with
checksums of what landed in its weights and fails the update on any mismatch.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...rollout.errors import WeightSyncError
from .. import ipc_handles
from ..checksum import buffer_checksums, digest, tensor_checksum
from ..plan import ALIGN, BucketPlan, BucketSpec, DirectRefs, direct_view
from .transfer_api import WeightTransferTransport, engine_got_at, engine_spans, worker_replies

logger = logging.getLogger(__name__)


def _refs_sig(refs) -> tuple:
    """What a round's layout depends on for one bucket's direct tensors: the exporter's key for
    its cached DirectRefs (nothing touched), else every tensor's address."""
    key = getattr(refs, "key", None)
    return key if key is not None else tuple(p.data_ptr() for p, _ in refs)


class CudaIpcTransport(WeightTransferTransport):
    """Co-located engines: IPC handles to parameter storage + one staging buffer (see module doc)."""

    def __init__(self, control=None, receivers=(), *, zero_copy: bool | None = None,
                 staging_bytes: int | None = None, round_bytes: int | None = None, receive: str = "auto",
                 channel: bool = True, **kw):
        # channel: the rounds go to each engine worker's own listener (clients.HttpEngineClient)
        super().__init__(control, receivers, channel=channel, **kw)
        self.round_bytes = int(round_bytes) if round_bytes else 1 << 62  # None: no size limit
        self.receive = receive  # the engines' way in: "auto" (direct copies once learned) | "reload"
        self._exe = ThreadPoolExecutor(max_workers=1)  # posts rounds in order
        self._inflight: list = []  # futures of posted rounds
        self._acc = 0  # bytes in the round being assembled
        self._event = None  # CUDA IPC event recorded before each round (see _flush)
        self._event_handle: str | None = None
        self.zero_copy = (self.device.type == "cuda") if zero_copy is None else bool(zero_copy)
        if self.zero_copy and self.device.type != "cuda":
            raise ValueError("zero-copy IPC needs CUDA (CPU tensors are not shareable in place)")
        self.staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._shm_path: str | None = None
        self._inited = False
        self.rounds = 0
        self.last_digest: str | None = None
        self._layout_plan = None
        self._handles: dict = {}  # (address, bytes) of a shared storage -> its IPC handle (_handle)

    @property
    def layout(self) -> str:
        return "ipc" if self.zero_copy else "full"

    bucket_first = "experts"  # zero-copy expert buckets: the engine starts copying them at once

    def init(self) -> None:
        if self._inited:
            return
        self._open_store()
        info = {"mode": "ipc", "device": str(self.device), "receive": self.receive}
        if self.device.type == "cuda":
            info["device_uuid"] = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", ""))
        off = 0
        for c in self.clients:
            c.init(info, off)
            off += c.num_ranks()
        self._inited = True
        self._layout_plan = None  # (re)joined receivers hold no layouts

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
        self._handles = {}
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
        if getattr(self, "_layout_plan", None) != plan.plan_id:
            self._layouts: dict[int, tuple] = {}  # round -> (signature, layout id, storages)
            self._locs: dict = {}  # (id(param), data_ptr) -> (storage key, byte offset, storage bytes)
            self._packed_of: dict[int, list] = {}
            self._handles = {}
            self._layout_plan = plan.plan_id
        self._cursor, self._base = 0, 0
        self._round_items: list[tuple] = []  # per bucket: (bucket, staging base, direct refs)
        self._sums: list[torch.Tensor] = []
        self._round = 0
        self._next = 0
        self._acc = 0
        self._inflight = []
        self._sent_sums: dict[int, list[int]] = {}
        self._t_start = time.perf_counter()
        self._t_start_mono = time.monotonic()  # the engines' timestamps are on this clock
        self.timings = {}
        self._pause()
        self._inflight.append(self._exe.submit(self._fanout, lambda c: c.start()))  # rounds follow in order
        self._touched = True

    def acquire(self, bucket: BucketSpec, nbytes: int) -> torch.Tensor:
        if self._cursor + nbytes > self._staging.numel():
            self._flush(last=False)
            self._drain()  # every round that read the staging buffer has finished copying
            self._cursor = 0
        self._base = self._cursor
        self._cursor += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return self._staging[self._base: self._base + nbytes]

    def _packed(self, b: BucketSpec) -> list:
        p = self._packed_of.get(b.index)
        if p is None:
            ipc = self.layout == "ipc"
            p = self._packed_of[b.index] = [t for t in b.tensors if not (ipc and t.direct)]
        return p

    def _loc(self, p: torch.Tensor):
        key = (id(p), p.data_ptr())
        loc = self._locs.get(key)
        if loc is None:
            whole, off = ipc_handles.storage_bytes(p)
            loc = self._locs[key] = (whole.data_ptr(), off, whole)
        return loc

    def _seal(self, b: BucketSpec, buf: torch.Tensor | None, direct) -> None:
        """The bucket joins the round being assembled, with its checksums when verifying."""
        if b.index != self._next:
            raise WeightSyncError(f"bucket {b.index} sent out of order (expected {self._next})")
        base = self._base if buf is not None else 0
        packed = self._packed(b)
        self._round_items.append((b, base, direct if isinstance(direct, DirectRefs) else list(direct)))
        if self.verify:
            full = self.layout == "full"
            spans = [(base + (t.offset if full else t.ipc_offset), t.nbytes) for t in packed]
            if spans:
                self._sums.append(buffer_checksums(self._staging, spans))
            for p, slots in direct:
                for t, intra in slots:
                    self._sums.append(tensor_checksum(direct_view(p, t, intra))[None])

    def _ship(self, b: BucketSpec, buf: torch.Tensor | None, direct) -> None:
        """The round goes out when it is full or where the expert buckets end; the last one from finish()."""
        self._next += 1
        self._acc += b.nbytes
        self._check_inflight()
        nxt = self._plan.buckets[self._next] if self._next < len(self._plan.buckets) else None
        if nxt is None:
            # the last round goes out with the commit, from finish(): only once every rank's
            # check of the plan passed (the exporter sweeps while the engines copy the expert round)
            return
        # a round also ends where the expert buckets end: the engine copies them while the
        # dense buckets (per-parameter conversions on the CPU) are walked
        if self._acc >= self.round_bytes or (b.kind == "experts" and nxt.kind != "experts"):
            self._flush(last=False)

    def _check_inflight(self) -> None:
        while self._inflight and self._inflight[0].done():
            self._inflight.pop(0).result()  # raises the engine's error

    def _drain(self) -> list:
        futs, self._inflight = self._inflight, []
        return [f.result() for f in futs]
    def _entries(self, storages: dict) -> list[list]:
        """The round's tensor table: [name, dtype, shape, handle index, byte offset, nbytes, index]."""
        out, full = [], self.layout == "full"
        for b, base, refs in self._round_items:
            for t in self._packed(b):
                out.append([t.name, t.dtype, list(t.shape), 0, base + (t.offset if full else t.ipc_offset),
                            t.nbytes, t.index])
            for p, slots in refs:
                skey, poff, whole = self._loc(p)
                if skey not in storages:
                    storages[skey] = (len(storages) + 1, whole)  # handle 0 is the staging buffer
                h = storages[skey][0]
                for t, intra in slots:
                    out.append([t.name, t.dtype, list(t.shape), h, poff + intra, t.nbytes, t.index])
        return out

    def _flush(self, last: bool, commit: bool = False) -> None:
        if not self._round_items and not last:
            return
        t0 = time.perf_counter()
        # the layout (tensor table) is sent once and then named by its id, as long as the plan,
        # the packing and the parameters' addresses are unchanged
        sig = (self._plan.plan_id, tuple((b.index, base) for b, base, _ in self._round_items),
               tuple(map(_refs_sig, (refs for _, _, refs in self._round_items))))
        cached = self._layouts.get(self._round)
        entries = None
        if cached is not None and cached[0] == sig:
            layout_id, wholes = cached[1], cached[2]
        else:
            storages: dict = {}
            entries = self._entries(storages)
            wholes = [w for _, w in sorted(storages.values(), key=lambda x: x[0])]
            layout_id = f"{self._plan.plan_id}.{self._round}.{self.rounds}"
            self._layouts[self._round] = (sig, layout_id, wholes)
        handles = [self._handle(self._staging)] + [self._handle(w) for w in wholes]
        info: dict[str, Any] = {"mode": "ipc", "version": self._version, "round": self._round, "last": last,
                                "verify": self.verify, "layout_id": layout_id, "handles": handles,
                                "tensors": entries}
        if self.verify:
            info["checksums"] = torch.cat(self._sums).cpu().tolist() if self._sums else []
            self._record_sent(info["checksums"])
        elif self.device.type == "cuda":
            # the engine's stream waits for our pending work (packing, the optimizer step) on the
            # GPU: no CPU synchronisation here
            if self._event is None:
                self._event = torch.cuda.Event(interprocess=True)
            self._event.record(torch.cuda.current_stream(self.device))
            info["event"] = self._event_handle = self._event_handle or ipc_handles.encode_event(self._event)
        self.timings.setdefault("first_round_at_s", t0 - self._t_start)
        # answered only after the engine's copies when this sync refills the staging buffer
        # after this round, or when checksums are compared; the commit (finish) is always
        # answered after every copy (the trainer then changes its parameters again)
        info["sync"] = self.verify or (not last and self._uses_staging())
        try:
            # in order on one thread
            self._inflight.append(self._exe.submit(self._post_round, info, self._version if commit else None))
        except BaseException:
            self._layouts = {}  # a receiver may not hold the layout: send it in full next time
            raise
        self._round_items, self._sums = [], []
        self._acc = 0
        self._round += 1
        self.rounds += 1
        self.timings["rounds"] = self._round
        self.timings["round_s"] = self.timings.get("round_s", 0.0) + time.perf_counter() - t0

    def _handle(self, whole: torch.Tensor) -> dict:
        """The typed IPC handle of a whole storage, made once per allocation: the engines open
        each allocation once (by ipc_handles.handle_key) and ignore a new handle of it."""
        key = (whole.data_ptr(), whole.numel())
        got = self._handles.get(key)
        if got is None:
            # the storage is held with its handle: no other allocation can take its address
            # (and be sent under its handle) while the handle is cached
            got = self._handles[key] = (whole, ipc_handles.encode(whole, self._shm_path if whole is self._staging
                                                                  else None))
        return got[1]

    def _post_round(self, info: dict, commit=None) -> list:
        """One round to every engine; with `commit` (a version) the update's commit rides on it."""
        # the first round's way to the engines, step by step: first_round_at_s (the main thread
        # flushed it), first_round_sending_at_s (this thread took it), engine_first_got_at_s (a
        # worker's listener had it), engine_first_in_at_s (the worker's call began)
        self.timings.setdefault("first_round_sending_at_s", time.perf_counter() - self._t_start)
        if commit is None:
            out = self._fanout(lambda c: c.update(info))
        else:
            out = self._fanout(lambda c: c.update_and_finish(info, commit))
        at = time.perf_counter() - self._t_start  # metrics are scalars: the first and the last answer
        self.timings.setdefault("first_answer_at_s", at)
        self.timings["last_answer_at_s"] = at
        # 1.0 when every worker took the round on its own listener (rollout/worker_channel.py)
        workers = list(worker_replies(out))
        self.timings["via_channel"] = float(bool(workers) and all(w.get("via") == "channel" for w in workers))
        spans = engine_spans(out)  # when the round reached the engines' workers and left them
        if spans:
            self.timings.setdefault("engine_first_in_at_s", min(a for a, _ in spans) - self._t_start_mono)
            self.timings["engine_last_out_at_s"] = max(b for _, b in spans) - self._t_start_mono
        got = engine_got_at(out)
        if got is not None:
            self.timings.setdefault("engine_first_got_at_s", got - self._t_start_mono)
        return out

    def _uses_staging(self) -> bool:
        return any(self._packed(b) for b, _, _ in self._round_items)

    def _record_sent(self, rows: list) -> None:
        order = []
        for b, _, refs in self._round_items:
            order += [t.index for t in self._packed(b)]
            order += [t.index for _, slots in refs for t, _ in slots]
        self._sent_sums.update(zip(order, rows))

    def finish(self) -> dict[str, Any]:
        if self._next != len(self._plan.buckets):
            raise WeightSyncError(f"update {self._version}: {self._next}/{len(self._plan.buckets)} buckets sent")
        # the last round and the commit in one call to each engine (answered after every copy)
        self._flush(last=True, commit=True)
        replies = self._drain()
        self.timings["transfer_s"] = time.perf_counter() - self._t_start
        report = self._commit(self._version, replies[-1])
        self.last_digest = (digest(torch.tensor([self._sent_sums[k] for k in sorted(self._sent_sums)],
                                                dtype=torch.int64)) if self.verify else None)
        self.last_report = report
        return report

    def abort(self) -> None:
        """Rounds already delivered stay loaded: engines stay paused on their old version."""
        for f in self._inflight:
            try:
                f.result()
            except Exception as e:
                logger.info("engine after abort: %s", e)
        self._inflight = []
        self._round_items, self._sums = [], []
        self._layouts = {}
        self._leave_paused()

    @property
    def _data_done(self) -> bool:
        return True

    def reset(self) -> None:
        """An engine was restarted: tell every engine the mode again and resend full layouts."""
        self._inited = False
        self._layouts, self._layout_plan, self._inflight, self._handles = {}, None, [], {}
        self._forget_engines()

    def close(self) -> None:
        super().close()
        self._exe.shutdown(wait=False)
        self._free_staging()
