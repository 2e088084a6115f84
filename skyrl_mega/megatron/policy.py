"""The models the RL step trains and scores against: built once per run on every Megatron rank.

In: the run config (model path, dtype, parallel layout, optimizer, algorithm flags). Out:
`PolicyModel` (DDP chunks with the HF weights, the distributed optimizer, the LR schedule and
the R3 replay handle when algorithm.routing_replay) and `ReferenceModel` (a frozen copy of the
initial weights, no DDP / optimizer). Call after parallel.init_model_parallel; train_step.py
uses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .r3_replay import R3Replay


@dataclass
class PolicyModel:
    cfg: object
    bridge: object
    models: list
    optimizer: object
    scheduler: object
    replay: Optional[R3Replay] = None
    step: int = 0


@dataclass
class ReferenceModel:
    bridge: object
    models: list
    replay: Optional[R3Replay] = None


def _recompute_overrides(cfg) -> dict:
    """train.recompute_granularity (null or full; the config validator rejects anything else)."""
    if not cfg.train.recompute_granularity:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _check_replay_support():
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "moe_enable_routing_replay" not in TransformerConfig.__dataclass_fields__:
        raise RuntimeError("algorithm.routing_replay needs megatron-core >= 0.16 (moe_enable_routing_replay)")


def build_policy(cfg, total_steps: Optional[int] = None) -> PolicyModel:
    """The trainable model (DDP chunks, HF weights), its optimizer and LR schedule, and the R3
    handle when algorithm.routing_replay. Call after parallel.init_model_parallel."""
    from .model import DTYPES, build_bridge, build_model
    from .optimizer import build_optimizer

    replay = bool(cfg.algorithm.routing_replay)
    if replay:
        _check_replay_support()
    overrides = dict(_recompute_overrides(cfg))
    if replay:
        overrides["moe_enable_routing_replay"] = True
    bridge = build_bridge(cfg, **overrides)
    bridge, models = build_model(cfg, bridge=bridge)
    _check_layout(models)
    optimizer, scheduler = build_optimizer(models, cfg.optim, total_steps or cfg.train.steps, DTYPES[cfg.model.dtype])
    handle = R3Replay.attach(models, bridge.moe_layers) if replay else None
    return PolicyModel(cfg, bridge, models, optimizer, scheduler, handle)


def build_reference(cfg) -> ReferenceModel:
    """A frozen copy of the policy's initial weights (same HF path), no DDP / optimizer.

    Safe to build before or after the policy: R3 handles own their routers (r3_replay.py);
    the reference replays routes only with algorithm.ref_routing_replay."""
    from .model import build_bridge

    replay = bool(cfg.algorithm.ref_routing_replay)
    overrides = {"moe_enable_routing_replay": True} if replay else {}
    if replay:
        _check_replay_support()
    bridge = build_bridge(cfg, **overrides)
    models = bridge.build(load_weights=True, wrap_with_ddp=False)
    _check_layout(models)
    for m in models:
        m.eval()
        for p in m.parameters():
            p.requires_grad_(False)
    handle = R3Replay.attach(models, bridge.moe_layers) if replay else None
    return ReferenceModel(bridge, models, handle)


def _check_layout(models):
    if len(models) > 1:
        raise NotImplementedError("virtual pipeline stages are not supported by the RL train step")
