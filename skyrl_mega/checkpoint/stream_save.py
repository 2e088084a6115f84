"""A Megatron dist-ckpt (torch_dist format) written a bounded file at a time, each tensor made
only when the writer reaches it.

In:  a model's sharded state dict whose tensors hold no data (a model built on the meta device),
     `fill(piece) -> tensor`: the local tensor of one state dict entry (`piece` = (state dict
     prefix, entry name), e.g. ("model", "decoder.layers.0.mlp.linear_fc1.weight")), and the most
     bytes one file holds.
Out: what `dist_checkpointing.save` writes (metadata.json, common.pt, torch DCP's .metadata and
     each rank's `__<rank>_<k>_0.distcp` files, loadable at any layout), written through
     megatron's own save entry point (factories, integrity checks, common state, metadata.json).
     A rank's memory holds one file's tensors plus the entry being made, not its share of the
     model: the planner resolves each write item by calling fill() (once per entry; dropped when
     its last piece is resolved) and viewing the result as megatron's meta view (a factory's chunk
     keeps its offset and strides); the writer, torch's FileSystemWriter with one thread (it
     resolves items one at a time), gets one bounded bucket of items per file.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

Piece = tuple[str, str]  # (state dict prefix, entry name)


def _nested_sharded(value):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    todo, out = [value], []
    while todo:
        v = todo.pop()
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            todo.extend(nested_values(built) if isinstance(built, (dict, list)) else [built])
        else:
            out.append(v)
    return out


def written_pieces(state: dict) -> dict[tuple[str, tuple[int, ...]], Piece]:
    """(checkpoint key, global offset) of every tensor this rank writes (main replicas) -> the
    state dict entry it comes from. `state`: {prefix: {entry name: ShardedTensor | factory}}."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    out = {}
    for prefix, entries in state.items():
        for name, value in entries.items():
            for sh in _nested_sharded(value):
                if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
                    out[(sh.key, tuple(sh.global_offset))] = (prefix, name)
    return out


def _item_bytes(item) -> int:
    from torch.distributed.checkpoint.planner import WriteItemType

    if item.type == WriteItemType.BYTE_IO:
        return 0
    n = 1
    for s in item.tensor_data.size:
        n *= s
    return n * torch._utils._element_size(item.tensor_data.properties.dtype)


def buckets(items: list, limit: int) -> list[list]:
    """Items in order, cut into runs of at most `limit` bytes (an item larger than it alone)."""
    out, size = [[]], 0
    for item in items:
        b = _item_bytes(item)
        if out[-1] and size + b > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += b
    return out


def _writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class BucketedWriter(FileSystemWriter):
        """One file per bucket of at most `bucket_bytes` (torch's writer keeps every tensor of a
        file until the file is complete)."""

        def __init__(self, path, bucket_bytes: int):
            super().__init__(path, single_file_per_rank=True, thread_count=1)
            self.bucket_bytes = bucket_bytes

        def write_data(self, plan, planner):
            results = []
            for k, bucket in enumerate(buckets(plan.items, self.bucket_bytes)):
                prefix = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{k}_")
                sub = dataclasses.replace(plan, items=bucket, storage_data=prefix)
                results += super().write_data(sub, planner).wait()
            done = torch.futures.Future()
            done.set_result(results)
            return done

    return BucketedWriter


def _planner_class():
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class PullingPlanner(MCoreSavePlanner):
        """Resolves a tensor write item by making its entry's tensor (fill) on demand."""

        def __init__(self, pieces: dict, fill: Callable[[Piece], torch.Tensor], on_tensor: Callable[[int], None]):
            super().__init__(dedup_replicated_tensors=False, flatten_state_dict=False)
            self.pieces, self.fill, self.on_tensor = pieces, fill, on_tensor
            self.left: dict[Piece, int] = {}
            for piece in pieces.values():
                self.left[piece] = self.left.get(piece, 0) + 1
            self.made: dict[Piece, torch.Tensor] = {}

        def resolve_data(self, write_item):
            like = super().resolve_data(write_item)
            if write_item.type == WriteItemType.BYTE_IO:
                return like
            where = (write_item.index.fqn, tuple(write_item.index.offset))
            if where not in self.pieces:
                raise RuntimeError(f"dist-ckpt write item {where} comes from no state dict entry")
            piece = self.pieces[where]
            if piece not in self.made:  # a tensor of its own: megatron's views index its storage
                made = self.fill(piece).contiguous()
                self.made[piece] = made if not made.storage_offset() and made.untyped_storage().nbytes() == made.nbytes \
                    else made.clone()
            real = self.made[piece]
            self.left[piece] -= 1
            if not self.left[piece]:
                del self.made[piece]
            out = real.as_strided(like.size(), like.stride(), like.storage_offset())
            self.on_tensor(out.numel() * out.element_size())
            return out.clone() if out.untyped_storage().size() != out.nbytes else out

    return PullingPlanner


def _strategy(pieces, fill, on_tensor, bucket_bytes: int):
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (_replace_state_dict_keys_with_sharded_keys,
                                                                    mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint import save as dcp_save

    class PullingSaveStrategy(SaveShardedStrategy):
        """The torch_dist backend (the format megatron's default strategy writes), pulling data."""

        def __init__(self):
            super().__init__("torch_dist", 1)

        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            flat, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            dcp_save(mcore_to_pyt_state_dict(flat, False), storage_writer=_writer_class()(checkpoint_dir, bucket_bytes),
                     planner=_planner_class()(pieces, fill, on_tensor))

    return PullingSaveStrategy()


def save_streaming(state: dict, out_dir: str, fill: Callable[[Piece], torch.Tensor], bucket_bytes: int,
                   on_tensor: Callable[[int], None] = lambda n: None) -> None:
    """Collective: writes `state` (tensors on the meta device allowed) to `out_dir`, an existing
    empty directory. `on_tensor(bytes)` after each tensor is made (progress)."""
    from megatron.core import dist_checkpointing

    pieces = written_pieces(state)
    dist_checkpointing.save(state, out_dir, sharded_strategy=_strategy(pieces, fill, on_tensor, bucket_bytes))
