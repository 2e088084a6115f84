"""One language-model training step over Megatron ranks, for the multi-rank test workers.

In: model chunks, optimizer + scheduler, a global batch [n, s] of token ids and a loss mask.
Out: (global token-mean loss, grad norm); each DP rank trains on rows dp_rank::dp.
"""

import torch
import torch.distributed as dist

from skyrl_mega.megatron import forward


def pattern_batch(n_seq: int, seq: int, step: int) -> torch.Tensor:
    """Counting sequences mod 97 from per-sample offsets (learnable: next = token + 1)."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 97, (n_seq, 1), generator=g)
    return (start + torch.arange(seq)) % 97 + 3


def lm_train_step(models, optimizer, scheduler, batch: torch.Tensor, mask: torch.Tensor):
    from megatron.core import parallel_state as mpu

    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    labels = torch.roll(batch, -1, dims=1)
    pos = torch.arange(batch.shape[1]).expand_as(batch)
    mbs = [{"input_ids": batch[i:i + 1], "position_ids": pos[i:i + 1], "labels": labels[i:i + 1],
            "loss_mask": mask[i:i + 1]} for i in range(dp_rank, batch.shape[0], dp)]
    for m in models:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    out = forward.run_microbatches(models, mbs, forward.lm_loss, forward_only=False,
                                   model_kwargs_fn=lambda mb: {"labels": mb["labels"]})
    _, grad_norm, _ = optimizer.step()
    scheduler.step(1)
    total = torch.stack(out).sum(0) if out else torch.zeros(2, device=forward.device())
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(total, group=mpu.get_pipeline_model_parallel_group())
    dist.all_reduce(total, group=mpu.get_data_parallel_group())
    return (total[0] / total[1]).item(), float(grad_norm)
