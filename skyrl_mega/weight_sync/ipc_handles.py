"""Share a buffer with another process on the same machine, as a typed JSON handle (never a pickle).

encode(t) -> a plain-JSON handle for a 1-D uint8 tensor that covers a whole storage;
decode(h) -> the same bytes as a uint8 tensor in the receiving process (callers cache the
result by handle_key(h)). The handle carries data only; decode validates every field and
refuses anything else (a pickled or unknown handle is a ValueError, nothing is executed).

CUDA ("kind": "cuda"): the fields of torch's own CUDA IPC reduction of the tensor
(torch.multiprocessing.reductions.reduce_tensor: cudaIpcGetMemHandle of the allocation, the
storage's size and offset in it, the producer's reference-counter file and offset, and its
IPC event so that the consumer waits for pending writes), base64 for the byte strings. The
consumer rebuilds the tensor with torch's rebuild_cuda_tensor, the tensor and storage types
fixed here (uint8, torch.Tensor), on its own ordinal of the same GPU.
CPU ("kind": "shm", tests and dry runs): a file in /dev/shm that both processes map
(torch.from_file(shared=True)); decode opens only files this module made (`shm_buffer`).

encode_event / wait_event: the producer's CUDA event, so the consumer's stream waits for the
producer's pending writes on the GPU instead of the producer synchronising its CPU.
storage_bytes / byte_runs: a tensor's whole storage, and copy runs over storages.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile

import torch

SHM_ROOT = "/dev/shm"
SHM_PREFIX = "skyrl_ws_ipc_"

_CUDA_FIELDS = {"kind": str, "device": int, "dtype": str, "shape": list, "stride": list, "tensor_offset": int,
                "storage_handle": str, "storage_size_bytes": int, "storage_offset_bytes": int,
                "ref_counter_handle": str, "ref_counter_offset": int, "event_handle": str,
                "event_sync_required": bool}
_SHM_FIELDS = {"kind": str, "path": str, "nbytes": int}


def storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(uint8 tensor over t's whole storage, byte offset of t in it)."""
    st = t.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
    return whole, t.storage_offset() * t.element_size()


def byte_runs(pieces) -> list[tuple[torch.Tensor, int, int]]:
    """Pieces (whole uint8 storage, byte offset, nbytes), in packing order -> copy runs
    (source bytes, position in the packed row, nbytes): pieces back to back in the same storage
    merge into one run, so memory packed in address order is one copy."""
    runs, pos = [], 0
    for whole, off, n in pieces:
        if runs and runs[-1][0].data_ptr() == whole.data_ptr() and runs[-1][1] + runs[-1][3] == off:
            runs[-1][3] += n
        else:
            runs.append([whole, off, pos, n])
        pos += n
    return [(w[o: o + n], p, n) for w, o, p, n in runs]


def shm_buffer(nbytes: int) -> tuple[torch.Tensor, str]:
    """A uint8 buffer in a new /dev/shm file that another process can open (encode(buf, path))."""
    fd, path = tempfile.mkstemp(prefix=SHM_PREFIX, dir=SHM_ROOT)
    os.ftruncate(fd, max(1, nbytes))
    os.close(fd)
    return torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8), path


def _b64(raw: bytes) -> str:
    return base64.b64encode(bytes(raw)).decode()


def encode(whole: torch.Tensor, shm_path: str | None = None) -> dict:
    """The typed handle of a 1-D uint8 buffer: CUDA memory, or a CPU buffer in `shm_path` (shm_buffer)."""
    if whole.dtype != torch.uint8 or whole.dim() != 1:
        raise ValueError(f"only 1-D uint8 buffers are shared, got {whole.dtype} {tuple(whole.shape)}")
    if whole.device.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(whole)  # torch's own sharing step (no pickling here)
        if rebuild is not rebuild_cuda_tensor or len(args) != 15:
            raise RuntimeError(f"torch {torch.__version__}: unexpected CUDA IPC reduction {rebuild} ({len(args)} args)")
        (_cls, size, stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_size, storage_offset,
         _requires_grad, ref_handle, ref_offset, event_handle, event_sync) = args
        if handle is None:
            raise ValueError("an empty CUDA buffer cannot be shared")
        return {"kind": "cuda", "device": int(device), "dtype": "uint8", "shape": [int(s) for s in size],
                "stride": [int(s) for s in stride], "tensor_offset": int(tensor_offset),
                "storage_handle": _b64(handle), "storage_size_bytes": int(storage_size),
                "storage_offset_bytes": int(storage_offset), "ref_counter_handle": _b64(ref_handle),
                "ref_counter_offset": int(ref_offset),
                "event_handle": _b64(event_handle), "event_sync_required": bool(event_sync)}
    if shm_path is None:
        raise ValueError("a CPU buffer can only be shared when it lives in a /dev/shm file")
    return {"kind": "shm", "path": shm_path, "nbytes": whole.numel()}


