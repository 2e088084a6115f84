"""Weight sync from Megatron to the rollout engines: plan -> fill buckets -> transport, one way.

    sync_weights(bridge, models, transport, version, bucket_bytes, gather)   the trainer's one call (sync.py)
    build_plan / BucketPlan           the bucket plan, built once per model shape (planner.py, plan.py),
                                      checked every sync (plan_check.py)
    BucketExporter / get_exporter / export_hf_state_dict    bucket filling, one coalesced gather per
                                      bucket (export.py; peer_gather.py for the intra-node EP gather)
    WeightTransport                   the one transport interface (transports/base.py):
    SharedMemoryTransport               CPU /dev/shm safetensors + reload (transports/shm.py)
    NcclBroadcastTransport              NCCL / gloo broadcast (transports/nccl.py)
    CudaIpcTransport                    co-located CUDA IPC (transports/cuda_ipc.py)
vLLM side: the "skyrl_bucket" weight-transfer backend (vllm_engine.py), registered by the
project's vLLM plugin. Nothing crosses a process boundary as a pickle: JSON, tensors and
typed IPC handles (ipc_handles.py) only.
"""

from .export import BucketExporter, export_hf_state_dict, get_exporter
from .plan import DEFAULT_BUCKET_BYTES, BucketPlan
from .planner import build_plan
from .protocol import WeightSyncAborted
from .sync import sync_weights
from .transports import (CudaIpcTransport, EngineClient, HttpEngineClient, NcclBroadcastTransport,
                         SharedMemoryTransport, WeightTransport)

__all__ = [
    "BucketExporter", "BucketPlan", "CudaIpcTransport", "DEFAULT_BUCKET_BYTES", "EngineClient", "HttpEngineClient",
    "NcclBroadcastTransport", "SharedMemoryTransport", "WeightSyncAborted", "WeightTransport",
    "build_plan", "export_hf_state_dict", "get_exporter", "sync_weights",
]
