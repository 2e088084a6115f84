"""NCCL broadcast transport: trainer -> disaggregated engines (gloo on CPU, same code).

Data path: Megatron shards --(one coalesced gather per bucket toward global rank 0; export.py)-->
a packed uint8 bucket on rank 0's GPU (`acquire`: two rotating ~1 GiB slots, slot_pool.py:
bucket k+1 is packed while bucket k is on the wire) --header + checksums (`_seal`), NCCL
broadcast (`_ship`) in a process group of its own (rank 0 = trainer sender, ranks 1.. = every
engine worker and other receiver; TCPStore rendezvous hosted by the trainer)--> a buffer on
each receiver --> the engine's loader (vLLM: model.load_weights inside the layer-wise reload,
vllm_engine.py). Metadata (plan: names, dtypes, shapes, byte offsets) travels once per sync as
JSON in update_weights (HTTP for vLLM servers; clients.py); the data plane is protocol.py's
header + buckets + trailer + status round. The engines are
paused before and resumed after; finish_weight_update(version) sets the version they report.
With comm_backend="gloo" the identical protocol runs on CPU (how the tests drive a real vLLM
CPU server); only the communicator differs.
"""

from __future__ import annotations

import logging
import time
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ...rollout.errors import WeightSyncError
from ..checksum import buffer_checksums, digest
from ..plan import BucketPlan, BucketSpec
from ..protocol import (END, MAGIC, OK, PROTO, STATUS_ABORT, STATUS_DATA, Communicator, plan_key, version_id,
                        write_header)
from ..slot_pool import SlotPool
from .transfer_api import WeightTransferTransport

logger = logging.getLogger(__name__)

STATUS_NAMES = {1: "checksum mismatch", 2: "load failed"}


def _into(future: Future, fn, *args, **kwargs) -> None:
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        future.set_exception(e)


