"""`skyrl-mega convert`: HF <-> Megatron dist-ckpt, at any parallel layout (torchrun entry).

    hf-to-mcore  IN: an HF checkpoint dir        OUT: a dist-ckpt dir (model weights only)
    mcore-to-hf  IN: a dist-ckpt dir (a trainer  OUT: an HF checkpoint dir (safetensors +
                 checkpoint step_N/ or one made       config + tokenizer files copied from
                 by hf-to-mcore) + the HF dir of      the reference HF dir)
                 the same architecture

dist-ckpt reshards on load, so the layout used here need not match the one that saved it.
Streaming (peak memory about one output file, --shard-size, plus the tensor being converted; no
rank holds a model copy): the model is built on the meta device for its names, shapes and
sharded-tensor metadata only.
  hf-to-mcore  at the requested layout; megatron's writer pulls each tensor this rank writes,
               which is read from HF then (safe_open), converted and cut to this rank's slice
               by the bridge (stream_save.py), one bounded dist-ckpt file at a time.
  mcore-to-hf  at TP = PP = EP = 1 (the overrides only size the job): the ranks split the
               model's whole tensors, load them a group at a time from the dist-ckpt, convert
               them (the bridge) and write one safetensors file per group (hf_output.py).
Rank 0 prints progress lines and every rank's peak RSS (progress.py) to stderr.
Strict: the source must hold exactly the tensors the model loads (tensor_names.py), else a
CheckpointError names them. Tensors the family carries (MTP layers, a vision tower: the bridge's
`carried`) are not converted: hf-to-mcore names them and leaves them out, mcore-to-hf copies
them unchanged from its --hf checkpoint. The output is written to `<dst>.partial` and renamed when complete;
a failure removes it. The launching process checks the inputs first (preflight.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys

import torch
import torch.distributed as dist

from ..config import load_config
from ..errors import run_rank
from ..megatron import parallel
from ..megatron.model import build_bridge
from .dist_ckpt import MANIFEST, CheckpointError, _unwrap, verify_distributed
from .hf_output import publish_index, write_group
from .hf_reader import HFReader
from .progress import Progress, report_peak, rss
from .stream_save import save_streaming, written_pieces
from .tensor_names import (check_same_tensors, dist_ckpt_model_keys, hf_file_tensor_names, hf_weight_names,
                           requested_keys)

DEFAULT_SHARD = 1 << 30  # bytes of one output file (HF) / one rank's dist-ckpt file
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json", "vocab.json", "merges.txt")


def partial_dir(dst: str) -> str:
    return dst.rstrip("/") + ".partial"


def remove_partial(dst: str) -> None:
    """What an unfinished conversion to `dst` left (an older save_hf's own temporary dir included)."""
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


def _entry_bytes(t) -> int:
    return t.numel() * t.element_size()


def hf_to_mcore(cfg, hf_dir: str, out_dir: str, shard_bytes: int = DEFAULT_SHARD) -> None:  # hf_dir is cfg.model.path
    """Streaming: the model is built on the meta device (sharded-tensor metadata only); each
    tensor this rank writes is read from HF (safe_open), converted and cut to this rank's slice
    when the dist-ckpt writer reaches it (stream_save.py)."""
    bridge = build_bridge(cfg, perform_initialization=False)
    models = bridge.build_meta()
    sources = [bridge.hf_sources(_unwrap(m)) for m in models]
    present = hf_file_tensor_names(hf_dir)
    carried = bridge.carried(present)
    check_same_tensors(f"{hf_dir} does not match its config.json", hf_weight_names(bridge, models),
                       present - set(carried))
    if carried and dist.get_rank() == 0:
        print(f"[skyrl-mega] {describe_carried(carried)} not converted: the model does not build them; "
              "mcore-to-hf copies them unchanged from its --hf checkpoint", file=sys.stderr, flush=True)
    state = _model_state(models)
    chunk = {prefix: i for i, prefix in enumerate(state)}
    entries = [dict(_unwrap(m).state_dict()) for m in models]
    reader = HFReader(hf_dir)
    pieces = written_pieces(state)
    mine = set(pieces.values())
    progress = Progress("hf-to-mcore (rank 0's share)", len(mine),
                        sum(_entry_bytes(entries[chunk[p]][n]) for p, n in mine), show=dist.get_rank() == 0)

    def fill(piece):
        prefix, local = piece
        i = chunk[prefix]
        if local not in sources[i]:
            raise CheckpointError(f"the model saves {local}, which has no HF source in the bridge's mapping")
        name, hf_names = sources[i][local]
        out = bridge.local_from_hf(local, name, reader.read(hf_names), like=entries[i][local])
        progress.add(1, _entry_bytes(out))
        return out

    partial = partial_dir(out_dir)
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    before = rss()
    save_streaming(state, partial, fill, shard_bytes)
    progress.line()
    report_peak(before)
    _publish(partial, out_dir)


def split_work(sizes: list[int], world: int, group_bytes: int) -> list[list[list[int]]]:
    """Entries (their byte sizes, in model order) -> per rank, groups of entry indices: each rank
    a contiguous run of about 1/world of the bytes, cut into groups of at most group_bytes (an
    entry larger than that alone). The same on every rank."""
    total, runs, acc = sum(sizes), [[] for _ in range(world)], 0
    for i, b in enumerate(sizes):
        runs[min(world - 1, acc * world // max(total, 1))].append(i)
        acc += b
    out = []
    for run in runs:
        groups, size = [], 0
        for i in run:
            if not groups or (size + sizes[i] > group_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += sizes[i]
        out.append(groups)
    return out


def _load_units(sharded: dict, names: list[str], written_together=lambda name: ()) -> list[list[str]]:
    """Entries loaded together: those saved under a common checkpoint key (a layer's experts:
    megatron's legacy expert tensors load only as all of a key's local shards), and those whose
    HF tensors are written as one (`written_together(name)`: e.g. the fused expert tensor its
    HF tensors belong to), in model order."""
    from .stream_save import _nested_sharded

    unit_of_key, units = {}, []
    for n in names:
        keys = {sh.key for sh in _nested_sharded(sharded[n])} | {("hf", k) for k in written_together(n)}
        hit = sorted({unit_of_key[k] for k in keys if k in unit_of_key})
        if not hit:
            units.append([n])
            target = len(units) - 1
        else:
            target = hit[0]
            units[target].append(n)
            for other in hit[1:]:  # entries that join two earlier units
                units[target] += units[other]
                units[other] = []
                unit_of_key.update({k: target for k, u in unit_of_key.items() if u == other})
        unit_of_key.update({k: target for k in keys})
    return [u for u in units if u]


def _with_data(value):
    """A copy of a meta sharded entry (ShardedTensor or factory) over a real empty tensor."""
    return dataclasses.replace(value, data=torch.empty(value.data.shape, dtype=value.data.dtype))


def mcore_to_hf(cfg, ckpt_dir: str, out_dir: str, shard_bytes: int = DEFAULT_SHARD) -> None:
    """Streaming, whole tensors: the ranks run the TP = PP = EP = 1 layout (dist-ckpt reshards on
    load), build the model on the meta device, split its tensors between them (contiguous, by
    bytes) and, a group of at most shard_bytes at a time, load the group's whole tensors from
    the dist-ckpt, convert them to HF (the bridge) and write them as one safetensors file."""
    from megatron.core import dist_checkpointing

    bridge = build_bridge(cfg, perform_initialization=False)
    models = bridge.build_meta()
    state = _model_state(models)
    check_same_tensors(f"{ckpt_dir} does not match {os.path.join(cfg.model.path, 'config.json')}",
                       requested_keys(state), dist_ckpt_model_keys(ckpt_dir))
    if os.path.exists(os.path.join(ckpt_dir, MANIFEST)):  # a trainer checkpoint: its checksums, split
        why = verify_distributed(ckpt_dir)
        if why is not None:
            raise CheckpointError(f"{ckpt_dir} is not a usable checkpoint: {why}")
    (prefix, sharded), = state.items()  # one chunk at PP = 1
    sources = bridge.hf_sources(_unwrap(models[0]))
    # the reference checkpoint's dtype per tensor: a bf16 model comes back bf16 (the dist-ckpt may
    # hold fp32 master weights, the trainer's, or the fp32 copies of a conversion); its expert
    # layout: fused experts are written fused (a fused tensor's parts in one group)
    ref = HFReader(cfg.model.path)
    ref_dtypes, ref_sizes, layout = ref.dtypes(), ref.nbytes(), ref.layout
    entries = dict(_unwrap(models[0]).state_dict())
    names = [n for n in sharded if n in sources]
    units = _load_units(sharded, names, lambda n: {layout.parts[h].stored for h in sources[n][1] if h in layout.parts})
    sizes = [sum(_entry_bytes(entries[n]) for n in u) for u in units]
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = split_work(sizes, world, shard_bytes)
    carried = bridge.carried(ref_sizes)
    progress = Progress("mcore-to-hf", len(names) + len(carried), sum(sizes) + sum(ref_sizes[n] for n in carried),
                        show=rank == 0)
    partial = partial_dir(out_dir)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier()
    before, written = rss(), []
    for g in range(max(len(groups) for groups in plan)):  # lockstep: megatron's load is collective
        group = [n for i in plan[rank][g] for n in units[i]] if g < len(plan[rank]) else []
        loaded = dist_checkpointing.load({prefix: {n: _with_data(sharded[n]) for n in group}}, ckpt_dir,
                                         validate_access_integrity=False).get(prefix, {}) if group or world > 1 else {}
        hf, done = {}, torch.zeros(2, dtype=torch.int64)
        for n in group:
            tensor = loaded.pop(n)
            done += torch.tensor([1, _entry_bytes(tensor)])
            for k, v in dict(bridge.hf_from_whole(sources[n][0], tensor)).items():
                hf[k] = v.to(ref_dtypes.get(k, v.dtype))
        if hf:
            written.append(write_group(partial, rank, len(written), dict(layout.fuse(hf.items()))))
        del hf, loaded
        dist.all_reduce(done)
        progress.add(int(done[0]), int(done[1]))
    written += copy_carried(cfg.model.path, carried, ref_sizes, partial, len(written), shard_bytes, progress)
    progress.line()
    publish_index(partial, written)
    if rank == 0:
        bridge.write_config(partial)
        for f in TOKENIZER_FILES:
            src = os.path.join(cfg.model.path, f)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(partial, f))
    report_peak(before)
    _publish(partial, out_dir)


def describe_carried(names: list[str]) -> str:
    """'12 tensors (mtp.*: 11, model.visual.*: 1)': counts by their first two name parts."""
    kinds = {}
    for n in names:
        key = ".".join(n.split(".")[:2 if n.startswith("model.") else 1]) + ".*"
        kinds[key] = kinds.get(key, 0) + 1
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''} (" + ", ".join(f"{k}: {v}" for k, v in kinds.items()) + ")"


def copy_carried(ref_dir: str, carried: list[str], ref_sizes: dict[str, int], out_dir: str, first: int,
                 shard_bytes: int, progress: Progress) -> list[dict]:
    """Collective. The reference checkpoint's carried tensors (the model does not build them),
    unchanged: the ranks split them by bytes and write each group as one file; returns this
    rank's file entries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = split_work([ref_sizes[n] for n in carried], world, shard_bytes)[rank] if carried else []
    reader, written, done = HFReader(ref_dir), [], torch.zeros(2, dtype=torch.int64)
    for k, group in enumerate(groups):
        names = [carried[i] for i in group]
        written.append(write_group(out_dir, rank, first + k, dict(zip(names, reader.read(names)))))
        done += torch.tensor([len(names), sum(ref_sizes[n] for n in names)])
    dist.all_reduce(done)
    progress.add(int(done[0]), int(done[1]))
    return written


def whole_tensor_layout(cfg) -> None:
    """mcore-to-hf runs TP = PP = CP = EP = 1 whatever the overrides (they only had to divide the
    model): every rank reads whole tensors, the ranks share the tensors."""
    p = cfg.parallel
    p.tp = p.pp = p.cp = p.ep = 1
    p.etp = None
    p.sequence_parallel = False


def parse_bytes(text: str) -> int:
    """'512MiB', '1GiB', '2GB', '1000000' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    t = text.strip().lower()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="skyrl-mega convert")
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--hf", help="HF dir of the architecture (mcore-to-hf; default: src for hf-to-mcore)")
    p.add_argument("--shard-size", default=str(DEFAULT_SHARD), help="most bytes per output file, e.g. 512MiB")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    hf_dir = a.src if a.direction == "hf-to-mcore" else a.hf
    if not hf_dir:
        p.error("mcore-to-hf needs --hf <HF dir of the same architecture> (config + tokenizer)")
    cfg = load_config(None, [f"model.path={hf_dir}", *a.overrides])
    if a.direction == "mcore-to-hf":
        whole_tensor_layout(cfg)
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    try:
        if a.direction == "hf-to-mcore":
            hf_to_mcore(cfg, a.src, a.dst, parse_bytes(a.shard_size))
        else:
            mcore_to_hf(cfg, a.src, a.dst, parse_bytes(a.shard_size))
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
