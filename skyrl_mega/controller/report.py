"""The end-of-run summary on rank 0: reward first vs last steps, logprob agreement, R3 coverage,
and where the metrics, plot, checkpoint and HF export are.

In: the config, the MetricsLogger of the run, the checkpoint root. Out: lines on stdout, plot.png.
"""

from __future__ import annotations

import os

from ..checkpoint.dist_ckpt import step_dir
from .metrics import plot_metrics, read_metrics


def finish_report(cfg, metrics_log, ckpt_root: str, steps: int, hf_dir: str) -> None:
    metrics_log.close()
    rows = read_metrics(metrics_log.path)
    rewards = [r["reward/mean"] for r in rows]
    k = min(5, len(rewards) // 2) or 1
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    print(f"\n[skyrl-mega] mean reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f} "
          f"({last / max(first, 1e-9):.1f}x)")
    diffs = [r.get("logprob_diff_max", float("nan")) for r in rows]
    print(f"[skyrl-mega] max |rollout - train| logprob over steps: {max(diffs):.2e}; "
          f"R3 coverage min {min(r.get('r3/coverage', float('nan')) for r in rows):.3f}")
    if cfg.logging.plot:
        print(f"[skyrl-mega] plot:        {plot_metrics(metrics_log.path, os.path.join(cfg.output_dir, 'plot.png'))}")
    print(f"[skyrl-mega] metrics:     {metrics_log.path}")
    print(f"[skyrl-mega] checkpoint:  {step_dir(ckpt_root, steps)}")
    if cfg.checkpoint.hf_export_at_end:
        print(f"[skyrl-mega] HF export:   {hf_dir}")
