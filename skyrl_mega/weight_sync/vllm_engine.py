"""vLLM weight-transfer backend "skyrl_bucket": the engine side of skyrl-mega's bucketed sync.

Registered in vLLM's WeightTransferEngineFactory by the project's vLLM plugin
(rollout/vllm_plugin.py, in every vLLM process), selected per server with
    --weight-transfer-config '{"backend": "skyrl_bucket"}'
and driven through vLLM's own endpoints (VLLM_SERVER_DEV_MODE=1):
    POST /init_weight_transfer_engine {"init_info": {mode, comm_backend, master_address,
                                        master_port, rank_offset, world_size, timeout_s}}
    POST /start_weight_update          -> vLLM's layer-wise reload starts
    POST /update_weights {"update_info": {version, verify, plan} | an IPC round}
    POST /finish_weight_update {"weight_version"}   -> reload finalised, version committed
Modes: "broadcast" — protocol.py over a gloo (CPU) or NCCL (GPU) group of its own, one
update_weights call receives every bucket of the sync into a fresh buffer each and hands
its tensors to model.load_weights; "ipc" — one call per round, tensors opened from the
trainer's typed IPC handles (ipc_handles.decode validates them; nothing is unpickled) and
cloned (vLLM's reload may hold them until a layer is complete). A failed or aborted update finalises the layer-wise reload (the model stays
runnable, the engine stays paused) and raises, so vLLM keeps the previous weight version.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import ipc_handles
from .plan import to_dtype
from .protocol import Communicator, ReceiveSink, receive_sync

logger = logging.getLogger("vllm.skyrl_bucket")  # runs inside vLLM: through its log handlers

BACKEND_NAME = "skyrl_bucket"


@dataclass
class SkyrlBucketInitInfo(WeightTransferInitInfo):
    mode: str = "broadcast"
    comm_backend: str = "nccl"
    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int = 1
    world_size: int = 2
    timeout_s: float = 600.0
    device: str | None = None
    device_uuid: str | None = None
    group: str = "skyrl_ws_pg"  # the transfer group's name (a re-formed group has a new one)


@dataclass
class SkyrlBucketUpdateInfo(WeightTransferUpdateInfo):
    version: Any = None
    verify: bool = False
    plan: dict | None = None
    plan_id: str | None = None
    sizes: list | None = None
    num_tensors: int = 0
    mode: str = "broadcast"
    round: int = 0
    last: bool = True
    sync: bool = True  # answer only after the copies finished (the trainer then reuses its buffer)
    event: str | None = None  # the trainer's CUDA IPC event: wait for its writes on the GPU
    layout_id: str | None = None
    handles: list = field(default_factory=list)
    tensors: list | None = None
    checksums: list | None = None


class _LoadSink(ReceiveSink):
    def __init__(self, engine: "SkyrlBucketWeightTransferEngine"):
        self.engine = engine
        self.verify = False
        self.loaded = 0

    def buffer(self, index: int, nbytes: int) -> torch.Tensor:
        # a fresh buffer per bucket: the layer-wise reload keeps the tensors until a layer is complete
        return torch.empty(nbytes, dtype=torch.uint8, device=self.engine.device)

    def load(self, index, slots, buf):
        weights = [(t.name, t.view(buf)) for t in slots]
        self.engine.model.load_weights(weights=weights)
        self.loaded += len(weights)
        return None  # checksums of the received bytes


class SkyrlBucketWeightTransferEngine(WeightTransferEngine[SkyrlBucketInitInfo, SkyrlBucketUpdateInfo]):
    init_info_cls = SkyrlBucketInitInfo
    update_info_cls = SkyrlBucketUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.comm: Communicator | None = None
        self.mode = "broadcast"
        self.last: dict = {}
        self._plans: dict = {}  # plan_id -> ParsedPlan
        self._ipc_layouts: dict = {}  # layout_id -> tensor entries
        self._ipc_open: dict = {}

    def init_transfer_engine(self, init_info: SkyrlBucketInitInfo) -> None:
        if self.comm is not None:  # the trainer re-formed the group: leave the old one
            self.comm.close()
            self.comm = None
        self.mode = init_info.mode
        if self.mode == "ipc":
            return
        if self.mode != "broadcast":
            raise ValueError(f"unknown skyrl_bucket mode {self.mode!r}")
        pc = self.parallel_config
        worker_rank = getattr(pc, "data_parallel_index", 0) * pc.world_size + pc.rank
        rank = int(init_info.rank_offset) + worker_rank
        dev = self.device if init_info.comm_backend == "nccl" else torch.device("cpu")
        self.comm = Communicator(init_info.comm_backend, init_info.master_address, int(init_info.master_port),
                                 rank, int(init_info.world_size), float(init_info.timeout_s), dev,
                                 group=init_info.group)
        logger.info("skyrl_bucket: joined the transfer group as rank %d/%d (%s)", rank, init_info.world_size,
                    init_info.comm_backend)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        try:
            self.receive_weights(info)
        except BaseException:
            # leave a runnable model (mixed weights; the engine stays paused, old version)
            try:
                self.finish_weight_update()
            except Exception:
                logger.exception("skyrl_bucket: finalising the reload after a failed update")
            raise
        if self.device.type == "cuda" and (info.mode != "ipc" or info.sync or info.last):
            torch.cuda.synchronize(self.device)

    def receive_weights(self, info: SkyrlBucketUpdateInfo) -> None:
        if info.mode == "ipc":
            return self._receive_ipc(info)
        if self.comm is None:
            raise RuntimeError("skyrl_bucket: init_weight_transfer_engine was not called")
        sink = _LoadSink(self)
        payload = {"version": info.version, "verify": info.verify, "plan": info.plan, "plan_id": info.plan_id,
                   "sizes": info.sizes, "num_tensors": info.num_tensors}
        rep = receive_sync(self.comm, payload, sink, self._plans)
        rep.pop("checksums", None)
        rep.pop("names", None)
        self.last = rep

    def _receive_ipc(self, info: SkyrlBucketUpdateInfo) -> None:
        from ..rollout.errors import WeightSyncError
        from .checksum import tensor_checksum

        sources = []
        for h in info.handles:
            key = ipc_handles.handle_key(h)
            if key not in self._ipc_open:
                self._ipc_open[key] = ipc_handles.decode(h, self.device)
            sources.append(self._ipc_open[key])
        entries = info.tensors
        if entries is not None and info.layout_id is not None:
            self._ipc_layouts[info.layout_id] = entries
        elif entries is None:
            entries = self._ipc_layouts.get(info.layout_id)
            if entries is None:
                raise WeightSyncError(f"unknown IPC layout {info.layout_id} (the trainer resends it next sync)")
        ipc_handles.wait_event(info.event, self.device)  # the trainer's writes are done
        weights, sums = [], []
        for name, dt, shape, h, off, nbytes, _ in entries:
            t = sources[h][off: off + nbytes].view(to_dtype(dt)).view(shape).clone()
            if info.verify:
                sums.append(tensor_checksum(t))
            weights.append((name, t))
        if info.verify and weights:
            got = torch.stack(sums).cpu()
            exp = torch.tensor(info.checksums, dtype=torch.int64)
            bad = [weights[i][0] for i in (got != exp).any(1).nonzero().flatten().tolist()]
            if bad:
                raise WeightSyncError(f"update {info.version}: checksum mismatch over CUDA IPC for {bad[:3]}")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model.load_weights(weights=weights)

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:  # abstract in vLLM 0.26's base
        raise NotImplementedError("the trainer side of skyrl_bucket is skyrl_mega.weight_sync (sync.py)")

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
