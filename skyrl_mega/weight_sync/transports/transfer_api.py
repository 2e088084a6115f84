"""WeightTransferTransport: the shared part of the transports that drive vLLM's weight-transfer API.

NcclBroadcastTransport and CudaIpcTransport both talk to their receivers through the four
steps of vLLM's weight-transfer API (init_weight_transfer_engine / start_weight_update /
update_weights / finish_weight_update; for vLLM servers one round trip per round, clients.py),
fanned out over clients
(clients.py): the vLLM servers behind `control` (an EngineControl) and/or other receivers
(`receivers=[...]`, EngineClient instances). This class holds what they share: the clients,
the trainer's TCPStore (rendezvous of the transfer group; clients that talk through it get a
connection of their own), pausing, the commit (finish_weight_update(version) everywhere,
version check, prefix-cache reset, resume) and leaving the engines paused after a failure.
Engines held by their sleep (EngineControl.held_by_sleep: colocated, weights woken, KV cache
asleep) are neither paused, reset nor resumed by the sync: waking their KV cache resumes them.

send_bucket(bucket, buf, direct) = `_seal` (what the receivers will check the bucket against:
order, header, checksums) then `_ship` (the bytes leave: a broadcast, or a place in the next
IPC round).
"""

from __future__ import annotations

import datetime
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...devices import current_device
from ...ports import address_reaching, free_port
from ...rollout.control import PAUSE_MODES, EngineControl
from ...rollout.errors import WeightSyncError
from ..plan import BucketSpec
from .base import WeightTransport
from .clients import EngineClient, HttpEngineClient

logger = logging.getLogger(__name__)


def worker_replies(reply):
    """The worker answers inside a fan-out reply ({url: [worker dict, ...]} per client)."""
    if isinstance(reply, dict):
        if "at" in reply or "copy_ms" in reply:
            yield reply
        else:
            for v in reply.values():
                yield from worker_replies(v)
    elif isinstance(reply, list):
        for v in reply:
            yield from worker_replies(v)


def engine_spans(reply) -> list[tuple[float, float]]:
    """(arrived, answered) of each worker's skyrl_weight_update call in a fan-out reply, on this
    host's monotonic clock (rollout/vllm_plugin.py)."""
    return [tuple(w["at"]) for w in worker_replies(reply)
            if isinstance(w.get("at"), list) and len(w["at"]) == 2]


def engine_got_at(reply) -> float | None:
    """When a round first reached a worker's own listener (rollout/worker_channel.py: before the
    body is read and the call waits for the worker), this host's monotonic clock; None where the
    round came another way."""
    got = [w["got_at"] for w in worker_replies(reply) if isinstance(w.get("got_at"), (int, float))]
    return min(got) if got else None


def engine_copy_ms(reply) -> float | None:
    """The slowest worker's GPU time of its direct copies in the committed update (None: not timed)."""
    per = [sum(w["copy_ms"]) for w in worker_replies(reply) if w.get("copy_ms")]
    return max(per) if per else None


def engine_map_check_ms(reply) -> float | None:
    """The slowest worker's host time checking its landing map before the update's first copy."""
    per = [w["map_check_ms"] for w in worker_replies(reply) if w.get("map_check_ms") is not None]
    return max(per) if per else None


