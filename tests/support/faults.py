"""Fault injection for the weight-sync tests and benchmarks, from the test side.

`faulty(NcclBroadcastTransport)` (or CudaIpcTransport) is a subclass with two switches, both
off by default and set per sync by the test:
    fail_at_bucket = k    send_bucket raises WeightSyncError before bucket k is sent
    corrupt_bucket = k    one byte of bucket k is flipped after the transport took its
                          checksums (`_seal`) and before the bytes leave (`_ship`): a verified
                          sync must catch it on the receiving side
The library itself has no fault hooks.
"""

from __future__ import annotations

from skyrl_mega.rollout.errors import WeightSyncError


class FaultInjection:
    """Mixin in front of a WeightTransferTransport subclass (see module doc)."""

    fail_at_bucket: int | None = None
    corrupt_bucket: int | None = None

    def send_bucket(self, bucket, buf, direct=()):
        if self.fail_at_bucket is not None and bucket.index == self.fail_at_bucket:
            raise WeightSyncError(f"injected failure before bucket {bucket.index}")
        return super().send_bucket(bucket, buf, direct)

    def _seal(self, bucket, buf, direct):
        super()._seal(bucket, buf, direct)
        if self.corrupt_bucket is not None and bucket.index == self.corrupt_bucket:
            off = first_packed_offset(self.layout, bucket)
            if off is not None:
                buf[off: off + 1].bitwise_xor_(0x5A)


def first_packed_offset(layout: str, bucket) -> int | None:
    """Byte offset, in the bucket's buffer, of its first tensor that is packed there (None: none is)."""
    ipc = layout == "ipc"
    for t in bucket.tensors:
        if not (ipc and t.direct):
            return t.ipc_offset if ipc else t.offset
    return None


_CLASSES: dict = {}


def faulty(cls):
    """`cls` with FaultInjection in front (one class per transport class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Faulty{cls.__name__}", (FaultInjection, cls), {})
    return _CLASSES[cls]
