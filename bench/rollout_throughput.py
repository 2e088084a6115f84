"""Rollout throughput: through vllm-router vs direct to one server, with and without route
capture (R3). Not a test: prints a table and the ratios.

    python bench/rollout_throughput.py [--model DIR] [--prompts 64] [--n 4] [--max-tokens 64]
    python bench/rollout_throughput.py --device gpu --dtype bfloat16 --servers 1 --model DIR \
        --prompts 256 --n 8 --max-tokens 256 --concurrency 512        # one GPU, CUDA graphs

Configurations (each run `--repeats` times round-robin after a warm-up):
    direct      client -> server 0
    router x1   client -> vllm-router -> server 0          (the router's own cost)
    router xN   client -> vllm-router -> servers 0..N-1    (scale-out on this box)
each with `--enable-return-routed-experts` (the client decodes and maps the routes) and
without: two server sets, both up for the whole run (idle engines use ~1% CPU), measured
round-robin so load drift hits every configuration alike. Each set's N servers are pinned
to disjoint core slices (ServerManager's default), so "direct" runs on server 0's slice.

Two measures per run:
    tok/s        generated tokens / wall seconds (ignore_eos: every sample has max_tokens)
    CPU ms/ktok  CPU seconds consumed per 1000 generated tokens by every process on the
                 path: the servers' process groups (API server + EngineCore + Worker), the
                 router, and this client process. Far less sensitive than tok/s to other
                 jobs on a shared box: it prices the work, not the wait.
Both are medians over the repeats.
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

_TICK = os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgids: set[int], pids: set[int] = frozenset()) -> float:
    """utime+stime (s) of every live process in the given process groups, or with the given pids."""
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) in pgids or int(d) in pids:  # fields[2] = pgrp; [11], [12] = utime, stime
            total += int(fields[11]) + int(fields[12])
    return total / _TICK


def make_prompts(k: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(16, 48))).tolist() for _ in range(k)]


ROUTES: dict = {}  # moe_layers and num_experts of the model (read from its config.json in main)


async def one_run(url, prompts, sampling, capture, concurrency):
    routes = ROUTES if capture else {"moe_layers": None, "num_experts": None}
    async with RolloutClient(url, max_concurrency=concurrency, deadline_s=900, return_routed_experts=capture,
                             **routes) as c:
        gens = await c.generate_batch(prompts, sampling)
    if capture:
        assert all(s.routed_experts is not None for g in gens for s in g.samples)
    return sum(len(s.token_ids) for g in gens for s in g.samples)


def timed_run(target, prompts, sampling, concurrency):
    url, capture, pgids, pids = target["url"], target["capture"], target["pgids"], target["pids"]
    cpu0, client0, t0 = group_cpu_s(pgids, pids), time.process_time(), time.perf_counter()
    tokens = asyncio.run(one_run(url, prompts, sampling, capture, concurrency))
    wall = time.perf_counter() - t0
    cpu = group_cpu_s(pgids, pids) - cpu0 + time.process_time() - client0
    return tokens / wall, 1e6 * cpu / tokens  # tok/s, CPU ms per 1000 tokens


def measure(targets, prompts, sampling, repeats, concurrency):
    for t in targets.values():  # warm-up
        timed_run(t, prompts[: max(4, len(prompts) // 8)], sampling, concurrency)
    runs = {k: [] for k in targets}
    for _ in range(repeats):
        for key, t in targets.items():
            runs[key].append(timed_run(t, prompts, sampling, concurrency))
    med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for k, v in runs.items()}
    return med, runs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF checkpoint dir (default: make-tiny qwen3_moe with head_dim=32)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs")
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--log-dir", default=None)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="rollout_bench_")
    model = args.model
    if model is None:
        from skyrl_mega.models.tiny import make_tiny

        model = make_tiny("qwen3_moe", os.path.join(tmp, "tiny"), head_dim=32)  # CPU attention needs >= 32
    import json

    from skyrl_mega.rollout.r3_wire import moe_layer_ids

    hf = json.load(open(os.path.join(model, "config.json")))
    ROUTES.update(moe_layers=moe_layer_ids(hf), num_experts=int(next(hf[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in hf)))
    log_dir = args.log_dir or os.path.join(tmp, "logs")
    prompts = make_prompts(args.prompts)
    sampling = SamplingParams(max_tokens=args.max_tokens, n=args.n, temperature=1.0, seed=0, ignore_eos=True)
    n = args.servers
    paths = ("direct", "router x1", f"router x{n}")

    t0 = time.time()
    managers, routers, targets = [], [], {}
    try:
        for capture in (True, False):
            tag = "capture" if capture else "no_capture"
            cfg = ServerConfig(model=model, dtype=args.dtype, max_model_len=1024, return_routed_experts=capture,
                               device=args.device, kv_cache_gib=args.kv_cache_gib,
                               enforce_eager=True if args.eager or args.device == "cpu" else False)
            sm = ServerManager(cfg, num_servers=n, log_dir=os.path.join(log_dir, tag), startup_timeout_s=900)
            managers.append(sm.start())
            r1 = RouterProcess(sm.urls[:1], log_dir=os.path.join(log_dir, tag, "r1")).start()
            rn = RouterProcess(sm.urls, log_dir=os.path.join(log_dir, tag, "rn")).start()
            routers += [r1, rn]
            pg = [s.child.pid for s in sm.servers]
            targets[("direct", capture)] = dict(url=sm.urls[0], capture=capture, pgids={pg[0]}, pids=set())
            targets[("router x1", capture)] = dict(url=r1.url, capture=capture, pgids={pg[0]}, pids={r1.child.pid})
            targets[(paths[2], capture)] = dict(url=rn.url, capture=capture, pgids=set(pg), pids={rn.child.pid})
        print(f"{2 * n} servers + 4 routers up in {time.time() - t0:.0f}s", flush=True)
        med, runs = measure(targets, prompts, sampling, args.repeats, args.concurrency)
    finally:
        for r in routers:
            r.stop()
        for sm in managers:
            sm.stop()

    for (k, cap), (tps, cpu) in med.items():
        print(f"[{'capture' if cap else 'no_capture':>10}] {k:>10}: {tps:7.0f} tok/s {cpu:7.1f} CPU ms/ktok   "
              f"runs tok/s {[round(r[0]) for r in runs[(k, cap)]]} CPU ms/ktok {[round(r[1], 1) for r in runs[(k, cap)]]}")
    print()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; {args.prompts} prompts x n={args.n} x "
          f"{args.max_tokens} tokens, concurrency {args.concurrency}, {args.repeats} repeats")
    print(f"{'path':>10} | {'tok/s cap':>9} {'no cap':>7} {'ratio':>6} | {'CPU ms/ktok cap':>15} {'no cap':>7} {'ratio':>6}")
    for k in paths:
        (a, ca), (b, cb) = med[(k, True)], med[(k, False)]
        print(f"{k:>10} | {a:9.0f} {b:7.0f} {a / b:6.3f} | {ca:15.1f} {cb:7.1f} {ca / cb:6.3f}")
    print()
    for cap, tag in ((True, "capture"), (False, "no capture")):
        d_t, d_c = med[("direct", cap)]
        r1_t, r1_c = med[("router x1", cap)]
        rn_t, rn_c = med[(paths[2], cap)]
        print(f"[{tag}] tok/s ratio: router x1 / direct = {r1_t / d_t:.3f}, {paths[2]} / direct = {rn_t / d_t:.3f}; "
              f"CPU per token ratio: router x1 / direct = {r1_c / d_c:.3f}, {paths[2]} / direct = {rn_c / d_c:.3f}")


if __name__ == "__main__":
    main()
