"""Rollout throughput on CPU: through vllm-router vs direct to one server, with and without
route capture (R3). Not a test: prints a table and the ratios.

    python bench/rollout_throughput.py [--model DIR] [--prompts 64] [--n 4] [--max-tokens 64]

Configurations (each run `--repeats` times round-robin after a warm-up; median tokens/s):
    direct      client -> server 0
    router x1   client -> vllm-router -> server 0          (the router's own cost)
    router xN   client -> vllm-router -> servers 0..N-1    (scale-out on this box)
each with `--enable-return-routed-experts` (client decodes the routes) and without: two
server sets, both up for the whole run, measured round-robin. Each set's N servers are
pinned to disjoint core slices (ServerManager's default), so "direct" runs on server 0's
slice only. Generated tokens/s counts sampled tokens (ignore_eos, so
every sample has exactly max_tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from skyrl_mega.rollout.client import RolloutClient, SamplingParams  # noqa: E402
from skyrl_mega.rollout.router import RouterProcess  # noqa: E402
from skyrl_mega.rollout.servers import ServerConfig, ServerManager  # noqa: E402


def make_prompts(k: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(16, 48))).tolist() for _ in range(k)]


async def one_run(url, prompts, sampling, capture, concurrency):
    async with RolloutClient(url, max_concurrency=concurrency, deadline_s=900, return_routed_experts=capture,
                             moe_layers=[1, 2, 3] if capture else None, num_experts=8 if capture else None) as c:
        t0 = time.perf_counter()
        gens = await c.generate_batch(prompts, sampling)
        dt = time.perf_counter() - t0
    tokens = sum(len(s.token_ids) for g in gens for s in g.samples)
    if capture:
        assert all(s.routed_experts is not None for g in gens for s in g.samples)
    return tokens / dt


def measure(targets, prompts, sampling, repeats, concurrency):
    """targets: {(path, capture): url}; round-robin over targets, `repeats` times, after a warm-up."""
    for (_, capture), url in targets.items():
        asyncio.run(one_run(url, prompts[: max(4, len(prompts) // 8)], sampling, capture, concurrency))
    runs = {k: [] for k in targets}
    for _ in range(repeats):
        for key, url in targets.items():
            runs[key].append(asyncio.run(one_run(url, prompts, sampling, key[1], concurrency)))
    return {k: statistics.median(v) for k, v in runs.items()}, runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: make-tiny qwen3_moe with head_dim=32)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="rollout_bench_")
    model = args.model
    if model is None:
        from skyrl_mega.models.tiny import make_tiny

        model = make_tiny("qwen3_moe", os.path.join(tmp, "tiny"), head_dim=32)  # CPU attention needs >= 32
    log_dir = args.log_dir or os.path.join(tmp, "logs")
    prompts = make_prompts(args.prompts)
    sampling = SamplingParams(max_tokens=args.max_tokens, n=args.n, temperature=1.0, seed=0, ignore_eos=True)

    # Both server sets stay up together (idle engines block on their input queue) and the
    # six targets are measured round-robin, so box-load drift hits every configuration alike.
    t0 = time.time()
    managers, routers, targets = [], [], {}
    try:
        for capture in (True, False):
            tag = "capture" if capture else "no_capture"
            cfg = ServerConfig(model=model, dtype="float32", max_model_len=512, return_routed_experts=capture)
            sm = ServerManager(cfg, num_servers=args.servers, log_dir=os.path.join(log_dir, tag), startup_timeout_s=900)
            managers.append(sm.start())
            r1 = RouterProcess(sm.urls[:1], log_dir=os.path.join(log_dir, tag, "r1")).start()
            rn = RouterProcess(sm.urls, log_dir=os.path.join(log_dir, tag, "rn")).start()
            routers += [r1, rn]
            targets[("direct", capture)] = sm.urls[0]
            targets[("router x1", capture)] = r1.url
            targets[(f"router x{args.servers}", capture)] = rn.url
        print(f"{2 * args.servers} servers + 4 routers up in {time.time() - t0:.0f}s", flush=True)
        med, runs = measure(targets, prompts, sampling, args.repeats, args.concurrency)
    finally:
        for r in routers:
            r.stop()
        for sm in managers:
            sm.stop()
    results = med
    for (k, cap), v in med.items():
        print(f"[{'capture' if cap else 'no_capture'}] {k:>10}: {v:8.1f} tok/s  runs {[round(x, 1) for x in runs[(k, cap)]]}")

    n = args.servers
    print()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.prompts} prompts x n={args.n} x {args.max_tokens} tokens, concurrency {args.concurrency}")
    print(f"{'path':>12} {'capture tok/s':>14} {'no-capture tok/s':>17} {'capture cost':>13}")
    for k in ("direct", "router x1", f"router x{n}"):
        on, off = results[(k, True)], results[(k, False)]
        print(f"{k:>12} {on:14.1f} {off:17.1f} {on / off:13.3f}")
    print()
    for cap, tag in ((True, "capture"), (False, "no capture")):
        d = results[("direct", cap)]
        print(f"[{tag}] router x1 / direct = {results[('router x1', cap)] / d:.3f}; "
              f"router x{n} / direct = {results[(f'router x{n}', cap)] / d:.3f}")


if __name__ == "__main__":
    main()