class NcclBroadcastTransport(WeightTransferTransport):
    """Packed buckets broadcast from trainer rank 0 to every engine worker (see module doc)."""

    layout = "full"
    # expert buckets first: cheap for the CPU to start (a few large copies each). "dense" first
    # (no EP gather in the first bucket) measured no better on 2 x H200: packing a dense bucket
    # takes the CPU 2-4 ms of per-tensor copies before the first send (BENCHMARKS.md)
    bucket_first = "experts"

    def __init__(self, control=None, receivers=(), *, comm_backend: str | None = None, num_slots: int = 2,
                 **kw):
        super().__init__(control, receivers, **kw)
        self.comm_backend = comm_backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.num_slots = num_slots
        self.comm: Communicator | None = None
        self.pool: SlotPool | None = None
        self._exe = ThreadPoolExecutor(max_workers=max(2, len(self.clients)))
        self._futs: list = []
        self._next = 0
        self._data_done = False
        self._cs = None
        self.last_digest: str | None = None
        self._sent_plan: str | None = None  # plan_id the receivers hold (sent once, reused)
        self._generation = 0  # bumped by reset(): every re-formed transfer group gets a new name
        self._retired: list = []  # (communicator, slot pool) of dropped groups with pending operations

    @property
    def world_size(self) -> int:
        return 1 + sum(c.num_ranks() for c in self.clients)

    def init(self) -> None:
        """Rendezvous with every receiver (once; blocking until all joined)."""
        if self.comm is not None:
            return
        self._close_retired()
        t0 = time.perf_counter()
        store = self._open_store()
        world = self.world_size
        group = f"skyrl_ws_pg{self._generation}"
        info = {"mode": "broadcast", "comm_backend": self.comm_backend, "master_address": self.master_address,
                "master_port": int(self.master_port), "world_size": world, "timeout_s": self.timeout_s,
                "group": group}
        futs, off = [], 1
        for c in self.clients:
            futs.append(self._exe.submit(c.init, info, off))
            off += c.num_ranks()
        # the rendezvous blocks until every receiver joined; a receiver that refused (an engine
        # without the weight-transfer backend, say) never joins, so its failed call ends the wait
        # at once instead of after timeout_s (the abandoned rendezvous times out on its own)
        comm = Future()
        threading.Thread(target=_into, daemon=True, name="skyrl-ws-rendezvous",  # daemon: exit never waits on it
                         args=(comm, Communicator, self.comm_backend, self.master_address, self.master_port, 0, world,
                               self.timeout_s, self.device), kwargs={"store": store, "group": group}).start()
        deadline = time.monotonic() + self.timeout_s
        while not comm.done():
            failed = [repr(f.exception()) for f in futs if f.done() and f.exception() is not None]
            if failed:
                raise WeightSyncError(f"transfer group init failed: {failed}")
            if time.monotonic() > deadline:
                raise WeightSyncError(f"transfer group init: receivers did not join within {self.timeout_s:.0f} s")
            time.sleep(0.02)  # polling two futures, not waiting out a guess
        errs = []
        for f in futs:
            try:
                f.result(timeout=self.timeout_s)
            except Exception as e:
                errs.append(repr(e))
        try:
            self.comm = comm.result()
        except Exception as e:
            errs.append(repr(e))
        if errs:
            self.comm = None
            raise WeightSyncError(f"transfer group init failed: {errs}")
        self.pool = SlotPool(self.device, n=self.num_slots, wait=self._wait)
        self._sent_plan = None
        self.timings["init_s"] = time.perf_counter() - t0

    # -- one update ------------------------------------------------------------------------------------
    def start(self, version, plan: BucketPlan | None = None) -> None:
        if plan is None:
            raise WeightSyncError("NcclBroadcastTransport.start needs the BucketPlan (use sync_weights)")
        if self._futs:
            raise WeightSyncError(f"update {self._version} is still in progress")
        self.init()
        self._version, self._plan = version, plan
        self._vid, self._pkey = version_id(version), plan_key(plan.plan_id)
        self._next, self._data_done = 0, False
        self.timings = {k: v for k, v in self.timings.items() if k == "init_s"}
        self._pause()
        self._cs = (torch.zeros(plan.num_tensors, 2, dtype=torch.int64, device=self.device)
                    if self.verify else None)
        # all headers in one host->device copy (a per-bucket copy from pageable memory would
        # stall the CPU on the stream and break the pipelining)
        self._headers = torch.tensor([[MAGIC, PROTO, self._vid, b.index, STATUS_DATA, b.nbytes, self._pkey, 0]
                                      for b in plan.buckets], dtype=torch.int64).to(self.device)
        info = {"version": version, "verify": self.verify, "plan_id": plan.plan_id,
                "sizes": [b.nbytes for b in plan.buckets], "num_tensors": plan.num_tensors,
                "plan": plan.wire() if self._sent_plan != plan.plan_id else None}
        self._sent_plan = plan.plan_id
        self._touched = True
        # start + update run in the background: the first bucket is packed meanwhile, and its
        # broadcast completes only once every receiver has joined the receive loop
        self._futs = [self._exe.submit(self._start_and_receive, c, info) for c in self.clients]
        self._t_start = time.perf_counter()

    @staticmethod
    def _start_and_receive(client, info: dict):
        client.start()
        return client.update(info)

    def acquire(self, bucket: BucketSpec, nbytes: int) -> torch.Tensor:
        return self.pool.acquire(nbytes)

    def _check_receivers(self) -> None:
        for f in self._futs:
            if f.done() and f.exception() is not None:
                raise WeightSyncError(f"a receiver failed during update {self._version}: {f.exception()}")

    def _wait(self, work) -> None:
        """Waits for an operation of the transfer group. NCCL: at once (the stream waits, not the
        CPU). gloo (CPU): polls, so that a receiver whose update failed is noticed: a server
        killed mid-sync can leave a worker process that holds its end of the group but never
        receives again, and a blocking wait on it would never return. Raises WeightSyncError
        when a receiver failed or after timeout_s."""
        if self.comm_backend != "gloo":
            work.wait()
            return
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            self._check_receivers()
            if time.monotonic() > deadline:
                raise WeightSyncError(f"update {self._version}: the transfer group did not complete an "
                                      f"operation within {self.timeout_s:.0f} s")
            time.sleep(0.0005)
        work.wait()  # raises the operation's own error

    def _seal(self, b: BucketSpec, buf: torch.Tensor, direct) -> None:
        """The bucket's header, and its checksums when verifying (before it is broadcast)."""
        if direct:
            raise WeightSyncError("the broadcast transport packs every tensor (layout 'full')")
        if b.index != self._next:
            raise WeightSyncError(f"bucket {b.index} sent out of order (expected {self._next})")
        self._check_receivers()
        buf[:64].view(torch.int64).copy_(self._headers[b.index])
        if self._cs is not None and b.tensors:
            first = b.tensors[0].index
            self._cs[first: first + len(b.tensors)] = buffer_checksums(buf, [(t.offset, t.nbytes) for t in b.tensors])

    def _ship(self, b: BucketSpec, buf: torch.Tensor, direct) -> None:
        self.pool.fence(self.comm.broadcast(buf, 0))
        self._next += 1
        if self._next == 1:  # on the CPU: when the first / last broadcast was enqueued
            self.timings["first_send_at_s"] = time.perf_counter() - self._t_start
        self.timings["last_send_at_s"] = time.perf_counter() - self._t_start

    def finish(self) -> dict[str, Any]:
        version, plan = self._version, self._plan
        if self._next != len(plan.buckets):
            raise WeightSyncError(f"update {version}: {self._next}/{len(plan.buckets)} buckets sent")
        t0 = time.perf_counter()
        trailer = torch.zeros(2 + 2 * plan.num_tensors, dtype=torch.int64, device=self.device)
        trailer[0], trailer[1] = END, self._vid
        if self._cs is not None:
            trailer[2:] = self._cs.view(-1)
        self._wait(self.comm.broadcast(trailer, 0))
        status = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        self._wait(self.comm.all_reduce_sum(status))
        self._data_done = True
        st = status.cpu().tolist()
        errs = []
        for f in self._futs:
            try:
                f.result(timeout=self.timeout_s)
            except Exception as e:
                errs.append(str(e))
        self._futs = []
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.timings["transfer_s"] = time.perf_counter() - self._t_start
        self.timings["trailer_s"] = time.perf_counter() - t0
        bad = {r: STATUS_NAMES.get(s, s) for r, s in enumerate(st) if s != OK}
        if bad or errs:
            self._sent_plan = None  # resend the plan next time (a receiver may have lost it)
            self._leave_paused()
            raise WeightSyncError(f"update {version} failed (engines stay paused on their previous version): "
                                  f"receiver ranks {bad}; {errs}")
        report = self._commit(version)
        self.last_digest = digest(self._cs) if self._cs is not None else None
        self.last_report = report
        return report

    def abort(self) -> None:
        """Sends the abort bucket (+ filler) if receivers are mid-sync; they keep their old version.
        If a receiver failed, the transfer group is dropped as well: the next sync forms a new
        one (an operation still pending on the old group may never complete)."""
        failed = any(f.done() and f.exception() is not None for f in self._futs)
        if self._futs and not self._data_done and self.comm is not None:
            n = len(self._plan.buckets)
            try:
                for k in (self._next, self._next + 1):
                    if k < n:
                        nb = self._plan.buckets[k].nbytes
                        buf = self.pool.acquire(nb)
                        write_header(buf, self._vid, k, STATUS_ABORT, nb, self._pkey)
                        self.pool.fence(self.comm.broadcast(buf, 0))
                if self._next >= n:  # every bucket went out: an all-zero trailer says "aborted"
                    trailer = torch.zeros(2 + 2 * self._plan.num_tensors, dtype=torch.int64, device=self.device)
                    self._wait(self.comm.broadcast(trailer, 0))
                self.pool.drain()
            except Exception:
                logger.exception("could not signal the abort to the receivers")
                failed = True
            for f in self._futs:
                try:
                    f.result(timeout=self.timeout_s)
                except Exception as e:
                    logger.info("receiver after abort: %s", e)  # expected: they raise WeightSyncAborted
        self._futs = []
        self._data_done = True
        self._sent_plan = None
        if failed and self.comm is not None:
            self.reset()
        self._leave_paused()

    def reset(self) -> None:
        """Forget the transfer group (an engine was restarted): the next sync forms a new one,
        which the restarted engines join and the surviving ones re-join."""
        if self.comm is not None:
            if self.pool is not None and self.pool.busy():
                # an operation still waits for a peer that stopped receiving (a worker left behind
                # by a killed server): destroying the group would block until that peer exits or
                # the group times out, so it is retired and closed once its operations ended
                self._retired.append((self.comm, self.pool))
            else:
                self.comm.close()
            self.comm = None
        self.pool = None
        self._futs, self._sent_plan = [], None
        self._generation += 1
        self._forget_engines()

    def _close_retired(self) -> None:
        keep = []
        for comm, pool in self._retired:
            if pool.busy():
                keep.append((comm, pool))
            else:
                comm.close()
        self._retired = keep

    def close(self) -> None:
        super().close()
        if self.comm is not None:
            self.comm.close()
            self.comm = None
        self._exe.shutdown(wait=False)
