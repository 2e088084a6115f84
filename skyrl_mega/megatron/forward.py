"""Micro-batched forward(/backward) through megatron's pipeline schedules.

In: model chunks, a list of micro-batch dicts (input_ids [b, s], position_ids [b, s], plus
whatever the loss needs), and a loss function. Out: what the last pipeline stage's loss
function returned for each micro-batch (empty list on other stages). Gradients land in the
DDP buffers when forward_only is False.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import torch

from ..devices import current_device


def run_microbatches(
    models,
    microbatches: Sequence[dict[str, Any]],
    loss_fn: Callable,
    forward_only: bool,
    collect_non_loss_data: bool = False,
    model_kwargs_fn: Callable[[dict], dict] | None = None,
) -> list:
    """loss_fn(mb, output) -> (loss_sum, num_tokens, reported) for training, or any data when
    collect_non_loss_data. model_kwargs_fn(mb) gives extra forward kwargs (labels, packing)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = to_device(next(data_iterator))
        extra = model_kwargs_fn(mb) if model_kwargs_fn else {}
        output = model(mb["input_ids"], mb["position_ids"], attention_mask=None, **extra)

        def loss(output_tensor, non_loss_data=False):
            return loss_fn(mb, output_tensor)

        return output, loss

    mb0 = microbatches[0]["input_ids"]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(microbatches),
        model=models if len(models) > 1 else models[0],
        num_microbatches=len(microbatches),
        seq_length=mb0.shape[1],
        micro_batch_size=mb0.shape[0],
        forward_only=forward_only,
        collect_non_loss_data=collect_non_loss_data,
    )


def device() -> torch.device:
    return current_device()


def to_device(mb: dict) -> dict:
    dev = device()
    return {k: v.to(dev, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}


def gather_vocab_parallel(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocab logits from TP-sharded ones (tests and debugging only: costs V on every rank)."""
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def lm_loss(mb: dict, per_token_loss: torch.Tensor):
    """Next-token cross-entropy (model called with labels): (sum, tokens, [sum, tokens])."""
    mask = mb["loss_mask"].to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    n = mask.sum().to(torch.int)
    return total, n, torch.stack([total.detach(), n.detach().to(total.dtype)])
