"""Colocated RL on one GPU, measured: runs `skyrl-mega train` on a recipe and summarises its metrics.

    python bench/gpu_colocated_rl.py --recipe qwen3_moe/tiny_gpu --out runs/bench_rl_tiny [overrides...]
    python bench/gpu_colocated_rl.py --recipe qwen3_moe/1b_gpu --make 1b --out runs/bench_rl_1b

--make SIZE first writes the recipe's model (make-tiny of the recipe's family, bf16, initialised on
the GPU) when missing; `--make tiny` for the tiny_gpu recipes.
Out: OUT/summary.json and a markdown table on stdout: reward first 5 -> last 5 steps (and the
ratio), R3 coverage (min over steps), rollout-vs-train logprob difference (mean and max over
steps), per-phase seconds (rollout, train, sync, engine sleep / wake of weights / wake of KV cache;
medians over steps after the first), the trainer's peak and the device's memory in each phase
(max over steps), what sleeping freed, and whether the first and last syncs were verified.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summarise(rows: list[dict]) -> dict:
    def col(k):
        return [r[k] for r in rows if k in r]

    def med(k):
        v = col(k)[1:] or col(k)
        return statistics.median(v) if v else None

    rewards = col("reward/mean")
    k = min(5, len(rewards) // 2) or 1
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    out = {"steps": len(rows), "reward_first5": first, "reward_last5": last,
           "reward_ratio": last / max(first, 1e-9),
           "r3_coverage_min": min(col("r3/coverage"), default=None),
           "logprob_diff_mean": statistics.mean(col("logprob_diff_mean")) if col("logprob_diff_mean") else None,
           "logprob_diff_max": max(col("logprob_diff_max"), default=None),
           "initial_sync_verified": rows[0].get("initial_sync/verified") if rows else None,
           "last_sync_verified": rows[-1].get("weight_sync/verified") if rows else None,
           "sync_gbps": med("weight_sync/GBps"), "sync_bytes": med("weight_sync/bytes")}
    for name, key in [("rollout", "time/rollout_s"), ("train", "time/train_s"), ("sync", "weight_sync/seconds"),
                      ("sleep", "time/engine/sleep_s"), ("wake_weights", "time/engine/wake_weights_s"),
                      ("wake_kv", "time/engine/wake_kv_s"), ("step", "time/step_s")]:
        out[f"seconds_{name}"] = med(key)
    for k in sorted({k for r in rows for k in r if k.startswith("mem/") or k.endswith("_freed_gib")}):
        out[k] = max(col(k))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--make", default=None, help="model size to write first when model.path is missing")
    ap.add_argument("--timeout", type=float, default=3000)
    a, overrides = ap.parse_known_args()
    os.makedirs(a.out, exist_ok=True)
    py = [sys.executable, "-m", "skyrl_mega.cli"]
    sys.path.insert(0, REPO)
    from skyrl_mega.config import load_config

    cfg = load_config(a.recipe, [f"output_dir={a.out}", *overrides])
    if a.make and not os.path.exists(os.path.join(cfg.model.path, "config.json")):
        t = time.perf_counter()
        family = a.recipe.split("/")[0]
        subprocess.run(py + ["make-tiny", family, cfg.model.path, "--size", a.make, "--dtype", "bfloat16",
                             "--device", "cuda"], check=True, cwd=REPO)
        print(f"[bench] made {a.make} model in {time.perf_counter() - t:.1f}s", flush=True)
    t = time.perf_counter()
    rc = subprocess.run(py + ["train", "--recipe", a.recipe, f"output_dir={a.out}", *overrides],
                        cwd=REPO, timeout=a.timeout).returncode
    wall = time.perf_counter() - t
    path = os.path.join(a.out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
    s = {"recipe": a.recipe, "overrides": overrides, "rc": rc, "wall_s": wall, **summarise(rows)}
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    print("| metric | value |\n|---|---|")
    for k, v in s.items():
        print(f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |")
    return rc


if __name__ == "__main__":
    sys.exit(main())
