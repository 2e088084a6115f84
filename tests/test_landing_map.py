"""landing_map.py: a map learned from a model's own loaders copies the same bytes as load_weights.

The model below loads like a vLLM model (stacked q/k/v into one qkv parameter, per-expert
gate/up/down into fused [E, 2I, H] / [E, H, I] parameters, a name the loader ignores); the
reference is its own load_weights on the same tensors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from skyrl_mega.weight_sync import landing_map
from skyrl_mega.weight_sync.checksum import tensor_checksum

H, I, E = 8, 6, 4


class VllmLike(torch.nn.Module):
    def __init__(self, transpose_down=False, fill_norm=False, pad=0):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(3 * H, H), requires_grad=False)
        self.w13 = torch.nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
        shape = (E, I, H) if transpose_down else (E, H, I)  # a loader that stores down_proj transposed
        self.w2 = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(H + pad), requires_grad=False)  # padded like a vocab
        self.transpose_down, self.fill_norm = transpose_down, fill_norm

    def load_weights(self, weights):
        for name, w in weights:
            if name.endswith("inv_freq"):
                continue
            part, _, leaf = name.rpartition(".")
            if leaf in ("q_proj", "k_proj", "v_proj"):
                k = ("q_proj", "k_proj", "v_proj").index(leaf)
                self.qkv.data.narrow(0, k * H, H).copy_(w)
            elif leaf in ("gate_proj", "up_proj"):
                e = int(part.split(".")[-1])
                k = 0 if leaf == "gate_proj" else 1
                self.w13.data[e].narrow(0, k * I, I).copy_(w)
            elif leaf == "down_proj":
                e = int(part.split(".")[-1])
                self.w2.data[e].copy_(w.t() if self.transpose_down else w)
            elif leaf == "norm":
                if self.fill_norm:
                    self.norm.data.fill_(0)
                self.norm.data[: w.numel()].copy_(w)
                self.norm.data[w.numel():].fill_(0)  # like vLLM's vocab padding (often empty)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [(f"attn.{p}", torch.randn(H, H, generator=g)) for p in ("q_proj", "k_proj", "v_proj")]
    for e in range(E):
        out += [(f"experts.{e}.gate_proj", torch.randn(I, H, generator=g)),
                (f"experts.{e}.up_proj", torch.randn(I, H, generator=g)),
                (f"experts.{e}.down_proj", torch.randn(H, I, generator=g))]
    out += [("norm", torch.randn(H, generator=g)), ("rotary.inv_freq", torch.randn(4, generator=g))]
    return out


def _specs(tensors):
    return [(n, "float32", list(t.shape)) for n, t in tensors]


def _packed(tensors):
    """One uint8 buffer holding every tensor back to back, and the update's table."""
    buf, table, off = [], [], 0
    for i, (n, t) in enumerate(tensors):
        b = t.contiguous().view(-1).view(torch.uint8)
        table.append([n, "float32", list(t.shape), 0, off, b.numel(), i])
        buf.append(b)
        off += b.numel()
    return torch.cat(buf), table


@pytest.mark.parametrize("pad", [0, 3])
def test_map_copies_equal_load_weights_and_verify_catches_other_bytes(pad):
    ref, fast = VllmLike(pad=pad), VllmLike(pad=pad)
    first = _tensors(0)
    ref.load_weights(first)
    fast.load_weights(first)  # the reference load of the first sync
    specs = _specs(first)
    lmap = landing_map.learn(fast, specs, "cpu")
    assert isinstance(lmap, landing_map.LandingMap), lmap
    assert lmap.skipped == {"rotary.inv_freq"} and len(lmap.where) == len(first) - 1
    assert landing_map.verify(lmap, specs, {n: tensor_checksum(t) for n, t in first}) is None
    # learning ran the loaders but copied nothing
    for (n, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
        assert torch.equal(p, q), n

    second = _tensors(1)
    buf, table = _packed(second)
    plan, rows = landing_map.copy_plan(lmap, table)
    plan.execute({0: buf})
    ref.load_weights(second)
    for (n, p), (_, q) in zip(ref.named_parameters(), fast.named_parameters()):
        assert torch.equal(p, q), n
    assert len(rows) == len(second) - 1
    # merged where source and destination are back to back: q/k/v one run, each expert's
    # gate+up one run, its down_proj one, the norm one
    assert len(plan.runs) == 1 + 2 * E + 1

    sums = {n: tensor_checksum(t) for n, t in second}
    sums["experts.2.up_proj"] = sums["experts.2.up_proj"] + 1
    why = landing_map.verify(lmap, specs, sums)
    assert why and "experts.2.up_proj" in why


def test_map_is_refused_for_loaders_that_do_more_than_copy_bytes():
    tensors = _tensors(0)
    assert "not copied byte for byte" in landing_map.learn(VllmLike(transpose_down=True), _specs(tensors), "cpu")
    assert "norm is not covered exactly" in landing_map.learn(VllmLike(fill_norm=True), _specs(tensors), "cpu")
    # a parameter the sent tensors do not fill (no norm sent)
    partial = [t for t in tensors if t[0] != "norm"]
    assert "norm is not loaded" in landing_map.learn(VllmLike(), _specs(partial), "cpu")


def test_map_goes_stale_when_parameters_move():
    m = VllmLike()
    lmap = landing_map.learn(m, _specs(_tensors(0)), "cpu")
    assert lmap.fresh(m) and lmap.slots  # the quick check (no module walk)
    m.w2 = torch.nn.Parameter(torch.zeros(E, H, I), requires_grad=False)  # a replaced parameter
    assert not lmap.fresh(m)
    m = VllmLike()
    lmap = landing_map.learn(m, _specs(_tensors(0)), "cpu")
    m.w2.data = torch.zeros(E, H, I)  # the same parameter, moved to new memory
    assert not lmap.fresh(m)
    without_slots = dataclasses.replace(lmap, slots=())  # the full walk says the same
    assert not without_slots.fresh(m)


def test_learning_failure_is_a_reason_not_an_exception():
    m = VllmLike()
    why = landing_map.learn(m, [("experts.x.gate_proj", "float32", [I, H])], "cpu")
    assert isinstance(why, str) and why.startswith("learning failed")
