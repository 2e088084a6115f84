"""megatron-core's Gated DeltaNet layer with packed (THD) sequences on every supported version.

In:  hidden states [s, b, h] (sequence-split under SP) and PackedSeqParams (qkv_format 'thd', one
     row) or None. Out: (output [s, b, h], bias), megatron's GatedDeltaNet contract.

megatron-core 0.18+ runs packed GDN itself: its conv and recurrence restart at cu_seqlens.
0.16 / 0.17 raise NotImplementedError for packed input, so there the spec builds
`PackedGatedDeltaNet`: megatron's class (parameters, TP split, dist-ckpt layout unchanged) whose
forward also takes THD rows. Sequence boundaries are the padded cu_seqlens (padding only follows
a sequence's real tokens, so it cannot reach them): the causal conv1d gets `seq_idx` (no tap
crosses a sequence start) and the gated delta rule `cu_seqlens` (the state restarts at every
sequence). Unpacked input goes to megatron's own forward. `gdn_class()` picks the class (and
registers the fla kernel stand-ins where fla is absent).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..compat.guard import mark_applied
from ..compat.megatron_core import SHIMS_BY_NAME

_SHIM = SHIMS_BY_NAME["packed_gdn"]


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(1, total) int32: the index of the sequence each packed position belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    idx = torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)
    if idx.numel() != total:
        raise ValueError(f"packed GDN: cu_seqlens cover {idx.numel()} positions, the row has {total}")
    return idx.to(torch.int32).unsqueeze(0)


@functools.lru_cache(maxsize=None)
def gdn_class():
    """megatron's GatedDeltaNet where it packs sequences itself, else PackedGatedDeltaNet. Registers
    the fla kernel stand-ins first where fla is absent (compat/fla.py)."""
    from ..compat.fla import apply_fla_kernel_standins

    apply_fla_kernel_standins()
    from megatron.core.ssm import gated_delta_net as mgdn

    if not _SHIM.needed_here():
        return mgdn.GatedDeltaNet

    class PackedGatedDeltaNet(mgdn.GatedDeltaNet):
        """megatron-core < 0.18's GatedDeltaNet, with THD packed sequences (module docstring)."""

        def forward(self, hidden_states, attention_mask, key_value_states=None, inference_context=None,
                    attention_bias=None, packed_seq_params=None, sequence_len_offset=None, *,
                    inference_params=None, **kwargs):
            if packed_seq_params is None or inference_context is not None or inference_params is not None:
                return super().forward(hidden_states, attention_mask, key_value_states, inference_context,
                                       attention_bias, packed_seq_params, sequence_len_offset,
                                       inference_params=inference_params, **kwargs)
            mark_applied(_SHIM)
            return self._packed_forward(hidden_states, packed_seq_params)

        def _packed_forward(self, hidden_states, packed):
            from .kernels import conv1d as local_conv1d

            seq_len, batch, _ = hidden_states.shape
            seq_len *= self.sp_size
            if batch != 1:
                raise ValueError(f"packed GDN expects one packed row, got batch {batch}")
            cu = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
            cu = cu.to(device=hidden_states.device)
            tp = self.tp_size
            qkvzba, _ = self.in_proj(hidden_states)
            qkvzba = qkvzba.transpose(0, 1)  # (1, s, d)
            qkv, gate, beta, alpha = torch.split(
                qkvzba, [(self.qk_dim * 2 + self.v_dim) // tp, self.v_dim // tp,
                         self.num_value_heads // tp, self.num_value_heads // tp], dim=-1)
            gate = gate.reshape(batch, seq_len, -1, self.value_head_dim)
            conv = mgdn.causal_conv1d_fn or local_conv1d.causal_conv1d_fn
            qkv = conv(x=qkv.transpose(1, 2), weight=self.conv1d.weight.squeeze(1), bias=self.conv1d.bias,
                       seq_idx=seq_idx_from_cu_seqlens(cu, seq_len), activation=self.activation)
            query, key, value = torch.split(qkv.transpose(1, 2), [self.qk_dim // tp, self.qk_dim // tp,
                                                                  self.v_dim // tp], dim=-1)
            query = query.reshape(batch, seq_len, -1, self.key_head_dim)
            key = key.reshape(batch, seq_len, -1, self.key_head_dim)
            value = value.reshape(batch, seq_len, -1, self.value_head_dim)
            if self.use_qk_l2norm:
                query, key = mgdn.l2norm(query.contiguous()), mgdn.l2norm(key.contiguous())
            rep = self.num_value_heads // self.num_key_heads
            if rep > 1:
                query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
            g = -self.A_log.exp() * F.softplus(alpha.float() + self.dt_bias)
            out, _ = mgdn.chunk_gated_delta_rule(
                query.contiguous(), key.contiguous(), value.contiguous(), g=g, beta=beta.sigmoid(),
                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                cu_seqlens=cu.to(torch.long))
            out = self._apply_gated_norm(out, gate.contiguous())
            out = out.reshape(batch, seq_len, -1).transpose(0, 1).contiguous()
            return self.out_proj(out)

    return PackedGatedDeltaNet
