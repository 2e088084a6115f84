"""`skyrl-mega convert`: HF <-> Megatron dist-ckpt, at any parallel layout (torchrun entry).

    hf-to-mcore  IN: an HF checkpoint dir        OUT: a dist-ckpt dir (model weights only)
    mcore-to-hf  IN: a dist-ckpt dir (a trainer  OUT: an HF checkpoint dir (safetensors +
                 checkpoint step_N/ or one made       config + tokenizer files copied from
                 by hf-to-mcore) + the HF dir of      the reference HF dir)
                 the same architecture

dist-ckpt reshards on load, so the layout used here need not match the one that saved it.
Strict: the source must hold exactly the tensors the model loads (tensor_names.py), else a
CheckpointError names them. The output is written to `<dst>.partial` and renamed when complete;
a failure removes it. The launching process checks the inputs first (preflight.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch.distributed as dist

from ..config import load_config
from ..errors import run_rank
from ..megatron import parallel
from ..megatron.model import build_bridge
from .dist_ckpt import MANIFEST, CheckpointError, _unwrap, verify_distributed
from .tensor_names import (check_same_tensors, dist_ckpt_model_keys, hf_file_tensor_names, hf_weight_names,
                           requested_keys)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def partial_dir(dst: str) -> str:
    return dst.rstrip("/") + ".partial"


def remove_partial(dst: str) -> None:
    """What an unfinished conversion to `dst` left (save_hf's own temporary dir included)."""
    for d in (partial_dir(dst), partial_dir(partial_dir(dst))):
        shutil.rmtree(d, ignore_errors=True)


def _model_state(models):
    return {f"model{i}" if len(models) > 1 else "model": _unwrap(m).sharded_state_dict() for i, m in enumerate(models)}


def _publish(partial: str, out_dir: str) -> None:
    """Collective: once every rank finished writing, rank 0 renames the partial dir."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(partial, out_dir)
    dist.barrier()


def hf_to_mcore(cfg, hf_dir: str, out_dir: str) -> None:  # hf_dir is cfg.model.path
    from megatron.core import dist_checkpointing

    bridge = build_bridge(cfg)
    models = bridge.build(load_weights=False)
    check_same_tensors(f"{hf_dir} does not match its config.json", hf_weight_names(bridge, models),
                       hf_file_tensor_names(hf_dir))
    bridge.load_hf(models, hf_dir)
    partial = partial_dir(out_dir)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    dist_checkpointing.save(_model_state(models), partial)
    _publish(partial, out_dir)


def mcore_to_hf(cfg, ckpt_dir: str, out_dir: str) -> None:
    from megatron.core import dist_checkpointing

    bridge = build_bridge(cfg)
    models = bridge.build(load_weights=False)
    state = _model_state(models)
    check_same_tensors(f"{ckpt_dir} does not match {os.path.join(cfg.model.path, 'config.json')}",
                       requested_keys(state), dist_ckpt_model_keys(ckpt_dir))
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):  # a trainer checkpoint: its checksums, split
        why = verify_distributed(ckpt_dir)
        if why is not None:
            raise CheckpointError(f"{ckpt_dir} is not a usable checkpoint: {why}")
    loaded = dist_checkpointing.load(state, ckpt_dir)
    for i, m in enumerate(models):
        _unwrap(m).load_state_dict(loaded[f"model{i}" if len(models) > 1 else "model"])
    partial = partial_dir(out_dir)
    bridge.save_hf(models, partial)
    if dist.get_rank() == 0:
        for f in TOKENIZER_FILES:
            src = os.path.join(cfg.model.path, f)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(partial, f))
    _publish(partial, out_dir)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="skyrl-mega convert")
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--hf", help="HF dir of the architecture (mcore-to-hf; default: src for hf-to-mcore)")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    hf_dir = a.src if a.direction == "hf-to-mcore" else a.hf
    if not hf_dir:
        p.error("mcore-to-hf needs --hf <HF dir of the same architecture> (config + tokenizer)")
    cfg = load_config(None, [f"model.path={hf_dir}", *a.overrides])
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    try:
        if a.direction == "hf-to-mcore":
            hf_to_mcore(cfg, a.src, a.dst)
        else:
            mcore_to_hf(cfg, a.src, a.dst)
        if dist.get_rank() == 0:
            print(f"[skyrl-mega] wrote {a.dst}", flush=True)
    except BaseException:
        if dist.get_rank() == 0:
            remove_partial(a.dst)
        raise
    finally:
        parallel.destroy()


if __name__ == "__main__":
    sys.exit(run_rank(main, sys.argv[1:]))
