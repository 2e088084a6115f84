"""CPU weight transport: safetensors in shared memory, reloaded in place by every engine.

Data path: the exporter's packed bucket (`acquire`: one reused buffer) -> its HF-named
tensors (plan.bucket_tensors) -> one safetensors file per bucket under /dev/shm (RAM, no
disk) -> POST /collective_rpc "skyrl_load_weights" to every server (directly, not via the router)
-> each vLLM worker mmaps the files and runs vLLM's layer-wise in-place reload, with the
CPU MoE repacking fix of vllm_plugin -> the workers report the version -> the transport
sets the engines' weight version (/update_weight_version, read back by /weight_info),
resets the prefix cache, resumes generation and deletes the files.

Pause modes (EngineControl.pause): "keep" freezes in-flight requests and continues them
after the update; "wait" lets them finish first; "abort" aborts them. With
`kv_after_update="recompute"` (default) the prefix cache is reset with
reset_running_requests=True: frozen requests are preempted and recompute their KV with
the new weights on resume, and no request can hit KV computed by the old weights.
With "keep" the reset is only attempted (it fails while frozen requests hold blocks).

Besides the WeightTransport calls, `send(named_tensors)` ships any (name, tensor) bucket
(`with transport.update(version) as send: send(bucket) ...` around it) without a plan.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from typing import Any, Iterable, Iterator, Tuple

import torch

from ...devices import current_device
from ...rollout.control import PAUSE_MODES, EngineControl
from ...rollout.errors import WeightSyncError
from ..plan import BucketPlan, BucketSpec, bucket_tensors
from ..slot_pool import SlotPool
from .base import WeightTransport

NamedTensors = Iterable[Tuple[str, Any]]  # (HF parameter name, torch.Tensor)

logger = logging.getLogger(__name__)

_ACTIVE_DIRS: set[str] = set()  # removed at exit too, should the process die mid-update


@atexit.register
def _remove_active_dirs() -> None:
    for d in list(_ACTIVE_DIRS):
        shutil.rmtree(d, ignore_errors=True)


class SharedMemoryTransport(WeightTransport):
    """WeightTransport for CPU engines: /dev/shm safetensors + in-place reload."""

    def __init__(
        self,
        control: EngineControl,
        shm_root: str = "/dev/shm",
        pause_mode: str = "keep",
        kv_after_update: str = "recompute",
        load_timeout_s: float = 600.0,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if kv_after_update not in ("recompute", "keep"):
            raise ValueError(f"kv_after_update must be 'recompute' or 'keep', got {kv_after_update!r}")
        if not os.path.isdir(shm_root):
            raise ValueError(f"shared-memory root {shm_root} does not exist")
        self.control = control
        self.shm_root = shm_root
        self.pause_mode = pause_mode
        self.kv_after_update = kv_after_update
        self.load_timeout_s = load_timeout_s
        self._dir: str | None = None
        self._files: list[str] = []
        self._names: set[str] = set()
        self._version: int | str | None = None
        self._bytes = 0
        self.device = torch.device(device) if device is not None else current_device()
        self._pool: SlotPool | None = None  # the exporter packs each bucket here (one at a time)

    @property
    def active(self) -> bool:
        return self._dir is not None

    def start(self, version: int | str, plan: BucketPlan | None = None) -> None:
        """Begins update `version` (the plan is not needed: every file names its tensors)."""
        if self.active:
            raise WeightSyncError(f"weight update {self._version} is still in progress")
        self._dir = tempfile.mkdtemp(prefix=f"skyrl_mega_w{version}_", dir=self.shm_root)
        _ACTIVE_DIRS.add(self._dir)
        self._files, self._names, self._bytes = [], set(), 0
        self._version = version
        self.timings = {}
        t0 = time.perf_counter()
        try:
            self.control.pause(mode=self.pause_mode, timeout_s=self.load_timeout_s)
        except BaseException:
            self._cleanup()
            raise
        self.timings["pause_s"] = time.perf_counter() - t0

    def acquire(self, bucket: BucketSpec, nbytes: int) -> torch.Tensor:
        """One buffer, reused: send_bucket writes its file before the next bucket is packed."""
        if self._pool is None:
            self._pool = SlotPool(self.device, n=1)
        return self._pool.acquire(nbytes)

    def send_bucket(self, bucket: BucketSpec, buf: torch.Tensor | None, direct=()) -> None:
        self.send(bucket_tensors(bucket, buf, direct, self.layout))

    def send(self, named_tensors: NamedTensors) -> None:
        """Writes one bucket of HF-named tensors to its own safetensors file."""
        if not self.active:
            raise WeightSyncError("send() before start()")
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        bucket = {}
        for name, tensor in named_tensors:
            if name in self._names or name in bucket:
                raise WeightSyncError(f"tensor {name!r} sent twice in update {self._version}")
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            bucket[name] = t.contiguous()
        if not bucket:
            return
        path = os.path.join(self._dir, f"bucket_{len(self._files):05d}.safetensors")
        save_file(bucket, path, metadata={"skyrl_version": str(self._version)})
        self._files.append(path)
        self._names.update(bucket)
        self._bytes += sum(t.numel() * t.element_size() for t in bucket.values())
        self.timings["write_s"] = self.timings.get("write_s", 0.0) + time.perf_counter() - t0

    def finish(self) -> dict[str, Any]:
        if not self.active:
            raise WeightSyncError("finish() before start()")
        version = self._version
        try:
            if not self._files:
                raise WeightSyncError(f"update {version}: nothing was sent")
            manifest = json.dumps({"files": self._files, "version": version})
            t0 = time.perf_counter()
            try:
                reports = self.control.collective_rpc(
                    "skyrl_load_weights", {"manifest": manifest}, timeout_s=self.load_timeout_s
                )
            except Exception as e:
                raise WeightSyncError(f"update {version}: engines failed to load the weights "
                                      f"(they stay paused): {e}") from e
            self.timings["load_s"] = time.perf_counter() - t0
            bad = {
                u: r for u, r in reports.items()
                if not r or any(
                    not isinstance(w, dict) or str(w.get("version")) != str(version)
                    or w.get("num_tensors") != len(self._names)
                    for w in r
                )
            }
            if bad:
                raise WeightSyncError(
                    f"update {version}: engines reported {bad} (expected version {version} and "
                    f"{len(self._names)} tensors; they stay paused)"
                )
            self.control.set_weight_version(version)
            t0 = time.perf_counter()
            ok = self.control.reset_prefix_cache(reset_running_requests=self.kv_after_update == "recompute")
            if not all(ok.values()):
                logger.warning("update %s: prefix cache not reset on %s (requests hold blocks)", version,
                               [u for u, v in ok.items() if not v])
            self.control.resume()
            self.timings["resume_s"] = time.perf_counter() - t0
            return reports
        finally:
            self._cleanup()

    def abort(self) -> None:
        """Drops the files; nothing was loaded, so the engines resume on their old weights."""
        was_active = self.active
        self._cleanup()
        if was_active:
            self.control.resume()

    @contextlib.contextmanager
    def update(self, version: int | str) -> Iterator:
        """start(version); yields send; finish() on success (report in last_report), abort() on an exception."""
        self.start(version)
        try:
            yield self.send
        except BaseException:
            self.abort()
            raise
        self.last_report = self.finish()

    def _cleanup(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            _ACTIVE_DIRS.discard(self._dir)
        self._dir = None
        self._files = []
        if self._pool is not None:
            self._pool.release()  # the packing buffer is not kept between updates

    @property
    def bytes_sent(self) -> int:
        return self._bytes
