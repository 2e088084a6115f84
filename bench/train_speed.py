"""RL train-step speed of the layer specs (local vs fast, and te where it imports) in one run.

What it runs: one random-init Qwen3-MoE of the --preset's shape and one packed batch with R3
replaying random valid routes (balanced expert load, the same routes for every spec), then for
each spec in --specs: the policy built from the same HF weights, --warmup + --steps full RL
train steps (`train_step.train_step`: packed THD micro-batches of --max-tokens, forward+backward
of the PPO loss, distributed optimizer step), the policy freed before the next spec. Before the
specs it measures the ceiling: the median of bf16 [8192 x 8192] @ [8192 x 8192] matmuls.

Per spec it prints and writes (--out, JSON): median step time, tokens/s, model TFLOP/s and its
fraction of the measured ceiling, peak memory, and the step's phases (plan: host work before
the first forward; forward+backward; optimizer). `--specs` also takes `fast-unfused` (the fast
spec with model.fused_kernels=off); `--profile` adds the host-device sync counts of one step. Model FLOPs per step: 6 x the matmul parameters
each token uses (attention projections, the top-k experts' and the dense layers' MLPs, the router
and the LM head: fwd 2 + bwd 4 FLOPs per parameter) x tokens, plus causal attention
6 x L^2 x heads x head_dim per layer for every sequence of length L. Ratios between specs come
from this one run.

GPU, one H200 (the carried wheels first; see BENCHMARKS.md):
    PYTHONPATH=/tmp/site:$PWD python3 bench/train_speed.py --preset h200_4k
CPU smoke run (tiny model, fp32; no ceiling fraction worth reading):
    python bench/train_speed.py --preset cpu
A family at its released width (FAMILY_SHAPES: fewer layers, real vocabulary), one GPU:
    python3 bench/train_speed.py --preset h200_4k --family nemotron3 --specs local
(--preset cpu --family F: the family's tiny model). Each family's fraction of the ceiling comes
from its own run's ceiling measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.train_step_bench import PRESETS as STEP_PRESETS  # noqa: E402
from bench.train_step_bench import ensure_model, fill_preset, make_batch  # noqa: E402

PRESETS = {
    "cpu": dict(STEP_PRESETS["cpu"], batch=8, min_len=64, max_len=64, steps=2, warmup=1, max_tokens=256),
    # ~1.63B MoE (16 layers, layer 0 dense, 64 experts top-8), 32 sequences of 4096 tokens
    "h200_4k": dict(STEP_PRESETS["h200"], layers=16, batch=32, min_len=4096, max_len=4096, steps=3, warmup=1,
                    max_tokens=16384),
    # ~2.37B MoE with hidden 2048 (8 layers, layer 0 dense, 64 experts of 2048 x 768, top-8), the same batch
    "h200_2b_4k": dict(STEP_PRESETS["h200"], hidden=2048, ffn=6144, moe_ffn=768, layers=8, heads=16, kv_heads=4,
                       head_dim=128, batch=32, min_len=4096, max_len=4096, steps=3, warmup=1, max_tokens=16384),
}


# --family F: the family's released width (make-tiny SIZES, real vocabularies) with fewer layers,
# so one GPU holds it with its optimizer state; every layer kind of the release appears
FAMILY_SHAPES = {
    # Qwen3-30B-A3B's layer shapes (128 experts of 768, top-8, hidden 2048), 3 layers, its vocabulary
    "qwen3_moe": ("15b", dict(num_hidden_layers=3, vocab_size=151936)),
    # Qwen3.5-35B-A3B's (256 experts of 512, top-8, hidden 2048, GDN + gated attention), 2 layers
    "qwen3_5_moe": ("35b_a3b", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])),
    # Nemotron-3-Nano-30B-A3B's (128 experts of 1856, top-6, hidden 2688, Mamba2 + attention), 4 layers
    "nemotron3": ("30b_a3b", dict(layers_block_type=["mamba", "moe", "attention", "moe"])),
}


# spec variants: a model.spec value and the overrides that make the variant
VARIANTS = {"fast-unfused": ("fast", ["model.fused_kernels=off"])}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    for name in ("hidden", "ffn", "moe_ffn", "layers", "heads", "kv_heads", "head_dim", "experts", "topk", "vocab",
                 "batch", "min_len", "max_len", "max_tokens", "steps", "warmup", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--family", choices=sorted(FAMILY_SHAPES), default=None,
                   help="a family's released width with fewer layers (FAMILY_SHAPES; tiny with --preset cpu) "
                        "instead of the preset's Qwen3-MoE shape")
    p.add_argument("--specs", default="local,fast",
                   help="comma-separated model.spec values (or " + ", ".join(VARIANTS) + "), timed in this order")
    p.add_argument("--model-dir", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--profile", default=None, help="profile one more step of the last spec; tables written here")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.recompute_granularity=full")
    return fill_preset(p.parse_args(argv), PRESETS)


def matmul_params_per_token(a) -> int:
    """Matmul parameters one token goes through (embedding lookup excluded)."""
    attn = a.hidden * (a.heads + 2 * a.kv_heads) * a.head_dim + a.heads * a.head_dim * a.hidden
    moe = a.topk * 3 * a.hidden * a.moe_ffn + a.hidden * a.experts
    dense = 3 * a.hidden * a.ffn
    return a.layers * attn + (a.layers - 1) * moe + dense + a.hidden * a.vocab


def model_flops(a, lengths) -> float:
    linear = 6.0 * matmul_params_per_token(a) * sum(lengths)
    attention = 6.0 * a.layers * a.heads * a.head_dim * sum(n * n for n in lengths)
    return linear + attention


def family_model(args) -> str:
    """The --family model (random weights, bf16 on a GPU), made once under .cache/bench; sets
    args.experts / topk / vocab (the batch's routes and ids) from its config."""
    import torch

    from skyrl_mega.config.validate import num_experts, read_hf_config
    from skyrl_mega.models.tiny import make_tiny

    size, overrides = FAMILY_SHAPES[args.family] if args.preset != "cpu" else ("tiny", {})
    args.family_size = size
    path = args.model_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache",
                                          "bench", f"{args.family}_{size}_{args.dtype}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_tiny(args.family, path, size=size, dtype=args.dtype, device="cuda" if torch.cuda.is_available() else "cpu",
                  max_position_embeddings=max(4096, args.max_len), **overrides)
    hf = read_hf_config(path)
    args.experts, args.topk, args.vocab = num_experts(hf), hf["num_experts_per_tok"], hf["vocab_size"]
    return path


