"""Train-step overhead of R3 replay (vs live routing) and of THD packing (vs padding).

What it runs: one policy model (built with routing replay available) and one batch of
mixed-length samples (lengths uniform in [--min-len, --max-len], seeded), then full RL train
steps (`skyrl_mega.megatron.train_step.train_step`: forward+backward of the PPO loss through
megatron's schedules + distributed optimizer step; old logprobs = the batch's, no reference)
in four configurations, round-robin so that drift hits all alike:

  packed        THD packing, token-budget micro-batches (--max-tokens, default
                micro_batch_size * max_len: the padded baseline's per-micro-batch bound)
  packed+r3     the same, replaying routes for every token but the last (engine's L-1 rows):
                the model's own live routing recorded once before timing (--routes live, the
                default at TP=PP=1: same expert load, so the ratio is the replay mechanism's
                cost) or random valid experts (--routes random; used when TP or PP > 1)
  padded        one row per sample, --micro-batch-size rows per micro-batch padded to the
                longest (rounded to TP)
  padded+r3

Prints median step times and the ratios r3_overhead = packed+r3 / packed,
r3_overhead_padded = padded+r3 / padded, packing_speedup = padded / packed, and writes them as
JSON (--out). Ratios come from one run.

CPU (the default preset, tiny model, fp32):
    python bench/train_step_bench.py
GPU, one H200 (bf16, larger MoE; the lent machines need the carried wheels first):
    pip install --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 bench/train_step_bench.py --preset h200
More ranks: --nproc N plus overrides, e.g. `--nproc 2 parallel.ep=2` (re-launches itself
under torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PRESETS = {
    # tiny Qwen3-MoE of the tests: a CPU run takes about a minute
    "cpu": dict(hidden=64, ffn=128, moe_ffn=32, layers=4, heads=4, kv_heads=2, head_dim=16, experts=8, topk=2,
                vocab=512, dtype="float32", batch=32, min_len=16, max_len=256, micro_batch_size=4, steps=5,
                warmup=1),
    # one H200: 8 layers (layer 0 dense), 64 experts top-8, bf16, 64 samples of 256..4096 tokens
    "h200": dict(hidden=1024, ffn=4096, moe_ffn=512, layers=8, heads=16, kv_heads=4, head_dim=64, experts=64,
                 topk=8, vocab=32768, dtype="bfloat16", batch=64, min_len=256, max_len=4096, micro_batch_size=4,
                 steps=5, warmup=1),
}


def fill_preset(args, presets: dict):
    """Every option left unset takes the value of its --preset (seed 0 unless given)."""
    for k, v in presets[args.preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.seed = 0 if args.seed is None else args.seed
    return args


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("hidden", "ffn", "moe_ffn", "layers", "heads", "kv_heads", "head_dim", "experts", "topk", "vocab",
                 "batch", "min_len", "max_len", "micro_batch_size", "max_tokens", "steps", "warmup", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--model-dir", default=None, help="HF checkpoint to use / create (default: a cache dir)")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--configs", default="packed,packed+r3,padded,padded+r3")
    p.add_argument("--routes", choices=["live", "random"], default="live",
                   help="replayed routes: the model's own live routing (TP=PP=1) or random valid experts")
    p.add_argument("--out", default=None, help="write results JSON here (rank 0)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.ep=2")
    args = fill_preset(p.parse_args(argv), PRESETS)
    if args.max_tokens is None:
        args.max_tokens = args.micro_batch_size * args.max_len
    return args


def model_dir(args) -> str:
    if args.model_dir:
        return args.model_dir
    key = f"qwen3moe_h{args.hidden}_l{args.layers}_e{args.experts}k{args.topk}_v{args.vocab}"
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "bench", key)


def ensure_model(args) -> str:
    path = model_dir(args)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    from skyrl_mega.models.tiny import make_tiny

    make_tiny("qwen3_moe", path, hidden_size=args.hidden, intermediate_size=args.ffn,
              moe_intermediate_size=args.moe_ffn, num_hidden_layers=args.layers, num_attention_heads=args.heads,
              num_key_value_heads=args.kv_heads, head_dim=args.head_dim, num_experts=args.experts,
              num_experts_per_tok=args.topk, vocab_size=args.vocab, max_position_embeddings=max(1024, args.max_len),
              initializer_range=0.02)
    return path


def make_batch(args, num_moe_layers, dp_size, dp_rank):
    import torch

    from skyrl_mega.megatron.packing import shard_for_dp
    from skyrl_mega.megatron.train_step import RLBatch

    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=g).tolist()
    ids, mask, adv, rollout, routes = [], [], [], [], []
    for n in lens:
        prompt = max(1, n // 4)
        ids.append(torch.randint(0, args.vocab, (n,), generator=g))
        mask.append(torch.cat([torch.zeros(prompt), torch.ones(n - prompt)]))
        adv.append(torch.randn(1, generator=g))
        rollout.append(-2.0 + 0.1 * torch.randn(n, generator=g))
        r = torch.rand(n - 1, num_moe_layers, args.experts, generator=g).argsort(-1)[..., : args.topk]
        routes.append(r.to(torch.uint8 if args.experts <= 256 else torch.int16))
    full = RLBatch(ids, mask, adv, rollout_logprobs=rollout, routed_experts=routes)
    return full.select(shard_for_dp(lens, dp_size, dp_rank)), lens


def record_live_routes(policy, batch, cfg, args):
    """The model's own live routing of every token (engine-like L-1 rows), so that replay runs
    with the same expert load as live routing and the ratio isolates the replay mechanism.
    Needs every token and MoE layer on this rank (TP=PP=1); returns False otherwise."""
    import torch

    from skyrl_mega.megatron.r3_replay import route_positions
    from skyrl_mega.megatron.train_step import Parallelism, compute_logprobs, plan_step

    par = Parallelism.current(policy.bridge.config)
    if par.tp > 1 or par.pp > 1 or par.cp > 1:
        return False
    cfg.train.packing, cfg.train.max_tokens_per_microbatch = True, args.max_tokens
    plan = plan_step(batch, cfg, policy.bridge, par)
    with policy.replay.capturing() as cap:
        compute_logprobs(policy, batch, cfg, plan, replay=False)
    cols = {g: c for c, g in enumerate(policy.bridge.moe_layers)}
    routes = [torch.full((n, len(cols), args.topk), -1, dtype=torch.long) for n in batch.lengths]
    for layer, used_list in cap.items():
        for lay, used in zip(plan.layouts, used_list):
            pos = route_positions(lay)
            for k, seg in enumerate(lay.segments):
                sel = pos[:, 0] == k
                routes[seg.sample][pos[sel, 1], cols[layer]] = used[sel.to(used.device)].cpu()
    batch.routed_experts = [r[:-1] for r in routes]
    return True


def run(args):
    import torch

    from skyrl_mega.config import load_config
    from skyrl_mega.megatron import parallel
    from skyrl_mega.megatron.policy import build_policy
    from skyrl_mega.megatron.train_step import train_step

    path = ensure_model(args)
    cfg = load_config(None, [
        f"model.path={path}", f"model.dtype={args.dtype}", "optim.lr=1e-6", "algorithm.routing_replay=true",
        "algorithm.old_logprobs=rollout", f"train.micro_batch_size={args.micro_batch_size}", *args.overrides,
    ])
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    from megatron.core import parallel_state as mpu

    policy = build_policy(cfg, total_steps=10_000)
    batch, lens = make_batch(args, len(policy.bridge.moe_layers), mpu.get_data_parallel_world_size(),
                             mpu.get_data_parallel_rank())
    routes = "random"
    if args.routes == "live" and record_live_routes(policy, batch, cfg, args):
        routes = "live"
    configs = [c for c in args.configs.split(",") if c]
    times = {c: [] for c in configs}
    info = {}
    for step in range(args.warmup + args.steps):
        for name in configs:
            cfg.train.packing = name.startswith("packed")
            cfg.train.max_tokens_per_microbatch = args.max_tokens if cfg.train.packing else None
            cfg.algorithm.routing_replay = name.endswith("+r3")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            m = train_step(policy, batch, cfg)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if step >= args.warmup:
                times[name].append(dt)
            info[name] = {"num_microbatches": m["num_microbatches"], "tokens/padded": m["tokens/padded"],
                          "tokens/total": m["tokens/total"], "r3/coverage": m["r3/coverage"], "loss": m["loss"]}
            if rank == 0:
                print(f"step {step} {name:11s} {dt * 1e3:9.1f} ms  micro-batches {int(m['num_microbatches'])}  "
                      f"tokens {int(m['tokens/total'])} (+padding {int(m['tokens/padded'] - m['tokens/total'])})",
                      flush=True)
    med = {c: statistics.median(v) for c, v in times.items() if v}
    ratios = {}
    if "packed" in med and "packed+r3" in med:
        ratios["r3_overhead"] = med["packed+r3"] / med["packed"]
    if "padded" in med and "padded+r3" in med:
        ratios["r3_overhead_padded"] = med["padded+r3"] / med["padded"]
    if "packed" in med and "padded" in med:
        ratios["packing_speedup"] = med["padded"] / med["packed"]
    result = {
        "preset": args.preset, "world_size": world, "overrides": args.overrides, "replayed_routes": routes,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": args.dtype,
        "model": {k: getattr(args, k) for k in ("hidden", "layers", "experts", "topk", "vocab")},
        "batch": {"samples": args.batch, "min_len": args.min_len, "max_len": args.max_len,
                  "tokens": sum(lens), "micro_batch_size": args.micro_batch_size, "max_tokens": args.max_tokens},
        "median_step_s": med, "ratios": ratios, "per_config": info,
        "tokens_per_s": {c: sum(lens) / v for c, v in med.items()},
    }
    if torch.cuda.is_available():
        result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if rank == 0:
        for c, v in med.items():
            print(f"median {c:11s} {v * 1e3:9.1f} ms")
        for k, v in ratios.items():
            print(f"{k} = {v:.3f}")
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    parallel.destroy()


def main(argv=None):
    args = parse_args(argv)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from skyrl_mega.launcher import run_torchrun

        ensure_model(args)  # once, before the ranks start
        argv, child = list(argv if argv is not None else sys.argv[1:]), []
        while argv:  # the ranks do not get --nproc (torchrun would take it for --nproc-per-node)
            a = argv.pop(0)
            if a == "--nproc":
                argv.pop(0)
            elif not a.startswith("--nproc="):
                child.append(a)
        argv = child
        run_torchrun(os.path.abspath(__file__), args.nproc, argv, timeout=3600, check=True, stream=True,
                     env={"PYTHONUNBUFFERED": "1"})
        return
    run(args)


if __name__ == "__main__":
    main()
