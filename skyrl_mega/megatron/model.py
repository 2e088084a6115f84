"""Builds the trainable Megatron model from an HF checkpoint.

In: a SkyrlConfig (model path, dtype, parallel layout) after init_model_parallel.
Out: (bridge, model chunks): chunks wrapped in megatron DDP with HF weights loaded, and the
megatron config wired for training (per-token loss scaling, grad finalisation, PP dtype).
"""

from __future__ import annotations

import torch

from bridges import ModelBridge, bridge_for

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_bridge(cfg, **config_overrides) -> ModelBridge:
    p = cfg.parallel
    sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
    overrides = dict(sequence_parallel=sp, calculate_per_token_loss=True)
    overrides.update(config_overrides)
    return bridge_for(cfg.model.path, dtype=DTYPES[cfg.model.dtype], spec=cfg.model.spec, **overrides)


def build_model(cfg, wrap_with_ddp: bool = True, load_weights: bool = True, bridge: ModelBridge | None = None):
    """Returns (bridge, model_chunks). DDP uses the distributed optimizer's bucket layout."""
    from megatron.core.distributed import finalize_model_grads

    bridge = bridge or build_bridge(cfg)
    ddp_config = dict(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=cfg.optim.use_distributed_optimizer,
        overlap_grad_reduce=False,
        overlap_param_gather=False,
        average_in_collective=False,
    )
    models = bridge.build(load_weights=load_weights, wrap_with_ddp=wrap_with_ddp, ddp_config=ddp_config)
    mcfg = bridge.config
    mcfg.finalize_model_grads_func = finalize_model_grads
    if wrap_with_ddp:
        mcfg.no_sync_func = [m.no_sync for m in models] if len(models) > 1 else models[0].no_sync
    return bridge, models