def family_flops(hf: dict, lengths) -> tuple[float, int]:
    """(model FLOPs of one step, matmul parameters a token goes through) for a family's config:
    6 x (every layer's dense parameters + its routed experts' times top-k / experts + the output
    layer) per token (parameter counts: config/memory.py, equal to transformers'), plus causal
    attention 6 x L^2 x heads x head_dim on each full-attention layer. Not counted: the Gated
    DeltaNet / Mamba2 state updates (linear in L; their projections are counted), so the
    fraction of the ceiling is a lower bound for the hybrids."""
    from skyrl_mega.config.memory import model_shape, nemotron_pattern
    from skyrl_mega.config.validate import num_experts

    shape = model_shape(hf)
    share = hf["num_experts_per_tok"] / num_experts(hf)
    per_token = int(sum(la.dense + la.experts * share for la in shape.layers) + shape.head)
    if hf["model_type"] == "nemotron_h":
        attention_layers = nemotron_pattern(hf).count("*")
    else:
        attention_layers = list(hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]).count(
            "full_attention")
    q = hf["num_attention_heads"] * (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    return 6.0 * per_token * sum(lengths) + 6.0 * attention_layers * q * sum(n * n for n in lengths), per_token


def matmul_ceiling_tflops(n: int = 8192, reps: int = 20) -> float:
    import torch

    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x @ y
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
               "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def profile_step(policy, batch, cfg, path: str) -> None:
    """One train step under torch.profiler: the top ops by device and by host self time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from skyrl_mega.megatron.train_step import train_step

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        train_step(policy, batch, cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in avg) / 1e6
    with open(path, "w") as f:
        f.write(f"wall {wall:.3f} s (profiled), device busy {busy:.3f} s ({busy / wall:.0%})\n")
        if torch.cuda.is_available():
            for key in ("self_device_time_total", "self_cuda_time_total"):  # the name moved in torch 2.4
                try:
                    f.write(avg.table(sort_by=key, row_limit=45, max_name_column_width=70) + "\n")
                    break
                except (AttributeError, KeyError, ValueError):
                    continue
        f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70) + "\n")
        # what makes the host wait for the device: each of these drains the GPU's queue
        f.write("host-device syncs (calls, host ms):\n")
        for e in avg:
            if any(s in e.key for s in SYNC_EVENTS):
                f.write(f"  {e.key:40s} {e.count:7d} {e.cpu_time_total / 1e3:10.1f}\n")


def step_phases(m: dict) -> dict:
    """The train step's phases (seconds) from its metrics: the plan (micro-batch layout, R3
    route alignment: host work before the first forward), forward+backward, optimizer."""
    fb, opt = m["time/forward_backward"], m["time/optimizer"]
    return {"plan": m["time/step"] - fb - opt - m["time/old_logprobs"] - m["time/ref_logprobs"],
            "fwd_bwd": fb, "optimizer": opt}


def time_spec(spec: str, args, path: str, flops: float, lengths) -> dict:
    import torch

    from skyrl_mega.config import load_config
    from skyrl_mega.megatron.policy import build_policy
    from skyrl_mega.megatron.train_step import train_step

    model_spec, variant = VARIANTS.get(spec, (spec, []))
    cfg = load_config(None, [
        f"model.path={path}", f"model.dtype={args.dtype}", f"model.spec={model_spec}", "optim.lr=1e-6",
        "algorithm.routing_replay=true", "algorithm.old_logprobs=rollout", "train.packing=true",
        f"train.max_tokens_per_microbatch={args.max_tokens}", *variant, *args.overrides,
    ])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    policy = build_policy(cfg, total_steps=10_000)
    batch, _ = make_batch(args, len(policy.bridge.moe_layers), 1, 0)
    times, phase_times = [], []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        m = train_step(policy, batch, cfg)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        phases = step_phases(m)
        print(f"{spec:6s} step {step} {dt * 1e3:9.1f} ms  micro-batches {int(m['num_microbatches'])}  "
              f"r3 {m['r3/coverage']:.3f}  loss {m['loss']:.4f}  "
              + "  ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items()), flush=True)
        if step >= args.warmup:
            times.append(dt)
            phase_times.append(phases)
    if args.profile and spec == args.specs.split(",")[-1]:
        profile_step(policy, batch, cfg, args.profile)
    med = statistics.median(times)
    out = {"median_step_s": med, "step_s": times, "tokens_per_s": sum(lengths) / med,
           "model_tflops": flops / med / 1e12, "r3_coverage": m["r3/coverage"],
           "num_microbatches": m["num_microbatches"], "spec_built": policy.bridge.spec,
           "phases_s": {k: statistics.median(p[k] for p in phase_times) for k in phase_times[0]}}
    if cuda:
        out["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del policy, batch
    if cuda:
        torch.cuda.empty_cache()
    return out


def run(args) -> dict:
    import torch

    from skyrl_mega.config import load_config
    from skyrl_mega.megatron import parallel

    from skyrl_mega.config.validate import read_hf_config

    path = family_model(args) if args.family else ensure_model(args)
    parallel.init_distributed()
    parallel.init_model_parallel(load_config(None, [f"model.path={path}"]).parallel, seed=0)
    _, lengths = make_batch(args, 1, 1, 0)
    if args.family:
        hf = read_hf_config(path)
        flops, per_token = family_flops(hf, lengths)
        model = {"family": args.family, "size": args.family_size, **{k: hf.get(k) for k in (
            "hidden_size", "num_hidden_layers", "layer_types", "layers_block_type", "num_experts", "n_routed_experts",
            "num_experts_per_tok", "moe_intermediate_size", "vocab_size") if hf.get(k) is not None}}
    else:
        flops, per_token = model_flops(args, lengths), matmul_params_per_token(args)
        model = {k: getattr(args, k) for k in ("hidden", "layers", "experts", "topk", "moe_ffn", "vocab")}
    ceiling = matmul_ceiling_tflops() if torch.cuda.is_available() else None
    result = {"preset": args.preset, "torch": torch.__version__, "dtype": args.dtype,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": model, "matmul_params_per_token": per_token, "tokens": sum(lengths),
              "model_tflop_per_step": flops / 1e12, "matmul_ceiling_tflops": ceiling, "specs": {}}
    if ceiling:
        print(f"bf16 matmul ceiling {ceiling:.1f} TFLOP/s", flush=True)
    for spec in [s for s in args.specs.split(",") if s]:
        # megatron pins the attention backend in these variables when it builds a model and
        # refuses a later model of another backend in the same process: each spec sets its own
        for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(k, None)
        r = time_spec(spec, args, path, flops, lengths)
        if ceiling:
            r["fraction_of_ceiling"] = r["model_tflops"] / ceiling
        result["specs"][spec] = r
        print(f"{spec:6s} median {r['median_step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tokens/s, "
              f"{r['model_tflops']:.1f} TFLOP/s" + (f" = {r['fraction_of_ceiling']:.1%} of the ceiling" if ceiling else ""),
              flush=True)
    s = result["specs"]
    if "local" in s and "fast" in s:
        result["fast_speedup"] = s["local"]["median_step_s"] / s["fast"]["median_step_s"]
        print(f"fast / local speed-up {result['fast_speedup']:.2f}x", flush=True)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    parallel.destroy()
    return result


if __name__ == "__main__":
    run(parse_args())
