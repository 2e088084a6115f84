"""Weight sync from Megatron to the rollout engines (bucketing + transports).

    sync_weights(bridge, models, transport, version, bucket_bytes, gather)   the trainer's one call
    BucketExporter / get_exporter / export_hf_state_dict              coalesced HF export (export.py)
    PeerExpertGather                                                  intra-node EP gather over CUDA IPC (peer_gather.py,
                                                                      driver peer copies: cuda_copy.py)
    build_plan / BucketPlan                                           bucket plan (plan.py)
    NcclBroadcastTransport                                            NCCL / gloo broadcast (nccl.py)
    CudaIpcTransport                                                  co-located CUDA IPC (cuda_ipc.py)
    SharedMemoryTransport                                             CPU /dev/shm + reload (rollout/cpu_transport.py)
    WeightReceiver, ChannelClient                                     receiver without vLLM (receiver.py, clients.py)
vLLM side: the "skyrl_bucket" weight-transfer backend (vllm_engine.py), registered by the
project's vLLM plugin.
"""

from .clients import ChannelClient, HttpEngineClient
from .cuda_ipc import CudaIpcTransport
from .export import BucketExporter, export_hf_state_dict, get_exporter
from .nccl import NcclBroadcastTransport
from .plan import DEFAULT_BUCKET_BYTES, BucketPlan
from .planner import build_plan
from .protocol import WeightSyncAborted
from .receiver import WeightReceiver
from .sync import sync_weights
from ..rollout.cpu_transport import SharedMemoryTransport

__all__ = [
    "BucketExporter", "BucketPlan", "ChannelClient", "CudaIpcTransport", "DEFAULT_BUCKET_BYTES",
    "HttpEngineClient", "NcclBroadcastTransport", "SharedMemoryTransport", "WeightReceiver", "WeightSyncAborted",
    "build_plan", "export_hf_state_dict", "get_exporter", "sync_weights",
]
