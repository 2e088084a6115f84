"""Placement -> engine behaviour: which weight transport, and whether engines sleep.

In: `placement` (colocated | disaggregated), the rollout config, and the machine (CUDA or not).
Out: a PlacementPlan. Nothing else in the loop branches on placement.

| placement     | device | transport              | engines while training  |
|---------------|--------|------------------------|-------------------------|
| colocated     | GPU    | cuda_ipc               | sleep (level 1 or 2)    |
| disaggregated | GPU    | nccl                   | keep running            |
| either        | CPU    | shm (safetensors)      | keep running (no-op)    |

`rollout.weight_transport` overrides the transport column (auto = the table). Engines on other
hosts (rollout.external_urls naming another machine) can only be reached by nccl (gloo on CPU):
auto picks it there, and shm / cuda_ipc (files in this host's /dev/shm, CUDA IPC handles) are
refused with the one-line reason. The bucketed
transports (nccl, cuda_ipc) need the engines to run vLLM's weight-transfer backend
"skyrl_bucket": `server_args()` gives the vLLM flag. On CPU, nccl runs its protocol over gloo
and cuda_ipc over /dev/shm files.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ports import remote_hosts

TRANSPORTS = {  # skyrl_mega/weight_sync/transports/
    "shm": "skyrl_mega.weight_sync.transports.shm:SharedMemoryTransport",
    # the engines run the vLLM weight-transfer backend "skyrl_bucket"
    # (--weight-transfer-config '{"backend": "skyrl_bucket"}')
    "nccl": "skyrl_mega.weight_sync.transports.nccl:NcclBroadcastTransport",
    "cuda_ipc": "skyrl_mega.weight_sync.transports.cuda_ipc:CudaIpcTransport",
}


@dataclass
class PlacementPlan:
    placement: str
    device: str  # cpu | gpu
    transport: str  # shm | cuda_ipc | nccl
    sleep_level: int | None

    def make_transport(self, control, **kwargs):
        """The transport, built with `control` and kwargs it takes (e.g. channel for cuda_ipc)."""
        import importlib

        if self.transport not in TRANSPORTS:
            raise NotImplementedError(
                f"weight transport {self.transport!r} (placement={self.placement}, device={self.device}) "
                f"is not available in this build; available: {sorted(TRANSPORTS)}")
        module, cls = TRANSPORTS[self.transport].split(":")
        return getattr(importlib.import_module(module), cls)(control, **kwargs)

    def server_args(self) -> list[str]:
        """vLLM server flags this transport needs."""
        if self.transport in ("nccl", "cuda_ipc"):
            import json

            return ["--weight-transfer-config", json.dumps({"backend": "skyrl_bucket"})]
        return []


def plan_placement(placement: str, rollout_cfg, cuda: bool | None = None) -> PlacementPlan:
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if placement not in ("colocated", "disaggregated"):
        raise ValueError(f"placement must be colocated or disaggregated, got {placement!r}")
    want = getattr(rollout_cfg, "weight_transport", "auto") or "auto"
    if want != "auto" and want not in TRANSPORTS:
        raise ValueError(f"rollout.weight_transport must be auto or one of {sorted(TRANSPORTS)}, got {want!r}")
    remote = remote_hosts(list(getattr(rollout_cfg, "external_urls", None) or []))
    if remote and want in ("shm", "cuda_ipc"):
        raise ValueError(f"rollout.weight_transport={want} hands weights over on this host only (files in "
                         f"/dev/shm, CUDA IPC handles), but rollout.external_urls names engines on {remote[0]}: "
                         "use rollout.weight_transport=nccl (or auto)")
    if remote and want == "auto":
        want = "nccl"  # the only transport that crosses hosts
    if not cuda:
        return PlacementPlan(placement, "cpu", "shm" if want == "auto" else want, None)
    if want == "shm":
        raise ValueError("rollout.weight_transport=shm is the CPU transport; on GPUs use nccl or cuda_ipc")
    if placement == "colocated":
        return PlacementPlan(placement, "gpu", "cuda_ipc" if want == "auto" else want, rollout_cfg.sleep_level)
    return PlacementPlan(placement, "gpu", "nccl" if want == "auto" else want, None)
