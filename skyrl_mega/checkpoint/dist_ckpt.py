"""Megatron dist-ckpt save / resume, atomic, with a verifiable manifest.

In: model chunks, the distributed optimizer, the LR scheduler and a JSON-able trainer state
(step, sampler position, ...). Out: `<root>/step_<N>/` holding megatron's sharded checkpoint,
every rank's RNG states (safetensors) and `trainer_state.json`, plus `skyrl_complete.json`: the
manifest written last (file sizes + crc32). Ranks write into `step_<N>.partial/`, which is
renamed only after every rank finished, so a crash mid-save never leaves a checkpoint that
looks complete; a directory whose manifest is missing or whose files do not match it is
skipped with a message, and the previous complete checkpoint is used.

Integrity at scale: no rank reads the whole checkpoint. On save each rank checksums the files it
wrote itself (megatron's `__<rank>_<n>.distcp` shards and its RNG file; rank 0 the rest) and
rank 0 merges the lists into the manifest. On load the ranks split the checksum work
(`verify_distributed`: file sizes everywhere, each file's crc32 on one rank, the verdict shared),
so a corrupted shard is still found before anything is loaded. Pruning and the launcher's
pre-flight check read only the manifest and file sizes (`verify_checkpoint(deep=False)`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..compat import megatron_core as mcore_compat
from ..errors import UserError

MANIFEST = "skyrl_complete.json"
TRAINER_STATE = "trainer_state.json"
OPT_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or does not fit the model."""


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:06d}")


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            crc = zlib.crc32(chunk, crc)
    return crc


_SHARD = re.compile(r"^__(\d+)_\d+(?:_\d+)?\.distcp$")  # megatron's; convert's streaming writer
_RNG = re.compile(r"^rng/rank_(\d+)\.safetensors$")


def _writer(rel: str) -> int:
    """The rank that wrote file `rel` of a checkpoint (its own shards and RNG state; rank 0 the rest)."""
    m = _SHARD.match(rel) or _RNG.match(rel)
    return int(m.group(1)) if m else 0


def _list_files(d: str) -> list[str]:
    out = []
    for base, _, files in os.walk(d):
        out += [os.path.relpath(os.path.join(base, f), d) for f in files if f != MANIFEST]
    return sorted(out)


def _sharded_state(models, optimizer, scheduler, is_loading: bool) -> dict:
    state = {}
    for i, m in enumerate(models):
        state[f"model{i}" if len(models) > 1 else "model"] = _unwrap(m).sharded_state_dict()
    if optimizer is not None:
        model_sd = {}
        for v in state.values():
            model_sd.update(v)
        state["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=OPT_FORMAT)
    if scheduler is not None:
        state["opt_param_scheduler"] = scheduler.state_dict()
    return state


def _rng_tensors() -> dict[str, torch.Tensor]:
    from megatron.core import tensor_parallel

    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    for name, st in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        out[f"tracker.{name}"] = st.clone() if isinstance(st, torch.Tensor) else torch.as_tensor(st)
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    from megatron.core import tensor_parallel

    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["torch_cuda"])
    tracker = {k[len("tracker."):]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def save_checkpoint(root: str, step: int, models, optimizer=None, scheduler=None,
                    trainer_state: dict | None = None, keep_last: int | None = None) -> str:
    """Collective: every rank calls it. Returns the final directory."""
    from megatron.core import dist_checkpointing

    final, partial = step_dir(root, step), step_dir(root, step) + ".partial"
    if _rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
    _barrier()
    dist_checkpointing.save(_sharded_state(models, optimizer, scheduler, is_loading=False), partial)
    save_file(_rng_tensors(), os.path.join(partial, "rng", f"rank_{_rank():05d}.safetensors"))
    if _rank() == 0:
        with open(os.path.join(partial, TRAINER_STATE), "w") as f:
            json.dump({"step": step, **(trainer_state or {})}, f)
    _barrier()
    world = dist.get_world_size() if dist.is_initialized() else 1
    listed = _list_files(partial)
    mine = {p: {"bytes": os.path.getsize(os.path.join(partial, p)), "crc32": _crc32(os.path.join(partial, p))}
            for p in listed if _writer(p) % world == _rank()}
    everyone = _all_ranks_json(mine)
    if _rank() == 0:
        files = {p: meta for part in everyone for p, meta in part.items()}
        with open(os.path.join(partial, MANIFEST), "w") as f:
            json.dump({"step": step, "world_size": world, "files": files}, f)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        if keep_last:
            prune(root, keep_last)
    _barrier()
    return final


def _all_ranks_json(obj) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    from ..weight_sync.collectives import all_gather_json

    return all_gather_json(obj)


def _checksum_share(files: dict, part: int, parts: int) -> list[str]:
    """The files whose crc32 part `part` of `parts` checks: largest first, each to the part with
    the fewest bytes so far (the same split on every rank)."""
    load, share = [0] * parts, []
    for rel in sorted(files, key=lambda r: (-files[r]["bytes"], r)):
        k = min(range(parts), key=lambda i: (load[i], i))
        load[k] += files[rel]["bytes"]
        if k == part:
            share.append(rel)
    return share


def verify_checkpoint(path: str, deep: bool = True, part: tuple[int, int] = (0, 1)) -> str | None:
    """None when the directory is a complete, intact checkpoint; else why not. Always: the
    manifest and every file's size; deep: the crc32 of this `part` (index, count) of the files."""
    if not os.path.isdir(path):
        return "it does not exist"
    manifest = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest):
        return "no completion manifest (the save did not finish)"
    try:
        files = json.load(open(manifest)).get("files", {})
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable manifest ({e})"
    for rel, want in files.items():
        p = os.path.join(path, rel)
        if not os.path.exists(p):
            return f"missing file {rel}"
        if os.path.getsize(p) != want["bytes"]:
            return f"{rel} has {os.path.getsize(p)} bytes, manifest says {want['bytes']}"
    for rel in _checksum_share(files, *part) if deep else []:
        if _crc32(os.path.join(path, rel)) != files[rel]["crc32"]:
            return f"{rel} fails its checksum"
    return None