def _checked(h, fields: dict) -> dict:
    """`h` if it is a dict with exactly `fields`, each of its type (bool is not an int); else ValueError."""
    if not isinstance(h, dict) or set(h) != set(fields):
        got = sorted(h) if isinstance(h, dict) else type(h).__name__
        raise ValueError(f"not a typed IPC handle (fields {got}, expected {sorted(fields)})")
    for k, want in fields.items():
        v = h[k]
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ValueError(f"IPC handle field {k!r}: {type(v).__name__} is not {want}")
    return h


def _unb64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"IPC handle field {field!r} is not base64") from e


def _ints(v: list, field: str) -> list[int]:
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"IPC handle field {field!r} must list non-negative ints")
    return v


def _kind(h) -> str:
    kind = h.get("kind") if isinstance(h, dict) else None
    if kind not in ("cuda", "shm"):
        raise ValueError(f"not a typed IPC handle (kind {kind!r})")
    return kind


def handle_key(h: dict):
    """Identity of the shared memory behind a handle (the same allocation gives the same key,
    although every encode() of it carries a fresh event and reference counter)."""
    if _kind(h) == "cuda":
        h = _checked(h, _CUDA_FIELDS)
        return ("cuda", h["storage_handle"], h["storage_size_bytes"], h["storage_offset_bytes"])
    h = _checked(h, _SHM_FIELDS)
    return ("shm", h["path"], h["nbytes"])


def decode(h: dict, device: torch.device | None = None) -> torch.Tensor:
    """Opens a handle (validated first). Callers cache the result by handle_key(h): a second
    open of the same allocation is what torch's IPC cache would return anyway."""
    if _kind(h) == "cuda":
        return _open_cuda(_checked(h, _CUDA_FIELDS), device)
    return _open_shm(_checked(h, _SHM_FIELDS))


def _open_cuda(h: dict, device: torch.device | None) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if h["dtype"] != "uint8":
        raise ValueError(f"IPC handle dtype {h['dtype']!r}: only uint8 buffers are shared")
    shape, stride = _ints(h["shape"], "shape"), _ints(h["stride"], "stride")
    if len(shape) != 1 or len(stride) != 1:
        raise ValueError("IPC handle: a shared buffer is 1-D")
    for k in ("device", "tensor_offset", "storage_size_bytes", "storage_offset_bytes", "ref_counter_offset"):
        if h[k] < 0:
            raise ValueError(f"IPC handle field {k!r} is negative")
    # the consumer's ordinal of the same GPU (the producer's may differ under CUDA_VISIBLE_DEVICES)
    ordinal = device.index if device is not None and device.type == "cuda" else h["device"]
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(shape), tuple(stride), h["tensor_offset"], torch.storage.TypedStorage,
        torch.uint8, ordinal, _unb64(h["storage_handle"], "storage_handle"), h["storage_size_bytes"],
        h["storage_offset_bytes"], False, _unb64(h["ref_counter_handle"], "ref_counter_handle"),
        h["ref_counter_offset"], _unb64(h["event_handle"], "event_handle"), h["event_sync_required"])


def _open_shm(h: dict) -> torch.Tensor:
    path, nbytes = h["path"], h["nbytes"]
    real = os.path.realpath(path)
    if (os.path.dirname(real) != os.path.realpath(SHM_ROOT) or not os.path.basename(real).startswith(SHM_PREFIX)
            or not os.path.isfile(real)):
        raise ValueError(f"IPC handle path {path!r} is not a buffer file of {SHM_ROOT}/{SHM_PREFIX}*")
    if nbytes < 0 or nbytes > os.path.getsize(real):
        raise ValueError(f"IPC handle: {nbytes} bytes do not fit {path!r}")
    return torch.from_file(real, shared=True, size=nbytes, dtype=torch.uint8)


def encode_event(event) -> str:
    """A CUDA IPC event handle (bytes) as base64 text."""
    return base64.b64encode(event.ipc_handle()).decode()


_EVENTS: dict = {}


def wait_event(handle: str | None, device: torch.device) -> None:
    """Makes the current stream wait for the producer's event (opened once per handle).

    The producer re-records one event before every round; a wait always sees its latest
    record, i.e. at least the work of the round it came with, so it is never too early."""
    if not handle or device.type != "cuda":
        return
    ev = _EVENTS.get(handle)
    if ev is None:
        ev = _EVENTS[handle] = torch.cuda.Event.from_ipc_handle(device, base64.b64decode(handle))
    ev.wait(torch.cuda.current_stream(device))
