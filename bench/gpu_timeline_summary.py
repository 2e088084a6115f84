"""Summarise the GPU timelines that `weight_sync_bench.py --profile` writes.

In: <phase>_gpu_timeline.json (trainer rank 0) and <phase>_rx_gpu_timeline.json (receiver), each
[name, device, stream, start us, duration us] per GPU operation. Out (stdout): every broadcast
kernel on each side with its duration, rate and the gap before it, what else ran on that GPU
while it ran (copies and other kernels, by total time), the CUDA API calls that blocked the
CPU, and the totals: time in broadcast
kernels vs the first-to-last span, i.e. how much of the sync the wire was idle.

    python bench/gpu_timeline_summary.py <out dir> [--phase nccl]
"""

from __future__ import annotations

import argparse
import json
import os


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def is_collective(name: str) -> bool:
    return name.startswith("ncclDevKernel") or name.startswith("ncclKernel")


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def summarize(ops: list[list], label: str, bucket_bytes: list[int] | None = None) -> dict:
    colls = [o for o in ops if is_collective(o[0])]
    others = [o for o in ops if not is_collective(o[0])]
    print(f"== {label}: {len(colls)} collective kernels, {len(others)} other operations")
    rows, prev_end = [], None
    for i, (name, _dev, stream, t, d) in enumerate(colls):
        gap = None if prev_end is None else t - prev_end
        busy: dict[str, float] = {}
        for o in others:
            ov = overlap(t, t + d, o[3], o[3] + o[4])
            if ov > 0:
                kind = "copy " + o[0].split("(")[0].replace("Memcpy ", "").strip() if o[0].startswith("Memcpy") else "kernel"
                busy[kind] = busy.get(kind, 0.0) + ov
        rate = ""
        if bucket_bytes and i < len(bucket_bytes) and d > 0:
            rate = f"{bucket_bytes[i] / d / 1e3:7.1f} GB/s"
        gap_s = "" if gap is None else f"gap {gap:7.1f}"
        others_s = ", ".join(f"{k} {v:.0f}" for k, v in sorted(busy.items(), key=lambda kv: -kv[1]))
        print(f"  {i:2d} {name[:28]:28s} start {t:9.1f} dur {d:8.1f} {rate} {gap_s}  | {others_s}")
        rows.append({"start": t, "dur": d, "gap": gap, "busy": busy})
        prev_end = t + d
    if colls:
        span = colls[-1][3] + colls[-1][4] - colls[0][3]
        in_k = sum(c[4] for c in colls)
        gaps = sum(r["gap"] or 0 for r in rows)
        print(f"  span {span:.0f} us, in collectives {in_k:.0f} us, gaps {gaps:.0f} us, "
              f"first collective at {colls[0][3]:.0f} us after the first GPU op")
    return {"rows": rows}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--phase", default="nccl")
    ap.add_argument("--blocking-us", type=float, default=100.0, help="list CUDA API calls at least this long")
    a = ap.parse_args(argv)
    sizes = None
    res = os.path.join(a.out, f"{a.phase}.json")
    if os.path.exists(res):
        with open(res) as f:
            plan = json.load(f).get("plan") or {}
        sizes = plan.get("bucket_bytes")
    names = [(f"{a.phase}_gpu_timeline.json", "trainer rank 0"), (f"{a.phase}_rx_gpu_timeline.json", "receiver")]
    names += [(f, f"trainer rank 0, {f.split('_')[1]}") for f in sorted(os.listdir(a.out))
              if f.startswith(f"{a.phase}_slots") and f.endswith("_gpu_timeline.json")]
    for name, label in names:
        path = os.path.join(a.out, name)
        if os.path.exists(path):
            tl = load(path)
            summarize(tl["gpu"], label, sizes)
            blocking = [x for x in tl.get("api", []) if x[2] >= a.blocking_us]
            if blocking:
                print(f"  CPU calls that took >= {a.blocking_us:.0f} us: "
                      + ", ".join(f"{n} at {t:.0f} for {d:.0f}" for n, t, d in blocking[:40]))


if __name__ == "__main__":
    main()
