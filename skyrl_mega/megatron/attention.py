"""Packed-sequence (THD) attention for megatron-core's local (non-TE) layer spec.

In:  q/k/v from megatron's SelfAttention ([s, b, heads, dim], or [t, 1, heads, dim] / [t, heads,
     dim] with `packed_seq_params`, qkv_format='thd').
Out: the attention output ([s, b, hidden] / [t, 1, hidden]), computed with torch SDPA (flash /
     memory-efficient kernels on GPU).

`SdpaDotProductAttention` is the core-attention entry of skyrl's local layer spec
(specs/local.py); `VarlenDotProductAttention`, the fast spec's (specs/fast.py), runs the packed
path as one varlen flash-attention call (kernels/varlen_attention.py) where that kernel runs,
without reading cu_seqlens back to the host (the longest sequence is the plan's, from
PackedSeqParams.max_seqlen_q). Why: megatron-core's DotProductAttention asserts `packed_seq_params is None`
(THD is a TEDotProductAttention feature; unchanged from 0.16.1 to 0.19). Everything else on the
THD path already works without TE: the attention module squeezes q/k/v to [t, heads, dim] and
applies RoPE per sequence from cu_seqlens_padded (megatron's unfused
`_apply_rotary_pos_emb_thd`, positions restart at every sequence start), and the output is
reshaped back to [t, 1, hidden]. So only the core attention changes: packed inputs run causal
attention separately on each [cu_seqlens_padded[i], cu_seqlens_padded[i+1]) slice (a
block-diagonal causal mask without materialising it). A sequence's padding sits after its real
tokens, so no real token attends to padding, and padded THD equals running every sequence alone.

Unpacked inputs (packed_seq_params None) also go through causal SDPA, so that packed and padded
micro-batches use the same kernel; with an explicit attention mask, query-key layer scaling, a
non-vanilla softmax or sliding windows they fall back to megatron's own implementation. Dropout
uses SDPA's dropout (not megatron's RNG tracker fork): the tiny and Qwen3 configs have attention
dropout 0. The subclass adds no state: weights, buffers and checkpoint keys are megatron's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from .cp_attention import cp_packed_attention
from .kernels.varlen_attention import varlen_causal_attention, varlen_runs


class SdpaDotProductAttention(DotProductAttention):
    """DotProductAttention that also takes THD packed sequences (see module docstring)."""

    def __init__(self, config, *args, pg_collection=None, **kwargs):
        # megatron's DotProductAttention refuses context parallelism (TE's attention has it);
        # this one runs it for packed sequences (cp_attention.py), so it is built as CP=1
        cp = config.context_parallel_size
        if cp > 1:
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, pg_collection=pg_collection, **kwargs)
        self.cp_size = cp
        self.cp_group = None
        if cp > 1:
            from megatron.core import parallel_state as mpu

            self.cp_group = getattr(pg_collection, "cp", None) or mpu.get_context_parallel_group()

    def _sdpa_ok(self) -> bool:
        cfg = self.config
        return (
            not cfg.apply_query_key_layer_scaling
            and getattr(cfg, "softmax_type", "vanilla") == "vanilla"
            and getattr(self.scale_mask_softmax, "window_size", None) is None
        )

    def _dropout_p(self) -> float:
        return self.attention_dropout.p if self.training else 0.0

    def _sdpa(self, q, k, v):
        """q [B, np, s, hn], k/v [B, ng, s, hn] -> [B, np, s, hn], causal."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self._dropout_p(), scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _attend_from(self, q, k, v, q_offset: int):
        """q [Lq, np, hn] at key positions q_offset.., k / v [Lk, ng, hn] -> [Lq, np, hn]: row i
        sees keys 0..q_offset+i (causal, aligned to the keys' end when q_offset = Lk - Lq)."""
        visible = (torch.arange(k.shape[0], device=q.device)[None, :]
                   <= q_offset + torch.arange(q.shape[0], device=q.device)[:, None])
        out = F.scaled_dot_product_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), attn_mask=visible, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None:
            if attention_mask is not None or not self._sdpa_ok():
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            # [s, b, n, hn] -> [b, n, s, hn]
            out = self._sdpa(*(x.permute(1, 2, 0, 3) for x in (query, key, value)))
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed attention supports qkv_format='thd', got {packed_seq_params.qkv_format!r}")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported with packed sequences")
        if not self._sdpa_ok():
            raise ValueError(
                "packed sequences on the local spec need vanilla softmax attention without "
                "query-key layer scaling or sliding windows; use the TE spec"
            )
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        t = query.shape[0]
        if query.dim() == 4:  # [t, 1, n, hn] (not squeezed by the caller)
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        if self.cp_size > 1:
            if self._dropout_p() > 0:
                raise ValueError("attention dropout is not supported with context parallelism on the local spec")
            return cp_packed_attention(query, key, value, cu, self.cp_group, self._attend_from).reshape(t, 1, -1)
        return self._packed(query, key, value, cu, packed_seq_params).reshape(t, 1, -1)

    @staticmethod
    def _bounds(cu, t: int) -> list[int]:
        """The packed row's sequence starts on the host (a device sync when cu is on the GPU)."""
        bounds = [int(x) for x in cu.tolist()]
        if bounds[-1] != t:
            raise ValueError(f"cu_seqlens end at {bounds[-1]} but the packed row has {t} tokens")
        return bounds

    def _packed(self, query, key, value, cu, packed_seq_params):
        """[t, np, hn] q / k / v of the sequences cu delimits -> [t, np, hn], causal per sequence."""
        bounds = self._bounds(cu, query.shape[0])
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b == a:
                continue
            # [L, n, hn] -> [1, n, L, hn]
            q, k, v = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            outs.append(self._sdpa(q, k, v)[0].transpose(0, 1))  # [L, np, hn]
        return torch.cat(outs, 0)


class VarlenDotProductAttention(SdpaDotProductAttention):
    """SdpaDotProductAttention whose packed (THD) path is one varlen flash-attention call over the
    whole packed row (kernels/varlen_attention.py) where that runs (CUDA, fp16 / bf16, no
    attention dropout in training), instead of one SDPA call per sequence: the fast spec's core
    attention. Same math (causal within each padded sequence), same (no) state."""

    def _packed(self, query, key, value, cu, packed_seq_params):
        if not varlen_runs(query) or self._dropout_p() > 0:
            return super()._packed(query, key, value, cu, packed_seq_params)
        # the longest padded sequence comes from the host (the micro-batch plan); reading it off
        # cu would sync the device in every layer
        longest = packed_seq_params.max_seqlen_q
        if longest is None:
            bounds = self._bounds(cu, query.shape[0])
            longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return varlen_causal_attention(query, key, value, cu, int(longest), scale=self.softmax_scale)
