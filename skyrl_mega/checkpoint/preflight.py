"""Checks of checkpoints in the launching process, before torchrun starts any rank.

In: `skyrl-mega convert`'s direction, source, HF dir, overrides and rank count; or a training
config (checkpoint.resume). Out: None, or one CheckpointError (or ConfigError) whose message
names the file and the problem:
  - an HF dir that is missing, has no (or an unreadable) config.json, a model_type without a
    bridge, no *.safetensors, an index naming a missing shard, a truncated or corrupt shard;
  - a dist-ckpt dir that is missing, has no metadata.json, or (a trainer checkpoint) misses a
    file of its manifest or has one of another size (the checksums are the ranks' job, split
    between them when they load it: dist_ckpt.verify_distributed);
  - a parallel layout that does not divide the model (config validation);
  - a checkpoint.resume=<path> that does not exist or does not verify.
What can be known only after the model is built (which tensors it loads) is checked in the
ranks (tensor_names.py).
"""

from __future__ import annotations

import glob
import json
import os
import struct

from .dist_ckpt import MANIFEST, CheckpointError, list_checkpoints, verify_checkpoint

INDEX = "model.safetensors.index.json"


def _supported_model_types() -> list[str]:
    from bridges import interface

    return interface.supported_model_types()


def _declared_size(path: str) -> int | None:
    """The file size a safetensors header describes (8-byte length + header + data), or None
    when the header itself is unreadable."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        return 8 + n + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def check_safetensors(path: str) -> None:
    """The file opens as safetensors (its header covers the file exactly)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
        return
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
        error = e
    size, need = os.path.getsize(path), _declared_size(path)
    if need is not None and size < need:
        raise CheckpointError(f"{path} is truncated: {size} bytes, its header describes {need}; "
                              "copy or download it again")
    raise CheckpointError(f"{path} is not a readable safetensors file ({error}); copy or download it again")


def safetensors_files(hf_dir: str) -> list[str]:
    """The weight files of an HF dir: the index's shards, else every *.safetensors."""
    index = os.path.join(hf_dir, INDEX)
    if os.path.exists(index):
        try:
            weight_map = json.load(open(index))["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index} is not a readable safetensors index ({e})") from None
        return [os.path.join(hf_dir, f) for f in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))


def check_hf_dir(hf_dir: str, weights: bool = True) -> None:
    """An HF checkpoint dir of a supported family; with `weights`, intact safetensors files."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{hf_dir} does not exist (expected an HF checkpoint directory: config.json "
                              "and *.safetensors)")
    config = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config):
        raise CheckpointError(f"{config} is missing: {hf_dir} is not an HF checkpoint directory")
    try:
        model_type = json.load(open(config)).get("model_type")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{config} is not readable JSON ({e})") from None
    supported = _supported_model_types()
    if model_type not in supported:
        raise CheckpointError(f"{config}: model_type {model_type!r} is not supported "
                              f"(no bridge; supported: {', '.join(supported)})")
    if not weights:
        return
    files = safetensors_files(hf_dir)
    if not files:
        other = " (only PyTorch .bin files: convert them to safetensors)" if glob.glob(
            os.path.join(hf_dir, "*.bin")) else ""
        raise CheckpointError(f"{hf_dir} has no *.safetensors weight files{other}")
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{os.path.join(hf_dir, INDEX)} names {os.path.basename(f)}, "
                                  f"which is missing from {hf_dir}")
        check_safetensors(f)


def check_dist_ckpt(ckpt_dir: str) -> None:
    """A Megatron dist-ckpt dir; a trainer checkpoint (with a manifest) must verify."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} does not exist (expected a Megatron dist-ckpt directory)")
    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise CheckpointError(f"{ckpt_dir} is not a Megatron dist-ckpt directory (no metadata.json)")
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):  # checksums: by the ranks, split, at load
        why = verify_checkpoint(ckpt_dir, deep=False)
        if why is not None:
            raise CheckpointError(f"{ckpt_dir} is not a usable checkpoint: {why}")


def check_convert(direction: str, src: str, hf_dir: str, overrides: list[str], nproc: int) -> None:
    """Everything about a conversion that is known before any rank starts."""
    from ..config import load_config, validate_config

    if direction == "hf-to-mcore":
        check_hf_dir(src)
    else:
        check_dist_ckpt(src)
        check_hf_dir(hf_dir, weights=False)
    validate_config(load_config(None, [f"model.path={hf_dir}", *overrides]), nproc)


def check_resume(cfg) -> None:
    """checkpoint.resume=<path> names one complete checkpoint (auto and none need nothing)."""
    path = cfg.checkpoint.resume
    if path in ("auto", "none"):
        return
    why = verify_checkpoint(path, deep=False)  # checksums: by the ranks, split, at load
    if why is not None and not os.path.exists(os.path.join(path, MANIFEST)) and list_checkpoints(path):
        why = (f"it holds checkpoints, it is not one: pass one of its step_N directories, e.g. "
               f"{list_checkpoints(path)[-1][1]}")
    if why is not None:
        raise CheckpointError(f"checkpoint.resume={path} is not a usable checkpoint: {why}")
