"""The fast spec's sync-free pieces against megatron's own code on the same inputs, exactly.

- THD RoPE from device-side positions (megatron/rope.py) vs megatron's unfused
  `_apply_rotary_pos_emb_thd` (per-sequence split on the host): bit-equal in fp32 and bf16, with
  empty sequences, partial rotary dims, and megatron's whole-row freqs convention.
- The local-experts dispatch sorted on the device (megatron/dispatch.py) vs megatron's
  `permute` + `masked_select` and `unpermute`: the same token order and probs (bit-equal), the
  same combine, and the same gradients through both (fp32 rounding: sums in another order).
The model-level check (fast spec vs local spec, whole RL step) is tests/test_fast_spec.py.
"""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.moe.moe_utils import permute, unpermute

from skyrl_mega.megatron.dispatch import sorted_by_expert, summed_by_token
from skyrl_mega.megatron.rope import apply_rope, packed_cos_sin, packed_positions


class _OneRank:
    """What megatron's THD RoPE asks of its CP group: size 1, rank 0."""

    def size(self):
        return 1

    def rank(self):
        return 0


def _freqs(max_len: int, rot_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    f = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat([f, f], -1)[:, None, None, :]  # megatron's [max_s, 1, 1, rot_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # full and partial rotary
@pytest.mark.parametrize("whole_row", [False, True])
def test_packed_rope_equals_megatron_thd_rope(dtype, rot_dim, whole_row):
    lengths = [5, 0, 12, 1, 7, 0]  # padded sequences, two empty
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    freqs = _freqs(t if whole_row else max(lengths) + 3, rot_dim)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, 1, 3, 16, generator=g).to(dtype)  # [t, 1, heads, dim] as get_query_key_value_tensors gives
    want = _apply_rotary_pos_emb_thd(x.squeeze(1), cu, freqs, cp_group=_OneRank())
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                          cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    cos, sin = packed_cos_sin(psp, freqs, t, dtype)
    got = apply_rope(x, cos, sin)
    assert got.dtype == dtype and torch.equal(got.squeeze(1), want)
    again = packed_cos_sin(psp, freqs, t, dtype)  # every layer of the micro-batch shares them
    assert again[0] is cos and again[1] is sin


def test_packed_positions_restart_at_each_padded_sequence():
    cu = torch.tensor([0, 3, 3, 5, 9], dtype=torch.int32)
    assert packed_positions(cu, 9, 100).tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert packed_positions(cu, 9, 9).tolist() == list(range(9))  # freqs as long as the row


def _routing(tokens: int, experts: int, topk: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(tokens, experts, generator=g).argsort(-1)[:, :topk]
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(tokens, experts, generator=g) * routing_map
    return routing_map, probs


@pytest.mark.parametrize("tokens, experts, topk", [(37, 8, 2), (64, 16, 4), (5, 4, 4)])
def test_sorted_by_expert_equals_megatron_permute(tokens, experts, topk):
    routing_map, probs = _routing(tokens, experts, topk, seed=tokens)
    hidden = torch.randn(tokens, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got, got_probs, source, rows = sorted_by_expert(hidden, routing_map, probs, topk)
    want, _, want_source, *_ = permute(hidden, routing_map, num_out_tokens=int(routing_map.sum()))
    want_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())  # megatron's all-gather dispatcher
    assert torch.equal(source, want_source) and torch.equal(got, want) and torch.equal(got_probs, want_probs)
    assert torch.equal(source[rows], torch.arange(tokens)[:, None].expand(tokens, topk))  # each token's rows
    w = torch.randn_like(got)
    (g_got,) = torch.autograd.grad((got * w).sum(), hidden)
    (g_want,) = torch.autograd.grad((want * w).sum(), hidden)  # megatron: index_select's scatter-add backward
    assert (g_got - g_want).abs().max() < 1e-6

    # the combine: expert outputs summed back per token, as megatron's unpermute does
    out_rows = torch.randn(tokens * topk, 6, generator=torch.Generator().manual_seed(2), requires_grad=True)
    combined = summed_by_token(out_rows, source, rows)
    ref = unpermute(out_rows, want_source, restore_shape=hidden.shape)
    assert (combined - ref).abs().max() < 1e-6
    v = torch.randn_like(combined)
    (c_got,) = torch.autograd.grad((combined * v).sum(), out_rows)
    (c_want,) = torch.autograd.grad((ref * v).sum(), out_rows)
    assert torch.equal(c_got, c_want)  # each row's gradient is its token's: a gather either way
