"""BucketTransport: the trainer side of a packed-bucket weight transport (NCCL / gloo / CUDA IPC).

Extends rollout.transport.WeightTransport with the calls sync_weights() uses:

    transport.start(version, plan)          pause engines, begin the update (plan: BucketPlan)
    buf = transport.acquire(bucket, n)      the exporter packs bucket `bucket` into `buf`
    transport.send_bucket(bucket, buf, direct)
    report = transport.finish()             verify, commit `version` everywhere, resume
    transport.abort()                       after a failure: engines stay paused on their old version

Receivers: the vLLM servers behind `control` (an EngineControl; HTTP endpoints of vLLM's
native weight-transfer API) and/or standalone receivers (`receivers=[ChannelClient(n)]`).
Test hooks: `fail_at_bucket` raises before that bucket is sent; `corrupt_bucket` flips a
byte of that bucket after its checksums were taken (verification must catch it).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..devices import current_device
from ..ports import free_port

from ..rollout.control import PAUSE_MODES, EngineControl
from ..rollout.errors import WeightSyncError
from ..rollout.transport import NamedTensors, WeightTransport
from .clients import ChannelClient, HttpEngineClient

logger = logging.getLogger(__name__)


class BucketTransport(WeightTransport):
    layout = "full"

    def __init__(self, control: EngineControl | None = None, receivers=(), *, pause_mode: str = "keep",
                 kv_after_update: str = "recompute", verify: bool = False, timeout_s: float = 600.0,
                 device: torch.device | str | None = None, master_address: str | None = None,
                 master_port: int | None = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if kv_after_update not in ("recompute", "keep"):
            raise ValueError(f"kv_after_update must be 'recompute' or 'keep', got {kv_after_update!r}")
        self.control = control
        self.clients: list = ([HttpEngineClient(control, timeout_s)] if control is not None else []) + list(receivers)
        if not self.clients:
            raise ValueError("a weight transport needs engines (control) or receivers")
        self.pause_mode = pause_mode
        self.kv_after_update = kv_after_update
        self.verify = verify
        self.timeout_s = timeout_s
        self.device = torch.device(device) if device is not None else (
            current_device())
        self.master_address = master_address or "127.0.0.1"
        self.master_port = master_port
        self.store = None
        self.fail_at_bucket: int | None = None
        self.corrupt_bucket: int | None = None
        self._version = None
        self._plan = None
        self._paused = False
        self._touched = False  # engines may hold part of the new weights
        self.timings: dict[str, float] = {}
        self.last_report: Any = None

    # -- helpers ------------------------------------------------------------------------------------
    @property
    def http(self) -> HttpEngineClient | None:
        return next((c for c in self.clients if isinstance(c, HttpEngineClient)), None)

    def _open_store(self):
        if self.store is None:
            import datetime

            import torch.distributed as dist

            self.master_port = self.master_port or free_port("")
            self.store = dist.TCPStore(self.master_address, int(self.master_port), None, True,
                                       timeout=datetime.timedelta(seconds=self.timeout_s), wait_for_workers=False)
            for c in self.clients:
                if isinstance(c, ChannelClient):
                    # a connection of its own: a blocking wait of the process-group rendezvous
                    # on the master connection would otherwise hold the messages back
                    c.bind(dist.TCPStore(self.master_address, int(self.master_port), None, False,
                                         timeout=datetime.timedelta(seconds=self.timeout_s)))
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

    def _pause(self) -> None:
        if self.control is not None and not self._paused:
            t0 = time.perf_counter()
            self.control.pause(mode=self.pause_mode, timeout_s=self.timeout_s)
            self.timings["pause_s"] = time.perf_counter() - t0
        self._paused = True

    def _commit(self, version) -> dict:
        """finish_weight_update(version) everywhere, check the versions, resume the engines."""
        t0 = time.perf_counter()
        reports = self._fanout(lambda c: c.finish(version))
        versions = {}
        for c, rep in zip(self.clients, reports):
            versions.update(c.versions(rep))
        wrong = {k: v for k, v in versions.items() if str(v) != str(version)}
        if wrong:
            raise WeightSyncError(f"update {version}: engines report versions {wrong} after finishing")
        if self.control is not None:
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
        if not self._touched and self._paused and self.control is not None:
            self.control.resume()  # nothing reached them: resume on the old weights
            self._paused = False

    # -- WeightTransport ------------------------------------------------------------------------------
    def send(self, named_tensors: NamedTensors) -> None:
        raise NotImplementedError(f"{type(self).__name__} sends packed buckets: use "
                                  "skyrl_mega.weight_sync.sync_weights()")

    def close(self) -> None:
        for c in self.clients:
            if isinstance(c, ChannelClient) and c.store is not None:
                try:
                    c.shutdown()
                except Exception:
                    pass
