"""Peer copies that run on the destination GPU's stream (CUDA driver `cuMemcpyAsync`).

In: a destination tensor on this process's GPU, a source tensor on another GPU of this host (in
practice: another process's memory opened through a CUDA IPC handle), a byte count. Out: the
copy enqueued on the destination device's current stream, nothing enqueued on the source GPU.

Why not `dst.copy_(src)`: for a cross-device copy PyTorch enqueues the copy on the SOURCE
device's current stream, with an event handshake between both devices' streams. When the source
GPU also runs another process (a receiver, an engine), every such copy puts work of a second
CUDA context on that GPU, which then time-slices with the other process's kernels. The driver's
`cuMemcpyAsync` with UVA pointers performs the same peer copy from the destination's stream.

`available()` is False without CUDA or without libcuda; callers then use `copy_`. Peer access
from the destination device must be enabled first (`enable_peer_access`, which lets PyTorch do
it through one tiny copy), or the driver would stage the copy through host memory.
"""

from __future__ import annotations

import ctypes
import functools

import torch


@functools.lru_cache(maxsize=1)
def _memcpy_async():
    if not torch.cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    fn = lib.cuMemcpyAsync
    fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _memcpy_async() is not None


def enable_peer_access(dst_device: torch.device, src: torch.Tensor) -> None:
    """Let `dst_device` read `src`'s GPU directly (PyTorch enables peer access on a cross-device copy)."""
    torch.empty(1, dtype=torch.uint8, device=dst_device).copy_(src.view(-1).view(torch.uint8)[:1])
    torch.cuda.synchronize(dst_device)


def copy_on_dst_stream(dst: torch.Tensor, src: torch.Tensor, nbytes: int | None = None, stream: int | None = None
                       ) -> None:
    """dst[:nbytes] <- src[:nbytes] (bytes, both contiguous), enqueued on dst's current stream
    (or on `stream`, a raw cudaStream_t of dst's device: callers issuing many copies pass it once)."""
    fn = _memcpy_async()
    if fn is None:
        raise RuntimeError("the CUDA driver (libcuda.so.1) is not available")
    n = dst.numel() * dst.element_size() if nbytes is None else int(nbytes)
    if n > dst.numel() * dst.element_size() or n > src.numel() * src.element_size():
        raise ValueError(f"copy of {n} bytes exceeds a tensor ({dst.nbytes} / {src.nbytes} bytes)")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copy_on_dst_stream needs contiguous tensors")
    if stream is not None and torch.cuda.current_device() == dst.device.index:
        rc = fn(dst.data_ptr(), src.data_ptr(), n, stream)
    else:
        with torch.cuda.device(dst.device):  # the driver call runs in the current context: dst's
            rc = fn(dst.data_ptr(), src.data_ptr(), n, stream or torch.cuda.current_stream(dst.device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"cuMemcpyAsync failed with CUresult {rc}")
