"""Token entropy from logits.

In:  ``logits`` [*, V] (any float dtype; entries may be -inf for banned tokens, as long as
     each row has at least one finite entry).
Out: entropy [*] in nats, ``H = -sum_v p_v log p_v``, computed in float32 or wider.

Numerically stable: goes through ``log_softmax`` (no exp of raw logits) and treats
``0 * log 0`` as 0, so -inf logits give neither NaN values nor NaN gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy over the last dimension of ``logits`` [*, V] -> [*]."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    plogp = p * logp.masked_fill(p == 0, 0.0)
    return -plogp.sum(-1)
