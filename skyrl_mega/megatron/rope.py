"""RoPE for packed (THD) sequences without a host sync: the fast spec's self-attention.

In:  megatron's rotary frequencies ([max_s, 1, 1, rot_dim] float32, the same tensor for every
     layer of one forward), the micro-batch's PackedSeqParams (padded cu_seqlens on the device),
     and the query / key heads megatron's SelfAttention derives ([t, 1, heads, dim]).
Out: the rotated query / key, equal element for element to megatron's unfused THD RoPE
     (`rope_utils._apply_rotary_pos_emb_thd`: positions restart at each padded sequence start;
     a freqs table as long as the packed row means positions over the whole row instead).

Why: megatron's unfused THD RoPE reads the sequence lengths back to the host (`.tolist()`,
`.item()`) and rotates one sequence at a time, for the query and again for the key of every
layer: four device syncs a layer, each of which drains the GPU's queue. Here each token's
position comes from the padded cu_seqlens on the device (`searchsorted`), and the cos / sin rows
for the micro-batch are gathered once and shared by every layer (kept on the PackedSeqParams
object, which lives as long as one micro-batch).

`PackedRopeSelfAttention` is megatron's SelfAttention that, where these conditions hold (THD,
context parallel 1, plain non-interleaved RoPE without YaRN scaling or mRoPE, no inference
context), takes the rotary frequencies away from megatron's forward and rotates the query and
key right after `get_query_key_value_tensors` (after the q / k norms, where megatron rotates
them too). Anything else goes through megatron unchanged. No state of its own: parameters,
checkpoint keys and bridges are SelfAttention's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from .kernels import fused

_CACHE_ATTR = "_skyrl_packed_rope"


def packed_positions(cu_seqlens_padded: torch.Tensor, num_tokens: int, freqs_len: int) -> torch.Tensor:
    """Position of each of the row's `num_tokens` tokens within its padded sequence (long,
    on cu's device), without reading cu back to the host; megatron's convention: a freqs table
    exactly as long as the row means one position per token of the whole row."""
    ar = torch.arange(num_tokens, device=cu_seqlens_padded.device)
    if freqs_len == num_tokens:
        return ar
    cu = cu_seqlens_padded.to(torch.long)
    seq = torch.searchsorted(cu[1:], ar, right=True)
    return ar - cu[seq]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [t, ..., dim] rotated on its first cos.shape[-1] channels (cos / sin [t, 1, 1, rot_dim]
    in x's dtype, broadcast over the middle dims); megatron's `_apply_rotary_pos_emb_bshd` math,
    one fused kernel where kernels/fused.py fuses."""
    shape = (cos.shape[0], *([1] * (x.dim() - 2)), cos.shape[-1])
    return fused.rope(x, cos.reshape(shape), sin.reshape(shape))


def packed_cos_sin(packed_seq_params, freqs: torch.Tensor, num_tokens: int, dtype: torch.dtype):
    """(cos, sin) [t, 1, 1, rot_dim] in `dtype` for the micro-batch's tokens, made once per
    (PackedSeqParams, freqs, dtype) and kept on the PackedSeqParams."""
    cache = packed_seq_params.__dict__.setdefault(_CACHE_ATTR, {})
    key = (id(freqs), num_tokens, dtype)
    hit = cache.get(key)
    if hit is not None and hit[0] is freqs:
        return hit[1], hit[2]
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    pos = packed_positions(cu.to(freqs.device), num_tokens, freqs.shape[0])
    table = freqs.reshape(freqs.shape[0], freqs.shape[-1])
    cos = torch.cos(table).to(dtype).index_select(0, pos)
    sin = torch.sin(table).to(dtype).index_select(0, pos)
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]
    cache[key] = (freqs, cos, sin)
    return cos, sin


def _freqs_ok(emb) -> bool:
    return isinstance(emb, torch.Tensor) and emb.dim() == 4 and emb.shape[1] == 1 and emb.shape[2] == 1


class PackedRopeSelfAttention(SelfAttention):
    """SelfAttention whose packed-sequence RoPE runs without host syncs (see module docstring)."""

    _pending = None

    def _mscale(self) -> float:
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        return _yarn_get_concentration_factor_from_config(self.config)

    def _takes_rope(self, q_emb, k_emb, packed_seq_params, kwargs) -> bool:
        cfg = self.config
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return False
        return (
            _freqs_ok(q_emb) and _freqs_ok(k_emb) and q_emb.shape[-1] % 2 == 0
            and kwargs.get("inference_context") is None and kwargs.get("inference_params") is None
            and self.pg_collection.cp.size() == 1
            and not cfg.apply_rope_fusion and not cfg.rotary_interleaved and not cfg.multi_latent_attention
            and getattr(cfg, "mrope_section", None) is None and not getattr(cfg, "fused_single_qkv_rope", False)
            and not getattr(cfg, "flash_decode", False) and self._mscale() == 1.0
        )

    def forward(self, *args, **kwargs):
        rope, psp = kwargs.get("rotary_pos_emb"), kwargs.get("packed_seq_params")
        pair = rope if isinstance(rope, tuple) else (rope, rope)
        if rope is None or not self._takes_rope(*pair, psp, kwargs):
            return super().forward(*args, **kwargs)
        self._pending = (pair, psp)
        kwargs["rotary_pos_emb"] = None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._pending = None

    def get_query_key_value_tensors(self, *args, **kwargs):
        out = super().get_query_key_value_tensors(*args, **kwargs)
        if self._pending is None:
            return out
        (q_emb, k_emb), psp = self._pending
        query, key = out[0], out[1]
        t = query.shape[0]
        cos, sin = packed_cos_sin(psp, q_emb, t, query.dtype)
        query = apply_rope(query, cos, sin)
        if k_emb is not q_emb:
            cos, sin = packed_cos_sin(psp, k_emb, t, key.dtype)
        key = apply_rope(key, cos, sin)
        return (query, key, *out[2:])
