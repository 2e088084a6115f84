"""The transports: one interface (base.WeightTransport), one class per data path.

    base.WeightTransport                     start / acquire / send_bucket / finish / abort / reset / close
    shm.SharedMemoryTransport                CPU engines: /dev/shm safetensors + in-place reload
    transfer_api.WeightTransferTransport     shared by the two below: vLLM's weight-transfer calls
                                             through clients.py (HttpEngineClient), pause, commit
    nccl.NcclBroadcastTransport              disaggregated engines: NCCL broadcast (gloo on CPU)
    cuda_ipc.CudaIpcTransport                co-located engines: CUDA IPC handles (/dev/shm on CPU)
"""

from .base import WeightTransport
from .clients import EngineClient, HttpEngineClient
from .cuda_ipc import CudaIpcTransport
from .nccl import NcclBroadcastTransport
from .shm import SharedMemoryTransport

__all__ = ["CudaIpcTransport", "EngineClient", "HttpEngineClient", "NcclBroadcastTransport", "SharedMemoryTransport",
           "WeightTransport"]
