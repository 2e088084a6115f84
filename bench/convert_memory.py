"""`skyrl-mega convert` memory: each rank's peak RSS while converting a synthetic multi-GB model.

What it runs: make-tiny writes a random Qwen3-MoE of the given shape (bf16) under --dir; then
hf-to-mcore and mcore-to-hf at each rank count of --ranks, through the real CLI (torchrun, gloo).
Reports, per run: the model's bytes, wall time, and each rank's peak RSS (VmHWM) with its RSS
before converting (after imports and the meta-device model build), from the convert's own
`[convert] peak RSS` line. The previous implementation built the whole model and loaded every HF
tensor: its peak was at least its ranks' share of the model above that baseline (its measured
peaks on this box: see BENCHMARKS.md). Scratch files stay under --dir (default /tmp), removed after.

CPU (2 ranks, ~2.4 GB bf16): python bench/convert_memory.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK = re.compile(r"rank (\d+) ([\d.]+) GiB \(before ([\d.]+)\)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/bench_convert_memory")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--shard-size", default="256MiB")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--moe-ffn", type=int, default=1024)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def convert(*args) -> tuple[float, list[dict]]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "convert", *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    took = time.perf_counter() - t
    if p.returncode:
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    line = [ln for ln in (p.stdout + p.stderr).splitlines() if "[convert] peak RSS" in ln][-1]
    return took, [{"rank": int(r), "peak_gib": float(a), "before_gib": float(b)} for r, a, b in PEAK.findall(line)]


def main(argv=None) -> None:
    a = parse_args(argv)
    from skyrl_mega.models.tiny import make_tiny

    hf = os.path.join(a.dir, "hf")
    if not os.path.exists(os.path.join(hf, "model.safetensors")):
        make_tiny("qwen3_moe", hf, dtype="bfloat16", hidden_size=a.hidden, intermediate_size=a.moe_ffn,
                  moe_intermediate_size=a.moe_ffn, num_hidden_layers=a.layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, num_experts=a.experts, num_experts_per_tok=4, mlp_only_layers=[])
    size = os.path.getsize(os.path.join(hf, "model.safetensors"))
    results = {"model_bytes": size, "shard_size": a.shard_size, "runs": []}
    for n in [int(x) for x in a.ranks.split(",")]:
        mcore, back = os.path.join(a.dir, f"mcore_{n}"), os.path.join(a.dir, f"hf_{n}")
        layout = [f"parallel.ep={n}"] if n > 1 else []
        for direction, src, dst, extra in (("hf-to-mcore", hf, mcore, []), ("mcore-to-hf", mcore, back, ["--hf", hf])):
            took, peaks = convert(direction, src, dst, "--nproc", str(n), "--shard-size", a.shard_size, *extra, *layout)
            run = {"direction": direction, "ranks": n, "seconds": round(took, 1), "per_rank": peaks}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
        shutil.rmtree(back, ignore_errors=True)
        shutil.rmtree(mcore, ignore_errors=True)
    print(json.dumps(results))
    if a.out:
        json.dump(results, open(a.out, "w"), indent=1)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
