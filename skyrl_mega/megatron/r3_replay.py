"""R3: replay the rollout engine's routed experts in the trainer's MoE routers.

In:  per sample, routed experts aligned with its prompt+response tokens, int
     [L or L-1, num_moe_layers, top_k] (the engine's L-1 rows: the last sampled token has no
     route), -1 marking a missing route (optionally a `valid` row mask, as
     `rollout.r3_wire.align_to_sequence` returns); the micro-batch layouts of `packing.py`.
Out: for each micro-batch, this rank's routes [tokens_local, num_moe_layers, top_k] in the
     exact token order its routers see, handed to the R3RouterReplay of each of this rank's
     MoE routers.

Token order (`microbatch_routes`): the same placement as the tokens (packing, per-sequence
padding), then the CP zig-zag selection, then the sequence-parallel slice of this TP rank
(the router sees [s/tp, b] tokens flattened s-major). Layers: the router of global layer g
(megatron's `router.layer_number` is g+1) reads column `moe_layers.index(g)`; with pipeline
parallelism a rank holds only its stage's routers, so it only reads its columns.

Padding positions get distinct valid expert ids ((pos*k + j) mod E over the row), so a
top-k row never repeats an expert. Missing routes (-1; a row with any -1 counts as missing)
fall back to the live router per token: `R3RouterReplay` computes the live top-k alongside the
replayed one and merges them row by row (megatron's own RouterReplay only replays: it would
gather with index -1).

Actions: `R3Replay.session()` opens a replay window around one `run_microbatches` call. Each
micro-batch sets its targets and REPLAY_FORWARD right before its forward
(`set_microbatch`); an identity autograd node on every chunk's output switches the layers to
REPLAY_BACKWARD when that micro-batch's backward starts, so activation recompute pops the
same indices (replay_backward_list is FIFO, which matches 1F1B and
all-forward-all-backward order). Leaving the session clears indices and actions.

Where the replay state lives: a model built with `moe_enable_routing_replay=True` gets skyrl's
R3 router in its layer spec (`specs.common.R3TopKRouter`, megatron's TopKRouter holding an
R3RouterReplay; megatron's MoESubmodules.router slot takes it in 0.16.1 and 0.19), and megatron's
own flag stays off in its config (bridges/interface.py). So no router joins megatron's
process-global `RouterReplay.global_router_replay_instances` (which its static helpers address
in construction order): `R3Replay.attach(models, moe_layers)` walks that model's own routers and
keys their replay state by global layer number. Build order does not matter, a reference model's
routers are never driven by the policy's replay, and the reference model may be built with or
without routing replay.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
from torch import Tensor

from .packing import MicroBatchLayout, sp_slice


class R3Error(ValueError):
    """Routes whose shape, layer count or expert ids do not fit the model or the tokens."""


# ---------------------------------------------------------------------------- pure helpers
def align_routes(routes: Tensor, seq_len: int, num_moe_layers: int, topk: int, num_experts: int,
                 valid: Tensor | None = None) -> Tensor:
    """One sample's routes -> long [seq_len, num_moe_layers, topk], -1 rows where missing.

    Accepts seq_len rows, or seq_len-1 rows (the engine's convention: the last token's route
    is missing). `valid` [rows] False marks missing rows. Raises R3Error on a bad shape, an
    expert id outside [0, num_experts) other than -1, or a repeated expert in one row.
    """
    routes = torch.as_tensor(routes)
    if routes.dtype.is_floating_point or routes.dtype == torch.bool:
        raise R3Error(f"routed experts must be integers, got {routes.dtype}")
    if routes.dim() != 3:
        raise R3Error(f"routed experts must be [tokens, moe_layers, topk], got shape {tuple(routes.shape)}")
    if routes.shape[1] != num_moe_layers:
        raise R3Error(
            f"routed experts have {routes.shape[1]} layers but the model has {num_moe_layers} MoE layers "
            "(engines that report every decoder layer: select the MoE columns first, "
            "rollout.r3_wire.select_moe_layers)"
        )
    if routes.shape[2] != topk:
        raise R3Error(f"routed experts have top-k {routes.shape[2]} but the model routes to {topk} experts")
    rows = routes.shape[0]
    if rows not in (seq_len, seq_len - 1):
        raise R3Error(f"routed experts have {rows} rows for a sequence of {seq_len} tokens "
                      f"(expected {seq_len - 1} from the engine, or {seq_len})")
    out = routes.to(torch.long)
    if valid is not None:
        valid = torch.as_tensor(valid, dtype=torch.bool)
        if valid.shape != (rows,):
            raise R3Error(f"valid mask of shape {tuple(valid.shape)} for {rows} route rows")
        out = torch.where(valid[:, None, None], out, torch.full_like(out, -1))
    if rows == seq_len - 1:
        out = torch.cat([out, out.new_full((1, num_moe_layers, topk), -1)], 0)
    bad = (out < -1) | (out >= num_experts)
    if bad.any():
        raise R3Error(f"expert ids must be in [0, {num_experts}) or -1 (missing); got "
                      f"min {int(out.min())}, max {int(out.max())}")
    missing = (out < 0).any(-1, keepdim=True)
    out = torch.where(missing, torch.full_like(out, -1), out)
    if topk > 1:
        s = out.sort(-1).values
        dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(-1)
        if dup.any():
            t, layer = (int(i) for i in dup.nonzero()[0])
            raise R3Error(f"token {t}, MoE layer column {layer}: repeated expert in {out[t, layer].tolist()}")
    return out


def padding_routes(num_tokens: int, num_moe_layers: int, topk: int, num_experts: int) -> Tensor:
    """long [num_tokens, num_moe_layers, topk]: distinct valid ids per row, spread over experts."""
    if topk > num_experts:
        raise R3Error(f"top-k {topk} > {num_experts} experts")
    base = (torch.arange(num_tokens)[:, None] * topk + torch.arange(topk)[None, :]) % num_experts
    return base[:, None, :].expand(num_tokens, num_moe_layers, topk).contiguous()


def microbatch_routes(layout: MicroBatchLayout, per_segment: Sequence[Tensor | None], *, num_moe_layers: int,
                      topk: int, num_experts: int, tp_size: int = 1, tp_rank: int = 0,
                      sequence_parallel: bool | None = None) -> Tensor:
    """This rank's routes for one micro-batch, in router token order: long [tokens_local, L, k].

    `per_segment[k]`: aligned routes [len, L, k] of segment k (`align_routes`), or None (all
    missing for a real sample, padding ids for a dummy segment)."""
    fill = padding_routes(layout.num_tokens, num_moe_layers, topk, num_experts)
    segs = []
    for seg, r in zip(layout.segments, per_segment):
        if r is None and seg.sample >= 0:
            r = torch.full((seg.length, num_moe_layers, topk), -1, dtype=torch.long)
        segs.append(r)
    placed = layout.scatter(segs, fill=fill, dtype=torch.long)  # [b, S, L, k]
    placed = layout.to_local(placed)  # CP zig-zag: [b, S_local, L, k]
    seq_first = placed.transpose(0, 1)  # [S_local, b, L, k]: the router's [s, b] order
    sp = (tp_size > 1) if sequence_parallel is None else sequence_parallel
    if sp and tp_size > 1:
        seq_first = seq_first[sp_slice(seq_first.shape[0], tp_size, tp_rank)]
    return seq_first.reshape(-1, num_moe_layers, topk).contiguous()


def route_positions(layout: MicroBatchLayout, tp_size: int = 1, tp_rank: int = 0,
                    sequence_parallel: bool | None = None) -> Tensor:
    """long [tokens_local, 2]: (segment index, token index) of each router token of this rank,
    (-1, -1) for padding. The inverse of `microbatch_routes` (tests and diagnostics)."""
    ids = [torch.stack([torch.full((s.length,), k), torch.arange(s.length)], -1)
           for k, s in enumerate(layout.segments)]
    placed = layout.scatter(ids, fill=-1, dtype=torch.long)  # [b, S, 2]
    placed = layout.to_local(placed).transpose(0, 1)
    sp = (tp_size > 1) if sequence_parallel is None else sequence_parallel
    if sp and tp_size > 1:
        placed = placed[sp_slice(placed.shape[0], tp_size, tp_rank)]
    return placed.reshape(-1, 2)


# ---------------------------------------------------------------------------- router side
def _actions():
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    return RouterReplayAction


class R3RouterReplay:
    """One MoE router's replay state, owned by its model (not in megatron's process-global
    `RouterReplay.global_router_replay_instances`). It speaks megatron's RouterReplay protocol:
    the router calls `get_replay_topk` (moe_utils.topk_routing_with_score_function, 0.16.1 and
    0.19) and the actions are megatron's RouterReplayAction. Added over megatron's: replayed rows
    marked -1 are routed live, a token-count mismatch is an R3Error, and `capture` keeps the
    top-k indices used by each forward. The R3 router (specs.common.R3TopKRouter) holds one."""

    def __init__(self, layer: int = -1):
        self.layer = layer  # global 0-based layer number (R3Replay.attach sets it)
        self.layer_number = None  # megatron 0.19's Router.set_layer_number writes this
        self.target_topk_idx = None
        self.recorded_topk_idx = None
        self.router_replay_action = None
        self.replay_backward_list: list = []
        self.target_complete = False  # no -1 row in target_topk_idx: no live top-k needed
        self._complete_backward: list[bool] = []
        self.capture: list | None = None

    def set_target_indices(self, topk_indices: Tensor, complete: bool = False) -> None:
        """`complete`: the caller checked that no row is -1 (missing), so the replay skips the
        live top-k that would fill such rows."""
        self.target_topk_idx = topk_indices
        self.target_complete = complete
        self.replay_backward_list.append(topk_indices)
        self._complete_backward.append(complete)

    def get_recorded_indices(self) -> Tensor | None:
        return self.recorded_topk_idx

    def clear_indices(self) -> None:
        self.recorded_topk_idx = None
        self.target_topk_idx = None
        self.replay_backward_list = []
        self._complete_backward = []

    def set_router_replay_action(self, action) -> None:
        self.router_replay_action = action

    def clear_router_replay_action(self) -> None:
        self.router_replay_action = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        actions = _actions()
        action = self.router_replay_action
        if action in (actions.REPLAY_FORWARD, actions.REPLAY_BACKWARD):
            if action == actions.REPLAY_FORWARD:
                target, complete = self.target_topk_idx, self.target_complete
            else:
                if not self.replay_backward_list:
                    raise RuntimeError(f"R3: layer {self.layer}: recompute found no routes to replay")
                target = self.replay_backward_list.pop(0)
                complete = self._complete_backward.pop(0)
            if target is None:
                raise RuntimeError(f"R3: layer {self.layer}: replay is on but no routes were set")
            target = target.to(device=scores.device, dtype=torch.long)
            if target.shape != (scores.shape[0], topk):
                raise R3Error(
                    f"R3: layer {self.layer}: the router sees {scores.shape[0]} tokens x top-{topk} but "
                    f"the replayed routes are {tuple(target.shape)} (packing / SP / CP split mismatch)"
                )
            if complete:
                top_indices = target
            else:
                _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                missing = (target < 0).any(-1, keepdim=True)
                top_indices = torch.where(missing, live, target)
            out = (scores.gather(1, top_indices), top_indices)
        else:
            out = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if action == actions.RECORD:
                self.recorded_topk_idx = out[1]
        if self.capture is not None:
            self.capture.append(out[1].detach().clone())
        return out


class _SwitchToReplayBackward(torch.autograd.Function):
    """Identity; when the gradient reaches it (the start of a micro-batch's backward), the
    replay handle's routers switch to REPLAY_BACKWARD so that recompute replays the same routes."""

    @staticmethod
    def forward(ctx, x, handle):
        ctx.handle = handle
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.handle._set_action("REPLAY_BACKWARD")
        return grad, None


class R3Replay:
    """The R3RouterReplay instances of one model (all chunks on this rank), by global layer."""

    def __init__(self, routers: list, moe_layers: Sequence[int], models):
        self.routers = routers  # R3RouterReplay instances, ascending global layer
        self.moe_layers = list(moe_layers)
        self.columns = [self.moe_layers.index(r.layer) for r in routers]
        self.active = False
        self._hooks = [m.register_forward_hook(self._wrap_output) for m in models]
        params = (p for m in models for p in m.parameters())
        self.device = next(params, torch.empty(0)).device  # where the routers run

    # ------------------------------------------------------------------ construction
    @classmethod
    def attach(cls, models, moe_layers: Sequence[int]) -> "R3Replay":
        """Finds this model's R3 routers (built with moe_enable_routing_replay=True, which puts
        R3TopKRouter in the layer spec) and keys their replay state by global layer."""
        from megatron.core.transformer.moe.router import TopKRouter

        moe_layers = list(moe_layers)
        routers, missing_replay = [], []
        for model in models:
            for module in model.modules():
                if not isinstance(module, TopKRouter):
                    continue
                if module.layer_number is None:
                    raise R3Error("R3: a router has no layer number (megatron did not set it)")
                layer = int(module.layer_number) - 1
                if layer not in moe_layers:
                    raise R3Error(f"R3: router of global layer {layer} is not in the MoE layers {moe_layers}")
                rr = getattr(module, "router_replay", None)
                if not isinstance(rr, R3RouterReplay):
                    missing_replay.append(layer)
                    continue
                rr.layer = layer
                routers.append(rr)
        if missing_replay:
            raise R3Error(
                f"R3: routers of layers {missing_replay} have no R3 replay: build the model with "
                "moe_enable_routing_replay=True (the bridge then builds the R3 router)"
            )
        layers = [r.layer for r in routers]
        if len(set(layers)) != len(layers):
            raise R3Error(f"R3: duplicate router layers {layers}")
        routers.sort(key=lambda r: r.layer)
        return cls(routers, moe_layers, models)

    # ------------------------------------------------------------------ actions
    def _set_action(self, name: str | None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.routers:
            if name is None:
                r.clear_router_replay_action()
            else:
                r.set_router_replay_action(getattr(RouterReplayAction, name))

    def _wrap_output(self, module, args, output):
        if self.active and isinstance(output, Tensor) and output.requires_grad:
            return _SwitchToReplayBackward.apply(output, self)
        return output

    def set_microbatch(self, routes: Tensor, complete: bool | None = None) -> None:
        """Targets for the next forward: routes [tokens_local, num_moe_layers, topk] in router
        order (`microbatch_routes`); this rank's layers read their own columns. `complete`: no
        row missing (-1), when the caller knows it already (read here otherwise: a device sync
        when routes are on the GPU)."""
        if not self.active:
            raise RuntimeError("R3: set_microbatch outside R3Replay.session()")
        if routes.dim() != 3 or routes.shape[1] != len(self.moe_layers):
            raise R3Error(f"R3: micro-batch routes {tuple(routes.shape)} need {len(self.moe_layers)} MoE layer columns")
        # once per micro-batch, not per layer: the missing-row check on the host (a complete
        # micro-batch skips every layer's live top-k) and one copy to the routers' device, laid
        # out [layer, token, k] so that each layer's targets are a contiguous slice
        if complete is None:
            complete = not bool((routes < 0).any())
        by_layer = routes.to(self.device, dtype=torch.long).permute(1, 0, 2).contiguous()
        for r, col in zip(self.routers, self.columns):
            r.set_target_indices(by_layer[col], complete=complete)
        self._set_action("REPLAY_FORWARD")

    @contextlib.contextmanager
    def session(self):
        """Replay window around one run_microbatches call; indices and actions cleared after."""
        self.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            self.clear()

    @contextlib.contextmanager
    def recording(self):
        """RECORD action (megatron's own): each router keeps the last forward's top-k."""
        self.clear()
        self._set_action("RECORD")
        try:
            yield self
        finally:
            self.clear()

    @contextlib.contextmanager
    def capturing(self):
        """Keeps, per router, the top-k indices used by every forward (tests, diagnostics):
        yields {global layer: [Tensor [tokens_local, topk], ...]}."""
        store = {r.layer: [] for r in self.routers}
        for r in self.routers:
            r.capture = store[r.layer]
        try:
            yield store
        finally:
            for r in self.routers:
                r.capture = None

    def clear(self) -> None:
        for r in self.routers:
            r.clear_indices()
            r.clear_router_replay_action()

    def remove(self) -> None:
        """Drops the output hooks (the routers stay; without a session they route live)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
