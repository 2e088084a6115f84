"""`skyrl-mega convert` memory: each rank's peak RSS while converting a synthetic multi-GB model.

What it runs: make-tiny writes a random Qwen3-MoE of the given shape (bf16) under --dir; then
hf-to-mcore and mcore-to-hf at each rank count of --ranks, through the real CLI (torchrun, gloo).
Reports, per run: the model's bytes, wall time, and each rank's peak RSS (VmHWM) with its RSS
before converting (after imports and the meta-device model build), from the convert's own
`[convert] peak RSS` line. The previous implementation built the whole model and loaded every HF
tensor: its peak was at least its ranks' share of the model above that baseline (its measured
peaks on this box: see BENCHMARKS.md). Scratch files stay under --dir (default /tmp), removed after.

With --memory-cap GIB (root, Linux memory cgroup v1 or v2): each convert runs inside a memory
cgroup of that size (the launcher and all its ranks together; no swap on the box), so a convert
that would need the whole model in one rank's memory is killed by the kernel; the run reports
completed or OOM-killed, the cgroup's peak, and checks the round trip bit-exact tensor by
tensor. --repo runs another checkout's CLI (e.g. a worktree of the previous convert).

CPU (2 ranks, ~2.4 GB bf16): python bench/convert_memory.py [--ranks 2 --memory-cap 3.5]
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
    p.add_argument("--memory-cap", type=float, default=None, help="GiB for each convert (launcher + ranks)")
    p.add_argument("--repo", default=REPO, help="the checkout whose CLI runs (default: this one)")
    return p.parse_args(argv)


class MemoryCgroup:
    """A memory cgroup (v2 if mounted, else v1's memory controller) capping what is moved in."""

    def __init__(self, name: str, limit_bytes: int):
        v2 = os.path.exists("/sys/fs/cgroup/cgroup.controllers")
        self.path = os.path.join("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/memory", name)
        self.v2 = v2
        os.makedirs(self.path, exist_ok=True)
        self._write("memory.max" if v2 else "memory.limit_in_bytes", str(limit_bytes))

    def _write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def _read(self, name) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def enter(self):  # preexec_fn: the child moves itself in before exec
        self._write("cgroup.procs", str(os.getpid()))

    def peak_bytes(self) -> int | None:
        for name in (("memory.peak",) if self.v2 else ("memory.max_usage_in_bytes",)):
            try:
                return int(self._read(name))
            except OSError:
                return None

    def oom_kills(self) -> int:
        text = self._read("memory.events" if self.v2 else "memory.oom_control")
        m = re.search(r"oom_kill (\d+)", text)
        return int(m.group(1)) if m else 0

    def remove(self):
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def convert(*args, repo: str = REPO, cap: "MemoryCgroup | None" = None) -> tuple[float, list[dict], str | None]:
    """(seconds, per-rank peaks, None) or, when the convert failed under a cap, (seconds, [], why)."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "convert", *args], capture_output=True, text=True,
                       cwd=repo, env={**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": repo},
                       preexec_fn=cap.enter if cap else None)
    took = time.perf_counter() - t
    if p.returncode:
        if cap is not None:
            tail = (p.stdout + p.stderr).strip().splitlines()
            return took, [], f"exit {p.returncode}, OOM kills {cap.oom_kills()}: {tail[-1][:200] if tail else ''}"
        raise SystemExit(p.stdout[-3000:] + p.stderr[-3000:])
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "[convert] peak RSS" in ln]
    peaks = [{"rank": int(r), "peak_gib": float(a), "before_gib": float(b)} for r, a, b in PEAK.findall(lines[-1])] \
        if lines else []
    return took, peaks, None


def round_trip_difference(a_dir: str, b_dir: str) -> str | None:
    """None when every tensor of the HF checkpoint in a_dir equals b_dir's bit for bit (read one
    at a time), else what differs."""
    import glob

    import torch
    from safetensors import safe_open

    def index(d):
        out = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            with safe_open(f, "pt") as h:
                out.update({k: f for k in h.keys()})
        return out

    ia, ib = index(a_dir), index(b_dir)
    if set(ia) != set(ib):
        return f"names differ: only in {a_dir}: {sorted(set(ia) - set(ib))[:3]}, only in {b_dir}: " \
               f"{sorted(set(ib) - set(ia))[:3]}"
    for k in ia:
        with safe_open(ia[k], "pt") as ha, safe_open(ib[k], "pt") as hb:
            x, y = ha.get_tensor(k), hb.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape:
                return f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}"
            if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
                return f"{k}: values differ"
    return None


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
            cap = MemoryCgroup(f"skyrl_convert_{os.getpid()}_{n}_{direction}", int(a.memory_cap * 2**30)) \
                if a.memory_cap else None
            try:
                shard = ["--shard-size", a.shard_size] if a.shard_size else []  # "": a CLI without the flag
                took, peaks, failed = convert(direction, src, dst, "--nproc", str(n), *shard, *extra, *layout,
                                              repo=a.repo, cap=cap)
                run = {"direction": direction, "ranks": n, "seconds": round(took, 1), "per_rank": peaks}
                if cap is not None:
                    peak = cap.peak_bytes()
                    run.update({"memory_cap_gib": a.memory_cap, "completed": failed is None, "failure": failed,
                                "cgroup_peak_gib": round(peak / 2**30, 2) if peak else None})
            finally:
                if cap is not None:
                    cap.remove()
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            if failed:
                break
        else:
            diff = round_trip_difference(hf, back)
            results["round_trip_bit_exact"], results["round_trip_difference"] = diff is None, diff
            print(json.dumps({"ranks": n, "round_trip_bit_exact": diff is None, "difference": diff}), flush=True)
        shutil.rmtree(back, ignore_errors=True)
        shutil.rmtree(mcore, ignore_errors=True)
    print(json.dumps(results))
    if a.out:
        json.dump(results, open(a.out, "w"), indent=1)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
