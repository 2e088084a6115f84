"""Loss reductions that are invariant to how the global batch is split.

In:  ``per_token_loss`` [b, t] and ``mask`` [b, t] of ONE piece of the global batch
     (a micro-batch, a data-parallel rank's share, a context-parallel column shard),
     ``mode``, and normalisers computed ONCE for the whole global batch
     (``compute_loss_normalizers``).
Out: a scalar partial sum. Summing the partial sums (and their gradients) of all
     pieces gives exactly the full-batch value, whatever the split and padding:

  token_mean               sum_{i,t} m_it l_it / N_tokens
  sequence_mean            sum_i [ sum_t m_it l_it / n_i ] / N_seqs
  seq_mean_token_sum_norm  sum_i [ sum_t m_it l_it / max_len ] / N_seqs   (Dr.GRPO)

with ``N_tokens`` the valid tokens and ``N_seqs`` the sequences having >= 1 valid token
in the global batch, and ``n_i`` the valid-token count of the FULL sequence i (pass
``seq_token_counts`` when the piece is a context-parallel shard; otherwise it defaults
to the local row count). Sequences with no valid token contribute 0.

Consequences for the training loop: do NOT divide the returned loss by the number of
micro-batches, and combine data-parallel gradients by SUM (if the DDP wrapper averages,
multiply the loss by the DP world size). In a distributed job build the normalisers as
``N_tokens = all_reduce_dp(mask.sum())``, ``N_seqs = all_reduce_dp((n > 0).sum())`` with
``n = all_reduce_cp(mask.sum(-1))`` per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

REDUCTION_MODES = ("token_mean", "sequence_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class LossNormalizers:
    """Global-batch normalisers; slice per piece with ``for_rows``."""

    num_tokens: Tensor  # scalar: valid tokens in the global batch
    num_sequences: Tensor  # scalar: sequences with >= 1 valid token
    seq_token_counts: Tensor  # [B]: valid tokens of each full sequence
    max_len: int | None = None  # fixed constant for seq_mean_token_sum_norm

    def for_rows(self, rows=slice(None)) -> dict:
        """Keyword arguments for ``reduce_loss`` / ``compute_policy_loss`` for the given global rows."""
        return dict(
            global_num_tokens=self.num_tokens,
            global_num_sequences=self.num_sequences,
            max_len=self.max_len,
            seq_token_counts=self.seq_token_counts[rows],
        )


def compute_loss_normalizers(mask: Tensor, max_len: int | None = None) -> LossNormalizers:
    """Normalisers from the full global-batch mask [B, T] (bool or 0/1)."""
    counts = mask.bool().sum(-1)
    return LossNormalizers(
        num_tokens=counts.sum(), num_sequences=(counts > 0).sum(), seq_token_counts=counts, max_len=max_len
    )


def _denominator(value, name: str, mode: str):
    if value is None:
        raise ValueError(f"reduction {mode!r} needs {name}")
    if isinstance(value, Tensor):
        return value.clamp(min=1)
    return max(value, 1)


def reduce_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_num_tokens: Tensor | float | None = None,
    global_num_sequences: Tensor | float | None = None,
    max_len: int | None = None,
    seq_token_counts: Tensor | None = None,
) -> Tensor:
    """This piece's share of the globally normalised loss (see module docstring)."""
    mask = mask.bool()
    if per_token_loss.shape != mask.shape:
        raise ValueError(f"loss {tuple(per_token_loss.shape)} and mask {tuple(mask.shape)} differ in shape")
    masked = torch.where(mask, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token_mean":
        return masked.sum() / _denominator(global_num_tokens, "global_num_tokens", mode)
    per_seq = masked.sum(-1)
    if mode == "sequence_mean":
        counts = mask.sum(-1) if seq_token_counts is None else seq_token_counts
        if counts.shape != per_seq.shape:
            raise ValueError(f"seq_token_counts must have shape {tuple(per_seq.shape)}, got {tuple(counts.shape)}")
        per_seq = per_seq / counts.clamp(min=1).to(per_seq.dtype)
        return per_seq.sum() / _denominator(global_num_sequences, "global_num_sequences", mode)
    if mode == "seq_mean_token_sum_norm":
        if max_len is None or max_len <= 0:
            raise ValueError(f"reduction {mode!r} needs a positive max_len, got {max_len!r}")
        num_seqs = _denominator(global_num_sequences, "global_num_sequences", mode)
        return per_seq.sum() / max_len / num_seqs
    raise ValueError(f"unknown reduction mode {mode!r}; choices: {', '.join(REDUCTION_MODES)}")
