"""Weight sync into a REAL vLLM GPU engine by CUDA IPC (colocated: trainer and engine on one GPU).

    python bench/vllm_weight_sync.py --out runs/bench_ws_vllm
    (no --model: the largest qwen3_moe shape of 15b / 8b / 2b that fits this GPU's free memory,
     made under runs/; one line and exit 2 when none fits; --size picks one)
    python bench/vllm_weight_sync.py --model runs/qwen3_moe_2b --out runs/bench_ws_vllm
    (make the model first: skyrl-mega make-tiny qwen3_moe runs/qwen3_moe_2b --size 2b
     --dtype bfloat16 --device cuda; ~2.45B parameters, 4.6 GiB bf16)
    python bench/vllm_weight_sync.py --model runs/qwen3_moe_8b --random --out ...
    (--random: a --config-only model dir; the engine starts with --load-format dummy and the
     trainer from random init: no checkpoint on disk, for the large shapes)

One process: a world-size-1 Megatron trainer (bf16, local spec, distributed-optimizer DDP, so
its parameters sit in one contiguous buffer) and one vLLM server started with the project's
`skyrl_bucket` weight-transfer backend. The trainer's weights are the checkpoint's plus noise,
so the engine differs from the trainer until a sync lands. Measured in this one run:
- a plain device-to-device copy of the model's byte count (torch copy_, the ceiling; in pieces of
  at most 40% of the free memory for the largest shapes), GB/s;
- the first sync (verified; vLLM's layer-wise reload, after which the engine learns where each
  tensor lands: vllm_engine.py), then, with new trainer weights, the end-to-end sync (pause,
  plan check, export, CUDA IPC rounds copied straight into vLLM's parameters, finish, resume),
  unverified, median of --repeats, GB/s and the ratio to D2D; the same with the engine as it is
  in colocated training (asleep, weights woken: its sleep holds scheduling, so no /pause,
  prefix-cache reset or /resume), then the KV cache woken and the engine's logprobs checked;
- a verified sync (per-tensor checksums on both ends) and a corrupted bucket (one byte flipped
  after the checksums were taken) that must fail while the engine keeps its version;
- the engine's sampled-token logprobs vs the trainer's own (Megatron) logprobs on the same
  tokens: before any sync (they differ) and after (bf16 agreement);
- control: the same weights sent by direct copies and then through vLLM's reload
  (receive="reload"): the engine's seeded samples and logprobs must be the same.
Writes OUT/results.json and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def engine_notes(log_dir: str) -> list[str]:
    """The engine's own lines about how it loads the weights (reload or direct copies)."""
    out = []
    for root, _, files in os.walk(log_dir):
        for f in files:
            with open(os.path.join(root, f), errors="replace") as fh:
                out += [ln.strip()[-240:] for ln in fh if "skyrl_bucket:" in ln]
    return out


# qwen3_moe shapes the benchmark can make itself (models/tiny.py SIZES), largest first; those
# over 4 GiB are made --config-only (random weights: dummy engine load, random trainer init)
SYNC_SIZES = ("15b", "8b", "2b")
WITH_WEIGHTS = ("2b",)
# GPU bytes per parameter while the benchmark runs, bf16: the trainer's weights and gradients
# (megatron DDP buffers, 2 + 2) and the engine's weights plus the second copy vLLM's layer-wise
# reload holds during the first sync (2 + 2): on an 80 GB H100 the 9.9B-parameter 8b shape held
# about 39 GB in the trainer and 39 GB in the engine, and ran out of memory
BYTES_PER_PARAM = 8
FIXED_BYTES = 6 << 30  # the engine's KV cache (2 GiB), CUDA contexts, allocator slack


def need_bytes(params: int) -> int:
    return params * BYTES_PER_PARAM + FIXED_BYTES


def pick_size(free_bytes: int, params_of) -> tuple[str | None, str]:
    """The largest of SYNC_SIZES that fits `free_bytes` of GPU memory (`params_of(size)`: its
    parameter count), and a one-line reason; None and what the smallest needs when none fits."""
    for size in SYNC_SIZES:
        need = need_bytes(params_of(size))
        if need <= free_bytes:
            return size, f"size {size}: needs {need / 2**30:.1f} GiB of the {free_bytes / 2**30:.1f} GiB free"
    smallest = SYNC_SIZES[-1]
    return None, (f"the smallest shape ({smallest}, {params_of(smallest) / 1e9:.2f}B parameters) needs "
                  f"{need_bytes(params_of(smallest)) / 2**30:.1f} GiB of GPU memory, {free_bytes / 2**30:.1f} GiB free")