def verify_distributed(path: str) -> str | None:
    """Collective: verify_checkpoint with the checksums split over the ranks; the same verdict
    (the first problem any rank found) on every rank."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    found = _all_ranks_json(verify_checkpoint(path, deep=True, part=(_rank(), world)))
    return next((why for why in found if why is not None), None)


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, d)) for d in os.listdir(root) if (m := _STEP_DIR.match(d))]
    return sorted(found)


def find_latest(root: str, log=print, verify=verify_checkpoint, below: int | None = None) -> str | None:
    """The newest checkpoint (older than step `below`, if given) that `verify` passes; explains
    each one skipped."""
    for step, path in reversed(list_checkpoints(root)):
        if below is not None and step >= below:
            continue
        why = verify(path)
        if why is None:
            return path
        log(f"[checkpoint] skipping {path}: {why}")
    return None


def prune(root: str, keep_last: int) -> None:
    """Keeps the newest `keep_last` complete checkpoints (manifest and sizes; nothing re-read)."""
    complete = [p for _, p in list_checkpoints(root) if verify_checkpoint(p, deep=False) is None]
    for path in complete[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(path: str, models, optimizer=None, scheduler=None, verify: bool = True) -> dict:
    """Collective. Verifies the checkpoint (verify_distributed; verify=False: the caller just
    did), then restores weights, optimizer, scheduler and this rank's RNG; returns the trainer
    state."""
    from megatron.core import dist_checkpointing

    why = verify_distributed(path) if verify else verify_checkpoint(path, deep=False)
    if why is not None:
        raise CheckpointError(f"{path} is not a usable checkpoint: {why}")
    if optimizer is not None:
        mcore_compat.ensure_optimizer_state(optimizer)
    loaded = dist_checkpointing.load(_sharded_state(models, optimizer, scheduler, is_loading=True), path)
    for i, m in enumerate(models):
        _unwrap(m).load_state_dict(loaded[f"model{i}" if len(models) > 1 else "model"])
    if optimizer is not None:
        with torch.no_grad():  # fp32 main params are views of the (leaf) model params
            optimizer.load_state_dict(loaded["optimizer"])
        mcore_compat.restore_adam_steps(optimizer)
    if scheduler is not None:
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    rng_file = os.path.join(path, "rng", f"rank_{_rank():05d}.safetensors")
    if not os.path.exists(rng_file):
        raise CheckpointError(f"{path} has no RNG state for rank {_rank()} (saved with another world size?)")
    _restore_rng(load_file(rng_file))
    return json.load(open(os.path.join(path, TRAINER_STATE)))
