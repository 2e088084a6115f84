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
trainer's typed IPC handles (ipc_handles.decode validates them; nothing is unpickled).
Two ways into the parameters ("ipc" mode):
- reload: vLLM's layer-wise reload and model.load_weights, tensor by tensor (each cloned: the
  reload may hold them until a layer is complete). Always right, ~200 us a tensor.
- direct: after the first such sync, landing_map.py learns from vLLM's own loaders where each
  sent tensor lands (one contiguous byte copy into one parameter, every parameter covered) and
  checks that against what the reload left; later syncs then copy each round straight into
  the parameters (copy_plan.py: merged copies, a few launches a round), no reload. Not on the
  CPU backend (it repacks weights after loading), not for quantized layers, and relearned when
  the parameters moved; the reason it does not apply is logged once.
A failed or aborted update finalises the layer-wise reload (the model stays runnable, the
engine stays paused) and raises, so vLLM keeps the previous weight version.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import ipc_handles, landing_map
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
    receive: str = "auto"  # "auto": direct copies once learned (module doc); "reload": always vLLM's reload


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


def _check_sums(version, names: list, got: torch.Tensor, expected: list) -> None:
    """Raises WeightSyncError naming the tensors whose landed checksums differ from the sender's."""
    from ..rollout.errors import WeightSyncError

    exp = torch.tensor(expected, dtype=torch.int64)
    bad = [names[i] for i in (got.cpu() != exp).any(1).nonzero().flatten().tolist()]
    if bad:
        raise WeightSyncError(f"update {version}: checksum mismatch over CUDA IPC for {bad[:3]}")


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
        self.receive = "auto"
        self.last: dict = {}
        self._plans: dict = {}  # plan_id -> ParsedPlan
        self._ipc_layouts: dict = {}  # layout_id -> tensor entries
        self._ipc_open: dict = {}
        self._map: landing_map.LandingMap | None = None  # direct copies (module doc)
        self._map_note: str | None = None  # why there is no map (logged once per reason)
        self._direct = False  # this update copies straight into the parameters
        self._reloading = False  # vLLM's layer-wise reload is open
        self._direct_plans: dict = {}  # layout_id -> (CopyPlan, table rows)
        self._learn: dict | None = None  # while a reload sync runs: name -> (dtype, shape), checksums
        self._copy_events: list = []  # (start, end) CUDA events of this update's direct copies
        self.last_copy_ms: list[float] = []  # their GPU times, per round, of the last committed update
        self.last_fresh_ms: float | None = None  # host time of the landing-map check of the last direct update
        self._told: set[int] = set()  # copy plans whose timed choice of chain copies was logged

    def init_transfer_engine(self, init_info: SkyrlBucketInitInfo) -> None:
        if self.comm is not None:  # the trainer re-formed the group: leave the old one
            self.comm.close()
            self.comm = None
        self.mode = init_info.mode
        if init_info.receive not in ("auto", "reload"):
            raise ValueError(f"unknown skyrl_bucket receive {init_info.receive!r} (auto | reload)")
        self.receive = init_info.receive
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

        t = time.perf_counter()
        self._direct = (self.mode == "ipc" and self.receive == "auto" and self._map is not None
                        and self._map.fresh(self.model))
        if self._direct:
            self.last_fresh_ms = (time.perf_counter() - t) * 1e3
            return
        self._map, self._direct_plans = None, {}
        self._learn = {"specs": {}, "sums": {}} if self._may_learn() else None
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def _may_learn(self) -> bool:
        why = None
        if self.receive == "reload":
            why = "receive=reload asked by the trainer"
        elif self.mode != "ipc":
            why = "direct copies are used in ipc mode only"
        elif self.device.type != "cuda":
            why = "the CPU backend repacks weights after loading"
        else:
            quant = {type(m.quant_method).__name__ for m in self.model.modules()
                     if getattr(m, "quant_method", None) is not None}
            odd = sorted(q for q in quant if not q.startswith("Unquantized"))
            if odd:
                why = f"quantized layers ({', '.join(odd)}) are processed after loading"
        if why:
            self._note(why)
        return why is None

    def _note(self, why: str) -> None:
        if why != self._map_note:
            logger.info("skyrl_bucket: loading through vLLM's layer-wise reload (%s)", why)
            self._map_note = why

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._reloading:
            self._reloading = False
            finalize_layerwise_reload(self.model, self.model_config)

    def finish_weight_update(self) -> None:
        if self.device.type == "cuda":
            # answered after every copy of the update (its last round is answered once queued):
            # the trainer then writes its parameters and its staging buffer again
            torch.cuda.synchronize(self.device)
            self.last_copy_ms = [a.elapsed_time(b) for a, b in self._copy_events]
        self._copy_events = []
        self._finalize()
        learn, self._learn = self._learn, None
        if learn is None or self._direct:
            return
        specs = [(n, dt, shape) for n, (dt, shape) in learn["specs"].items()]
        got = landing_map.learn(self.model, specs, self.device)
        why = got if isinstance(got, str) else landing_map.verify(got, specs, learn["sums"])
        if why:
            return self._note(why)
        self._map = got
        logger.info("skyrl_bucket: %d tensors now copy straight into vLLM's parameters (%d skipped by the model)",
                    len(got.where), len(got.skipped))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        try:
            self.receive_weights(info)
        except BaseException:
            # leave a runnable model (mixed weights; the engine stays paused, old version)
            self._learn = None
            try:
                self._finalize()
            except Exception:
                logger.exception("skyrl_bucket: finalising the reload after a failed update")
            raise
        if self.device.type == "cuda" and (info.mode != "ipc" or info.sync):
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
        if self._direct:
            return self._copy_direct(info, entries, sources)
        weights, sums = [], []
        learn = self._learn
        for name, dt, shape, h, off, nbytes, _ in entries:
            t = sources[h][off: off + nbytes].view(to_dtype(dt)).view(shape).clone()
            if info.verify or learn is not None:
                sums.append(tensor_checksum(t))
            if learn is not None:
                learn["specs"][name] = (dt, list(shape))
                learn["sums"][name] = sums[-1]
            weights.append((name, t))
        if info.verify and weights:
            _check_sums(info.version, [w[0] for w in weights], torch.stack(sums), info.checksums)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model.load_weights(weights=weights)

    def _copy_direct(self, info: SkyrlBucketUpdateInfo, entries: list, sources: list) -> None:
        """One round straight into the parameters (the landing map's merged copies)."""
        from ..rollout.errors import WeightSyncError

        cached = self._direct_plans.get(info.layout_id)
        if cached is None or info.tensors is not None:
            missing = [e[0] for e in entries if not self._map.covers([e[0]])]
            if missing:
                self._map = None  # the next update reloads through vLLM and learns again
                raise WeightSyncError(f"update {info.version}: {missing[:3]} not in the engine's landing map "
                                      f"(the sent tensors changed; the next sync reloads)")
            cached = self._direct_plans[info.layout_id] = landing_map.copy_plan(self._map, entries)
        plan, rows = cached
        if self.device.type == "cuda":  # GPU time of the copies, read at the commit (last_copy_ms)
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            plan.execute(dict(enumerate(sources)))
            ev[1].record()
            self._copy_events.append(ev)
            if plan.tuned is not None and id(plan) not in self._told:
                self._told.add(id(plan))
                logger.info("skyrl_bucket: copies of round %s by %s (one full copy: %s ms; %s)", info.round,
                            plan.tuned["chosen"], {m: round(v, 3) for m, v in plan.tuned.items() if m != "chosen"},
                            plan.shape())
        else:
            plan.execute(dict(enumerate(sources)))
        if info.verify and rows:
            got = torch.empty(len(rows), 2, dtype=torch.int64, device=self.device)
            plan.checksums(got, lambda slot: slot)
            _check_sums(info.version, [entries[i][0] for i in rows], got, [info.checksums[i] for i in rows])

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:  # abstract in vLLM 0.26's base
        raise NotImplementedError("the trainer side of skyrl_bucket is skyrl_mega.weight_sync (sync.py)")

    def shutdown(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None
