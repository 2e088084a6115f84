"""The collective steps of the RL loop that the controller (rank 0) decides and every rank runs.

In: the config, the controller (rank 0; None elsewhere), the policy. Out, on every rank: the
checkpoint resumed from (loaded) and its step, a step's rollout (rank 0 only holds the batch)
after retries, a weight sync after retries, periodic and final checkpoints, and a failure of
any step rank 0 runs alone raised on every rank. Rank 0's decisions reach the other ranks as
broadcast integers (and its error as UTF-8 bytes), so every rank takes the same branch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..checkpoint import find_latest, load_checkpoint, save_checkpoint, verify_checkpoint
from ..checkpoint.dist_ckpt import step_dir, verify_distributed
from ..devices import current_device
from ..errors import PeerFailed, UserError, claim_error_file, one_line, report_now
from ..rollout.errors import RolloutError, WeightSyncError
from ..weight_sync.sync import sync_weights
from .log import log0


class Rank0Failed(PeerFailed):
    """Raised on every rank but 0 when rank 0 failed in a step it runs alone."""


def bcast_int(value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=current_device())
    dist.broadcast(t, 0)
    return int(t.item())


def _bcast_text(text: str | None) -> str:
    """Rank 0's text to every rank, as UTF-8 bytes in a uint8 tensor (no pickle)."""
    data = (text or "").encode()[:8192] if dist.get_rank() == 0 else b""
    n = bcast_int(len(data))
    t = torch.zeros(n, dtype=torch.uint8, device=current_device())
    if dist.get_rank() == 0 and n:
        t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(t, 0)
    return bytes(t.cpu().tolist()).decode(errors="replace")


def raise_everywhere(failed: bool, error: BaseException | None, what: str) -> None:
    """Collective, after rank 0 ran `what` alone: when it failed, rank 0 re-raises its error and
    every other rank raises Rank0Failed with that error as the message, so no rank is left
    waiting in the next collective."""
    if not bcast_int(int(failed)):
        return
    if isinstance(error, UserError):  # reported once, as one line, by the launcher
        claim_error_file(one_line(error))
    elif error is not None:  # printed before the others stop: torchrun may end rank 0 early
        report_now(error)
    message = _bcast_text(f"{type(error).__name__}: {error}" if error is not None else "")
    if dist.get_rank() == 0:
        raise error
    raise Rank0Failed(f"rank 0 failed in {what}: {message}")


def on_rank0(what: str, fn, *args):
    """Collective: `fn(*args)` on rank 0 only; every rank learns whether it worked, and a failure
    stops every rank with rank 0's error (raise_everywhere). Returns fn's result on rank 0."""
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn(*args)
        except Exception as e:  # noqa: BLE001 - reported to every rank, then re-raised on rank 0
            error = e
    raise_everywhere(error is not None, error, what)
    return result


