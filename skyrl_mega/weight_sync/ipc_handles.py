"""Share a buffer with another process on the same machine: CUDA IPC handles, or /dev/shm files on CPU.

encode(t) -> a JSON-able handle for a uint8 tensor covering a whole storage; decode(h) -> the
same bytes as a uint8 tensor in the receiving process (opened once, cached by handle).
CUDA: torch's own CUDA IPC reduction (cudaIpcGetMemHandle of the allocation, plus the
producer's event so the consumer waits for pending writes), pickled and base64-encoded, as
vLLM's IPC weight-transfer engine does. CPU (tests, dry runs): a file in /dev/shm that both
processes map (torch.from_file(shared=True)).
encode_event / wait_event: the producer's CUDA event, so the consumer's stream waits for the
producer's pending writes on the GPU instead of the producer synchronising its CPU.
"""

from __future__ import annotations

import base64
import os
import pickle
import tempfile

import torch

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


def shm_buffer(nbytes: int, root: str = "/dev/shm") -> tuple[torch.Tensor, str]:
    fd, path = tempfile.mkstemp(prefix="skyrl_ws_ipc_", dir=root)
    os.ftruncate(fd, max(1, nbytes))
    os.close(fd)
    return torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8), path


def encode(whole: torch.Tensor, shm_path: str | None = None) -> dict:
    if whole.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        func, args = reduce_tensor(whole)
        return {"kind": "cuda", "device": whole.device.index,
                "pickle": base64.b64encode(pickle.dumps((func, args))).decode()}
    if shm_path is None:
        raise ValueError("a CPU buffer can only be shared when it lives in a /dev/shm file")
    return {"kind": "shm", "path": shm_path, "nbytes": whole.numel()}


def handle_key(h: dict):
    """Identity of the shared memory behind a handle (the same allocation gives the same key,
    although every encode() of it carries a fresh event and reference counter)."""
    if h["kind"] == "cuda":
        k = h.get("_key")
        if k is None:
            _, args = pickle.loads(base64.b64decode(h["pickle"]))
            k = h["_key"] = ("cuda", bytes(args[7]), int(args[8]), int(args[9]))
        return k
    return ("shm", h["path"], int(h["nbytes"]))


def decode(h: dict, device: torch.device | None = None) -> torch.Tensor:
    """Opens a handle. Callers cache the result by handle_key(h): a second open of the same
    allocation is what torch's IPC cache would return anyway."""
    if h["kind"] == "cuda":
        func, args = pickle.loads(base64.b64decode(h["pickle"]))
        args = list(args)
        if device is not None and device.type == "cuda":
            args[6] = device.index  # the consumer's ordinal of the same GPU
        return func(*args)
    return torch.from_file(h["path"], shared=True, size=int(h["nbytes"]), dtype=torch.uint8)


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