def ensure_size_model(size: str, models_dir: str) -> tuple[str, bool]:
    """Makes runs/qwen3_moe_<size> on the GPU when missing; returns (dir, random weights)."""
    from skyrl_mega.models.tiny import make_tiny

    path = os.path.join(models_dir, f"qwen3_moe_{size}")
    random = size not in WITH_WEIGHTS
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny("qwen3_moe", path, size=size, dtype="bfloat16", device="cuda", weights=not random)
    return path, random


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="an HF dir; default: the --size shape, made here")
    ap.add_argument("--size", default="auto", choices=("auto",) + SYNC_SIZES,
                    help="qwen3_moe shape when no --model: auto picks the largest that fits this GPU")
    ap.add_argument("--models-dir", default="runs")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--random", action="store_true", help="no checkpoint: dummy engine weights, random trainer")
    ap.add_argument("--worker-channel", action=argparse.BooleanOptionalAction, default=True,
                    help="rounds to the engine worker's own listener (rollout.worker_channel, the default); "
                         "--no-worker-channel: every round through vLLM's /collective_rpc")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    import torch

    if a.model is None:
        from skyrl_mega.models.tiny import parameter_count

        free = torch.cuda.mem_get_info()[0]
        size = a.size
        if size == "auto":
            size, why = pick_size(free, lambda s: parameter_count("qwen3_moe", s))
            print(f"[bench] {why}" if size else f"bench/vllm_weight_sync.py: {why}", flush=True,
                  file=sys.stdout if size else sys.stderr)
            if size is None:
                return 2
        a.model, a.random = ensure_size_model(size, a.models_dir)

    from bridges import bridge_for
    from skyrl_mega.compat.megatron_core import CPU_CONFIG
    from skyrl_mega.controller.placement import PlacementPlan
    from skyrl_mega.megatron import forward, parallel
    from skyrl_mega.rollout.client import RolloutClient, SamplingParams
    from skyrl_mega.rollout.control import EngineControl
    from skyrl_mega.rollout.errors import WeightSyncError
    from skyrl_mega.rollout.servers import ServerConfig, ServerManager
    from skyrl_mega.weight_sync import CudaIpcTransport, sync_weights
    from skyrl_mega.weight_sync.export import get_exporter
    from tests.support.faults import faulty, first_packed_offset

    res: dict = {"device": torch.cuda.get_device_name(), "model": a.model, "worker_channel": a.worker_channel}

    def save():
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    parallel.init_layout()
    plan = PlacementPlan("colocated", "gpu", "cuda_ipc", None)
    cfg = ServerConfig(model=a.model, dtype="bfloat16", device="gpu", max_model_len=512, kv_cache_gib=2,
                       enforce_eager=True, return_routed_experts=False, sleep_mode=True,
                       extra_args=plan.server_args() + (["--load-format", "dummy"] if a.random else []))
    t = time.perf_counter()
    sm = ServerManager(cfg, log_dir=os.path.join(a.out, "engine_logs"), startup_timeout_s=600,
                       needs=("rollout", "control", "weight_transfer")).start()
    res["engine_start_s"] = time.perf_counter() - t
    try:
        ctl = EngineControl(sm.urls, caps=sm.caps, timeout_s=600)
        res["vllm"] = sm.caps.version
        no_fusions = {k: v for k, v in CPU_CONFIG.items() if k != "use_cpu_initialization"}
        bridge = bridge_for(a.model, dtype=torch.bfloat16, spec="local", sequence_parallel=False, **no_fusions)
        t = time.perf_counter()
        models = bridge.build(load_weights=not a.random, wrap_with_ddp=True, ddp_config=dict(
            use_distributed_optimizer=True, grad_reduce_in_fp32=False, overlap_grad_reduce=False,
            overlap_param_gather=False, average_in_collective=False))
        res["trainer_build_s"] = time.perf_counter() - t
        torch.cuda.empty_cache()  # the params megatron copied into its DDP buffer: memory for the engine
        g = torch.Generator(device="cuda").manual_seed(1)

        def perturb():  # new trainer weights: the engine differs until a sync lands
            with torch.no_grad():
                for p in models[0].parameters():
                    p.add_(torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype)
                           * a.noise)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

        if not a.random:
            perturb()

        prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(24)] for i in range(8)]
        sp = SamplingParams(max_tokens=32, n=1, temperature=1.0, seed=11)

        def engine_samples():
            async def go():
                async with RolloutClient(sm.urls[0], deadline_s=300, return_routed_experts=False) as c:
                    return await c.generate_batch(prompts, sp)
            return asyncio.run(go())

        def trainer_logprobs(prompt, tokens):
            ids = torch.tensor([prompt + tokens], device="cuda")
            pos = torch.arange(ids.shape[1], device="cuda")[None]
            with torch.no_grad():
                out = forward.run_microbatches(models, [{"input_ids": ids, "position_ids": pos}],
                                               lambda mb, o: o.detach().float(), forward_only=True,
                                               collect_non_loss_data=True)
            lp = torch.log_softmax(out[0][0], -1)
            p = len(prompt)
            return lp[p - 1: p - 1 + len(tokens)].gather(1, torch.tensor(tokens, device="cuda")[:, None])[:, 0]

        def agreement(label):
            gens = engine_samples()
            d = torch.cat([(torch.tensor(s.logprobs, device="cuda") - trainer_logprobs(gn.prompt_token_ids,
                                                                                       s.token_ids)).abs()
                           for gn in gens for s in gn.samples])
            res[label] = {"tokens": int(d.numel()), "max_abs": float(d.max()), "mean_abs": float(d.mean())}
            print(f"[bench] {label}: {res[label]}", flush=True)
            save()

        agreement("logprobs_before_sync")
        transport = faulty(CudaIpcTransport)(ctl, zero_copy=True, timeout_s=600, channel=a.worker_channel)
        bucket = a.bucket_mb << 20

        def timed(version, verify=False):
            transport.verify = verify
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = sync_weights(bridge, models, transport, version=version, bucket_bytes=bucket)
            torch.cuda.synchronize()
            return time.perf_counter() - t0, m

        dt, m = timed(1, verify=True)  # plans, IPC handles, first reload: also the verified sync
        res["verified_sync"] = {"seconds": dt, "versions": ctl.weight_versions(), "bytes": m["weight_sync/bytes"],
                                "tensors": m["weight_sync/tensors"], "buckets": m["weight_sync/buckets"]}
        assert set(res["verified_sync"]["versions"].values()) == {"1"}, res["verified_sync"]
        agreement("logprobs_after_sync")
        perturb()
        nbytes = int(m["weight_sync/bytes"])
        runs = [timed(2 + i) for i in range(a.repeats)]
        times = [t for t, _ in runs]
        res["sync"] = {"seconds": times, "median_s": statistics.median(times),
                       "GBps": nbytes / statistics.median(times) / 1e9, "bytes": nbytes,
                       "transport_timings": transport.timings,
                       "metrics": {k: v for k, v in runs[-1][1].items() if isinstance(v, (int, float))}}
        agreement("logprobs_after_direct_sync")
        # colocated as in training: engine asleep, weights woken, the sync, then the KV cache woken;
        # the sleep holds scheduling paused, so the sync sends no /pause, reset or /resume
        held, wake = [], []
        for i in range(a.repeats):
            perturb()
            ctl.sleep(1)
            ctl.wake_up(tags=["weights"])
            if not ctl.held_by_sleep:
                raise RuntimeError("the engine's sleep did not hold scheduling paused")
            held.append(timed(50 + i))
            t0 = time.perf_counter()
            ctl.wake_up(tags=["kv_cache"])
            wake.append(time.perf_counter() - t0)
        times = [t for t, _ in held]
        res["held_sync"] = {"seconds": times, "median_s": statistics.median(times),
                            "GBps": nbytes / statistics.median(times) / 1e9, "transport_timings": transport.timings,
                            "wake_kv_s": wake, "paused_after_wake": ctl.is_paused(),
                            "versions": ctl.weight_versions()}
        agreement("logprobs_after_held_sync")
        dt, _ = timed(2 + a.repeats, verify=True)  # direct copies, read back and checksummed by the engine
        res["verified_direct_sync"] = {"seconds": dt, "versions": ctl.weight_versions()}
        res["engine_receive"] = engine_notes(os.path.join(a.out, "engine_logs"))

        # the copy ceiling: nbytes copied device to device, in pieces as large as free memory allows
        piece = min(nbytes, int(torch.cuda.mem_get_info()[0] * 0.4))
        src = torch.empty(piece, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        ts = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            left = nbytes
            while left > 0:
                n = min(left, piece)
                dst[:n].copy_(src[:n])
                left -= n
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        del src, dst
        torch.cuda.empty_cache()
        res["d2d"] = {"median_s": statistics.median(ts), "GBps": nbytes / statistics.median(ts) / 1e9,
                      "piece_bytes": piece}
        res["sync_vs_d2d"] = res["d2d"]["median_s"] / res["sync"]["median_s"]
        res["held_sync_vs_d2d"] = res["d2d"]["median_s"] / res["held_sync"]["median_s"]
        print(f"[bench] sync {res['sync']['GBps']:.1f} GB/s, d2d {res['d2d']['GBps']:.1f} GB/s: "
              f"{100 * res['sync_vs_d2d']:.1f}%; engine held by its sleep: {res['held_sync']['GBps']:.1f} GB/s, "
              f"{100 * res['held_sync_vs_d2d']:.1f}%", flush=True)
        save()

        before = ctl.weight_versions()
        # a bucket with a packed (staged) tensor: direct tensors are read from the trainer's own
        # parameters, so flipping a byte there would change the trainer, not the transfer
        sync_plan = get_exporter(bridge, models, bucket, "auto").plan()
        transport.corrupt_bucket = next(b.index for b in sync_plan.buckets if first_packed_offset("ipc", b) is not None)
        res["corrupt_bucket"] = transport.corrupt_bucket
        try:
            timed(99, verify=True)
            res["corrupt"] = {"caught": False}
        except WeightSyncError as e:
            res["corrupt"] = {"caught": True, "error": str(e)[:300]}
        transport.corrupt_bucket = None
        res["corrupt"]["versions_before"] = before
        res["corrupt"]["versions_after"] = ctl.weight_versions()
        res["corrupt"]["paused_after"] = ctl.is_paused()
        ctl.resume()  # a failed update leaves the engines paused on the old version
        agreement("logprobs_after_corrupt")
        dt, _ = timed(100, verify=True)
        res["recovered_sync"] = {"seconds": dt, "versions": ctl.weight_versions()}
        save()

        # control: the same trainer weights through direct copies, then through vLLM's reload;
        # the engine's own (seeded) samples and logprobs must not change
        def engine_logprobs():
            return [(s.token_ids, s.logprobs) for gn in engine_samples() for s in gn.samples]

        def compare(first, second) -> dict:  # samples with the same tokens, their largest logprob gap
            same = [(a[1], b[1]) for a, b in zip(first, second) if a[0] == b[0]]
            return {"samples": len(first), "same_tokens": len(same),
                    "max_abs_logprob_diff": max((abs(x - y) for a, b in same for x, y in zip(a, b)), default=None)}

        timed(101)
        direct = engine_logprobs()
        res["engine_repeat_same_weights"] = compare(direct, engine_logprobs())  # no sync between the two
        print(f"[bench] engine repeat, no sync: {res['engine_repeat_same_weights']}", flush=True)
        reload_t = CudaIpcTransport(ctl, zero_copy=True, timeout_s=600, receive="reload")
        reload_t.verify = True
        sync_weights(bridge, models, reload_t, version=102, bucket_bytes=bucket)
        res["direct_vs_reload_same_weights"] = compare(direct, engine_logprobs())
        print(f"[bench] direct vs reload, same weights: {res['direct_vs_reload_same_weights']}", flush=True)
        save()
    finally:
        sm.stop()
        parallel.destroy()
    print(json.dumps(res, indent=1, default=str))
    ok = (res.get("corrupt", {}).get("caught") and res["corrupt"]["versions_after"] == res["corrupt"]["versions_before"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