def resume_path(cfg, ckpt_root: str) -> str | None:
    """Collective: the checkpoint to resume from, the same on every rank, or None.
    checkpoint.resume=auto: the newest in ckpt_root that verifies: rank 0 proposes the newest
    complete one (manifest and sizes), all ranks check its checksums together
    (verify_distributed), a failing one is skipped for the next older; none: None; anything
    else: that path (which may be in another run's dir)."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        return None
    if choice != "auto":
        return choice
    below = None
    while True:
        step = -1
        if dist.get_rank() == 0:
            path = find_latest(ckpt_root, log=log0, verify=lambda p: verify_checkpoint(p, deep=False), below=below)
            step = int(os.path.basename(path.rstrip("/")).split("_")[-1]) if path else -1
        step = bcast_int(step)
        if step < 0:
            return None
        why = verify_distributed(step_dir(ckpt_root, step))
        if why is None:
            return step_dir(ckpt_root, step)
        log0(f"[checkpoint] skipping {step_dir(ckpt_root, step)}: {why}")
        below = step



def resume(cfg, ckpt_root: str, models, optimizer, scheduler) -> tuple[int, dict]:
    """Collective: loads the checkpoint to resume from (verified by all ranks together, so a bad
    one is the same CheckpointError everywhere); returns (its step, trainer state)."""
    path = resume_path(cfg, ckpt_root)
    if path is None:
        return 0, {}
    # auto: resume_path verified it already (all ranks, checksums split)
    state = load_checkpoint(path, models, optimizer, scheduler, verify=cfg.checkpoint.resume != "auto")
    log0(f"loaded checkpoint {path}")
    return int(state["step"]), state


def rollout_with_retries(cfg, ctrl, policy, step: int, version: int):
    """Collective. A failed rollout (e.g. a dead server) restarts servers, re-syncs weights, retries."""
    sampler_state = ctrl.sampler.state() if ctrl is not None else None
    for attempt in range(cfg.rollout.max_step_retries + 1):
        result, retry, error = None, 0, None
        if ctrl is not None:
            try:
                result = ctrl.rollout(step)
            except RolloutError as e:
                retry = 1
                log0(f"step {step}: rollout failed (attempt {attempt + 1}): {str(e)[:300]}")
                try:
                    restarted = ctrl.engines.restart_dead()
                    log0(f"restarted servers {restarted}; re-syncing weights version {version}")
                    ctrl.sampler.load_state(sampler_state)  # the retry draws the same prompts
                except Exception as e2:  # noqa: BLE001 - a server that cannot restart ends the run
                    error = e2
            except Exception as e:  # noqa: BLE001 - e.g. a reward function raising
                error = e
        raise_everywhere(error is not None, error, f"step {step} rollout")
        if not bcast_int(retry):
            return result
        sync_with_retries(cfg, ctrl, policy, version)
    raise RuntimeError(f"step {step}: rollout failed {cfg.rollout.max_step_retries + 1} times")


def sync_with_retries(cfg, ctrl, policy, version: int, first: bool = False) -> dict:
    """Collective. A sync that fails (every rank raises, e.g. a server died) restarts dead
    servers on rank 0 and sends the same weights again. Rank 0 sends, the others export.
    `first`: the run's first sync (verified under verify_sync=first_last)."""
    transport = ctrl.engines.transport if ctrl is not None else None
    verify = verify_due(cfg.rollout.verify_sync, version, cfg.train.steps, first)
    if transport is not None and hasattr(transport, "verify"):  # the bucketed transports check sums
        transport.verify = verify
    for attempt in range(cfg.rollout.max_step_retries + 1):
        try:
            out = sync_weights(policy.bridge, policy.models, transport, version=version)
            return {**out, "weight_sync/verified": float(verify and hasattr(transport, "verify"))}
        except WeightSyncError as e:
            log0(f"weight sync {version} failed (attempt {attempt + 1}): {str(e)[:300]}")
            restarted = on_rank0(f"restarting servers after weight sync {version}",
                                 lambda: ctrl.engines.restart_dead())
            log0(f"restarted servers {restarted}; sending version {version} again")
    raise RuntimeError(f"weight sync {version} failed {cfg.rollout.max_step_retries + 1} times")


def verify_due(when: str, version: int, steps: int, first: bool) -> bool:
    """rollout.verify_sync: never | first_last (the first sync of this run, also of a resumed
    one, and the sync of the last step's weights) | always."""
    return when == "always" or (when == "first_last" and (first or version == steps))


def _trainer_state(ctrl) -> dict:
    return ctrl.trainer_state() if ctrl is not None else {"sampler": None}


def save_due(cfg, policy, ctrl, ckpt_root: str, done: int) -> None:
    """Collective: the periodic dist-ckpt and HF exports after `done` steps."""
    c = cfg.checkpoint
    if c.every_n_steps and done % c.every_n_steps == 0 and done < cfg.train.steps:
        save_checkpoint(ckpt_root, done, policy.models, policy.optimizer, policy.scheduler, _trainer_state(ctrl),
                        c.keep_last)
    if c.hf_export_every_n_steps and done % c.hf_export_every_n_steps == 0:
        policy.bridge.save_hf(policy.models, os.path.join(cfg.output_dir, "hf", f"step_{done}"))


def save_final(cfg, policy, ctrl, ckpt_root: str) -> str:
    """Collective: the last checkpoint, and the HF export when asked. Returns the HF dir."""
    save_checkpoint(ckpt_root, cfg.train.steps, policy.models, policy.optimizer, policy.scheduler,
                    _trainer_state(ctrl), cfg.checkpoint.keep_last)
    hf_dir = os.path.join(cfg.output_dir, "hf", "final")
    if cfg.checkpoint.hf_export_at_end:
        policy.bridge.save_hf(policy.models, hf_dir)
    return hf_dir
