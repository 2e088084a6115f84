"""MoE token dispatch without host syncs where the experts are all local: the fast spec's MoE layer.

In:  what megatron's token dispatcher gets from the router: hidden states [s, b, hidden], the
     dense routing probs [tokens, experts] and the routing map (bool, exactly `topk` experts per
     token); later the experts' outputs.
Out: what megatron's dispatchers hand the experts: the tokens sorted by expert (token order kept
     within an expert), tokens per expert (a device tensor), the matching probs; after the
     experts, their outputs summed back onto each token (what megatron's `unpermute` gives),
     [s, b, hidden].

Why: with no expert or expert-tensor parallelism nothing has to move between ranks, yet
megatron's dispatchers read counts back to the host in every MoE layer's forward (the
all-gather one `.cpu()` and `masked_select`; the all-to-all one waits on its device-to-host
copy of the tokens per expert, then splits and concatenates the tokens per expert for a
reorder that is the identity here), and each such sync drains the GPU's queue. Here every
token goes to exactly `topk` experts, so the number of dispatched tokens is known on the host
(tokens x topk) and the sort runs on the device: a stable argsort of the expert-major routing
map, the order megatron's `permute` / `masked_select` give. The grouped-GEMM experts
(experts.py) take the device counts as they are. Both directions that add rows per token (the
combine, and the gradient of the dispatch) gather each token's `topk` rows and sum them, where
megatron scatter-adds (bf16 atomics on the GPU): each token's rows are known from a second
stable sort, by token.

`SyncFreeMoELayer` is megatron's MoELayer whose dispatcher becomes `LocalExpertsDispatcher`
where that applies (expert and expert-tensor parallel 1, no capacity dropping or padding, no
fused permute, no shared-expert overlap); otherwise megatron's dispatcher runs unchanged.
Neither adds parameters.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)


def sorted_by_expert(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, topk: int):
    """(tokens [T*topk, hidden] sorted by expert, their probs [T*topk], each row's source token
    [T*topk], each token's rows [T, topk]) for a routing map [T, E] with exactly `topk` True
    entries per token; no host sync. The tokens' gradient is the sum of their rows' (gathered,
    not scattered: no atomics)."""
    n = routing_map.shape[0]
    order = routing_map.T.contiguous().reshape(-1).argsort(descending=True, stable=True)[: n * topk]
    source = order % n
    rows = torch.argsort(source, stable=True).view(n, topk)
    permuted = _Gather.apply(tokens, source, rows)
    return permuted, probs.T.contiguous().reshape(-1).index_select(0, order), source, rows


def summed_by_token(rows_out: torch.Tensor, source: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[T, hidden]: each token's sum of its rows of rows_out [T*topk, hidden] (the combine), in
    float32 before rounding to rows_out's dtype; megatron's `unpermute` (a scatter-add) gives
    the same sums."""
    return _SumRows.apply(rows_out, source, rows)


def _rows_summed(y: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[T, hidden]: row t = the sum of y[rows[t]] (rows [T, topk]); a gather, no atomics."""
    n, k = rows.shape
    return y.index_select(0, rows.reshape(-1)).view(n, k, -1).sum(1)


class _Gather(torch.autograd.Function):
    """x[index]; x's gradient: for each row r of x, the sum of the output rows rows[r]."""

    @staticmethod
    def forward(ctx, x, index, rows):
        ctx.save_for_backward(rows)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return _rows_summed(grad, ctx.saved_tensors[0]), None, None


class _SumRows(torch.autograd.Function):
    """_Gather's adjoint: out[t] = sum of y[rows[t]]; y's gradient at row r is out's at source[r]."""

    @staticmethod
    def forward(ctx, y, source, rows):
        ctx.save_for_backward(source)
        return _rows_summed(y, rows)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.saved_tensors[0]), None, None


class LocalExpertsDispatcher(MoETokenDispatcher):
    """megatron's token dispatcher (all-gather or all-to-all) where every expert is local and
    nothing moves between ranks: the dispatch and combine steps of the MoETokenDispatcher
    interface without communication or host syncs (see module docstring). Set on a
    dispatcher for which `applies` holds; it reads only the config and what the steps store."""

    @staticmethod
    def applies(dispatcher) -> bool:
        cfg = dispatcher.config
        return (
            type(dispatcher) in (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)
            and dispatcher.ep_size == 1 and dispatcher.tp_size == 1
            and dispatcher.num_local_experts == cfg.num_moe_experts
            and cfg.moe_expert_capacity_factor is None
            and not cfg.moe_pad_expert_input_to_capacity
            and not getattr(cfg, "moe_router_padding_for_quantization", False)
            and not getattr(cfg, "moe_router_padding_for_fp8", False)
            and not cfg.moe_permute_fusion
            and not cfg.moe_shared_expert_overlap
        )

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.routing_map = routing_map
        self.tokens_per_expert = routing_map.sum(dim=0)
        permuted, permuted_probs, self.source_tokens, self.token_rows = sorted_by_expert(
            hidden_states, routing_map, probs, self.config.moe_router_topk)
        return permuted, permuted_probs

    def token_dispatch(self, hidden_states, probs):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states, probs):
        return hidden_states, self.tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        out = summed_by_token(hidden_states, self.source_tokens, self.token_rows)
        self.routing_map = self.source_tokens = self.token_rows = None
        return out

    def token_combine(self, hidden_states):
        return hidden_states

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)


class SyncFreeMoELayer(MoELayer):
    """MoELayer with the local-experts dispatcher where it applies (see module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if LocalExpertsDispatcher.applies(self.token_dispatcher):
            self.token_dispatcher.__class__ = LocalExpertsDispatcher