class WeightTransferTransport(WeightTransport):
    def __init__(self, control: EngineControl | None = None, receivers: tuple[EngineClient, ...] | list = (), *,
                 pause_mode: str = "keep", kv_after_update: str = "recompute", verify: bool = False,
                 timeout_s: float = 600.0, device: torch.device | str | None = None,
                 master_address: str | None = None, master_port: int | None = None, channel: bool = False):
        super().__init__()
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if kv_after_update not in ("recompute", "keep"):
            raise ValueError(f"kv_after_update must be 'recompute' or 'keep', got {kv_after_update!r}")
        self.control = control
        self.clients: list[EngineClient] = (
            ([HttpEngineClient(control, timeout_s, channel=channel)] if control is not None else []) + list(receivers))
        if not self.clients:
            raise ValueError("a weight transport needs engines (control) or receivers")
        self.pause_mode = pause_mode
        self.kv_after_update = kv_after_update
        self.verify = verify
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else current_device()
        # the group's rendezvous: an address of this host that every engine can connect to
        self.master_address = master_address or address_reaching(control.urls if control is not None else [])
        self.master_port = master_port
        self.store = None
        self._version = None
        self._plan = None
        self._paused = False
        self._touched = False  # engines may hold part of the new weights

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def http(self) -> HttpEngineClient | None:
        return next((c for c in self.clients if isinstance(c, HttpEngineClient)), None)

    def _open_store(self):
        if self.store is None:
            import torch.distributed as dist

            self.master_port = self.master_port or free_port("")
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self.store = dist.TCPStore(self.master_address, int(self.master_port), None, True,
                                       timeout=timeout, wait_for_workers=False)

            def connect():
                # a connection of its own: a blocking wait of the process-group rendezvous
                # on the master connection would otherwise hold the messages back
                return dist.TCPStore(self.master_address, int(self.master_port), None, False, timeout=timeout)

            for c in self.clients:
                c.bind(connect)
        return self.store

    def _fanout(self, fn, *args) -> list:
        """fn(client, *args) on every client at once; raises WeightSyncError listing failures."""
        if len(self.clients) == 1:
            return [fn(self.clients[0], *args)]
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            futs = [pool.submit(fn, c, *args) for c in self.clients]
            out, errs = [], []
            for c, f in zip(self.clients, futs):
                try:
                    out.append(f.result())
                except Exception as e:
                    errs.append(f"{c.describe()}: {e}")
        if errs:
            raise WeightSyncError("; ".join(errs))
        return out

    def _held(self) -> bool:
        """Engines asleep with their weights woken (colocated): their sleep keeps scheduling
        paused and left no prefix cache, so the sync neither pauses, resets nor resumes them."""
        return self.control is not None and self.control.held_by_sleep

    def _pause(self) -> None:
        if self.control is not None and not self._paused and not self._held():
            t0 = time.perf_counter()
            self.control.pause(mode=self.pause_mode, timeout_s=self.timeout_s)
            self.timings["pause_s"] = time.perf_counter() - t0
        self._paused = True

    def _commit(self, version, reports: list | None = None) -> dict:
        """finish_weight_update(version) everywhere (or the `reports` of a last round that carried
        it), check the versions, resume the engines."""
        t0 = time.perf_counter()
        t_mono = time.monotonic()
        if reports is None:
            reports = self._fanout(lambda c: c.finish(version))
        spans = engine_spans(reports)
        if spans:  # how long the commit call took inside the engines (and to reach them, when sent here)
            self.timings["engine_commit_s"] = max(b - a for a, b in spans)
            if max(a for a, _ in spans) >= t_mono:
                self.timings["engine_commit_reached_s"] = max(a for a, _ in spans) - t_mono
        copy_ms = engine_copy_ms(reports)
        if copy_ms is not None:
            self.timings["engine_copy_s"] = copy_ms / 1e3
        check_ms = engine_map_check_ms(reports)
        if check_ms is not None:
            self.timings["engine_map_check_s"] = check_ms / 1e3
        versions = {}
        for c, rep in zip(self.clients, reports):
            versions.update(c.versions(rep))
        wrong = {k: v for k, v in versions.items() if str(v) != str(version)}
        if wrong:
            raise WeightSyncError(f"update {version}: engines report versions {wrong} after finishing")
        if self.control is not None and not self._held():
            ok = self.control.reset_prefix_cache(reset_running_requests=self.kv_after_update == "recompute")
            if not all(ok.values()):
                logger.warning("update %s: prefix cache not reset on %s", version, [u for u, v in ok.items() if not v])
            self.control.resume()
        self._paused = False
        self._touched = False
        self.timings["commit_s"] = time.perf_counter() - t0
        return {"versions": versions, "reports": reports}

    def _leave_paused(self) -> None:
        """After a failed update: engines that hold part of it stay paused on the old version.

        finish_weight_update WITHOUT a version lets a vLLM engine finalise its layer-wise
        reload (so the model is in one piece) while it keeps reporting the old version."""
        if self._touched and self.http is not None:
            try:
                self.http.finish(None)
            except Exception as e:  # an engine whose receive failed has finalised itself
                logger.info("finalising the aborted update on the engines: %s", e)
        if not self._touched and self._paused and self.control is not None and not self._held():
            self.control.resume()  # nothing reached them: resume on the old weights
            self._paused = False

    def _forget_engines(self) -> None:
        """reset() of both transports: every client forgets what it learnt about its engines."""
        for c in self.clients:
            c.reset()

    # -- WeightTransport ------------------------------------------------------------------------------
    def send_bucket(self, bucket: BucketSpec, buf: torch.Tensor | None, direct=()) -> None:
        self._seal(bucket, buf, direct)
        self._ship(bucket, buf, direct)

    def _seal(self, bucket: BucketSpec, buf: torch.Tensor | None, direct) -> None:
        """Everything the receivers check this bucket against (before its bytes leave)."""
        raise NotImplementedError

    def _ship(self, bucket: BucketSpec, buf: torch.Tensor | None, direct) -> None:
        """The bucket's bytes leave."""
        raise NotImplementedError

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close()
            except Exception:
                pass
