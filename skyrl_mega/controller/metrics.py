"""Metrics sinks on the controller: JSONL always, TensorBoard when installed, W&B when
configured, a progress bar, and a PNG plot at the end.

In: one dict of floats per step. Out: <output_dir>/metrics.jsonl (appended; a resumed run
continues it), tensorboard/ events, and plot.png (reward, response length, KL, rollout-vs-
train logprob difference over steps).
"""

from __future__ import annotations

import json
import os

PLOT_KEYS = [("reward/mean", "reward"), ("response_length/mean", "response length"),
             ("kl", "KL"), ("logprob_diff_mean", "|rollout - train| logprob")]


class MetricsLogger:
    def __init__(self, cfg, total_steps: int, start_step: int = 0):
        self.dir = cfg.output_dir
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, "metrics.jsonl")
        if start_step == 0 and os.path.exists(self.path):
            os.replace(self.path, self.path + ".previous")
        elif start_step > 0 and os.path.exists(self.path):  # keep only steps before the resume point
            rows = [json.loads(line) for line in open(self.path) if line.strip()]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] < start_step)
        self.file = open(self.path, "a")
        self.tb = self._tensorboard() if cfg.logging.tensorboard else None
        self.wandb = self._wandb(cfg) if cfg.logging.wandb_project else None
        self.bar = None
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="RL", unit="step", dynamic_ncols=True)

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(os.path.join(self.dir, "tensorboard"))
        except Exception:  # tensorboard not installed
            return None

    def _wandb(self, cfg):
        import wandb  # configured explicitly: fail loudly when missing

        return wandb.init(project=cfg.logging.wandb_project, dir=self.dir, resume="allow")

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(row, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{row.get('reward/mean', float('nan')):.3f}",
                                 step_s=f"{row.get('time/step_s', float('nan')):.1f}")

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def plot_metrics(jsonl_path: str, png_path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, PLOT_KEYS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", markersize=3)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
