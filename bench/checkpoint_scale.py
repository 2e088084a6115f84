"""Checkpoint save + resume of a multi-GB trainer state: where the integrity checks' time goes.

What it runs (torchrun, --ranks ranks on gloo, EP = ranks): a random-init Qwen3-MoE of the given
shape with megatron's distributed optimizer (Adam state created), then
  save     `save_checkpoint` (each rank checksums the files it wrote; rank 0 writes the manifest)
  resume   the trainer's `resume` (auto: rank 0 proposes the newest complete one, all ranks
           split its checksums, then `load_checkpoint`: weights, optimizer, scheduler, RNG)
and, on the same files, the checks the previous scheme ran, timed on their own:
  rank0_crc_all     rank 0 checksums every file (what the previous save did after the barrier)
  full_verify       one rank checksums every file (previous resume: rank 0 in find_latest, then
                    every rank again in load_checkpoint; previous prune: once per kept checkpoint)
  split_verify      `verify_distributed` (this scheme's resume check, all ranks)
Prints and writes (--out) the checkpoint's bytes, each phase's seconds (max over ranks), each
rank's peak RSS, and the previous scheme's save / resume estimated as this run's phases with its
checks in place of this scheme's: save_before = save - own_crc + rank0_crc_all, resume_before =
resume - split_verify + 2 x full_verify. Ratios come from this one run.

CPU (2 ranks, ~4.4 GB checkpoint): python bench/checkpoint_scale.py --ranks 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--dir", default="runs/bench_checkpoint", help="scratch dir (model, checkpoints); removed after")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--moe-ffn", type=int, default=384)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def run(args) -> None:
    import torch.distributed as dist

    from skyrl_mega.checkpoint import dist_ckpt
    from skyrl_mega.compat import megatron_core as mcore_compat
    from skyrl_mega.config import load_config
    from skyrl_mega.controller.steps import resume
    from skyrl_mega.megatron import parallel
    from skyrl_mega.megatron.model import build_model
    from skyrl_mega.megatron.optimizer import build_optimizer
    from skyrl_mega.weight_sync.collectives import all_gather_json

    cfg = load_config(None, [f"model.path={os.path.join(args.dir, 'model')}", f"parallel.ep={args.ranks}",
                             "checkpoint.resume=auto"])
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=0)
    _, models = build_model(cfg, load_weights=False)
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps=10)
    mcore_compat.ensure_optimizer_state(optimizer)
    root = os.path.join(args.dir, "ckpt")
    t = {}
    t["save"], path = _timed(lambda: dist_ckpt.save_checkpoint(root, 1, models, optimizer, scheduler, {"x": 1}))
    files = json.load(open(os.path.join(path, dist_ckpt.MANIFEST)))["files"]
    own = [rel for rel in files if dist_ckpt._writer(rel) % world == rank]
    t["own_crc"], _ = _timed(lambda: [dist_ckpt._crc32(os.path.join(path, rel)) for rel in own])
    dist.barrier()
    t["rank0_crc_all"], _ = _timed(lambda: dist_ckpt.verify_checkpoint(path) if rank == 0 else None)
    dist.barrier()
    t["full_verify"], _ = _timed(lambda: dist_ckpt.verify_checkpoint(path))
    dist.barrier()
    t["split_verify"], _ = _timed(lambda: dist_ckpt.verify_distributed(path))
    t["resume"], _ = _timed(lambda: resume(cfg, root, models, optimizer, scheduler))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss in KiB)
    everyone = all_gather_json({"t": t, "rss_gib": rss})
    if rank == 0:
        worst = {k: max(e["t"][k] for e in everyone) for k in t}
        result = {
            "ranks": world, "bytes": sum(f["bytes"] for f in files.values()), "files": len(files),
            "seconds_max_over_ranks": worst, "peak_rss_gib_per_rank": [e["rss_gib"] for e in everyone],
            "save_before_est_s": worst["save"] - worst["own_crc"] + worst["rank0_crc_all"],
            "resume_before_est_s": worst["resume"] - worst["split_verify"] + 2 * worst["full_verify"],
        }
        result["save_speedup"] = result["save_before_est_s"] / worst["save"]
        result["resume_speedup"] = result["resume_before_est_s"] / worst["resume"]
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    parallel.destroy()


def main(argv=None):
    args = parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        return run(args)
    from skyrl_mega.launcher import run_torchrun
    from skyrl_mega.models.tiny import make_tiny

    os.makedirs(args.dir, exist_ok=True)
    try:
        make_tiny("qwen3_moe", os.path.join(args.dir, "model"), weights=False, hidden_size=args.hidden,
                  intermediate_size=4 * args.hidden, moe_intermediate_size=args.moe_ffn,
                  num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                  num_experts=args.experts, num_experts_per_tok=8, vocab_size=args.vocab)
        run_torchrun(os.path.abspath(__file__), args.ranks, sys.argv[1:] if argv is None else argv, timeout=3600,
                     check=True, stream=True, env={"PYTHONUNBUFFERED": "1"})
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
