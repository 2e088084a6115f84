"""ParamIndex: the per-sync lookup that decides whether the bucket plan is stale.

Reference: the module's own named_parameters()/named_buffers() after each change."""

import pytest
import torch
from torch import nn

from skyrl_mega.weight_sync.params import ParamIndex


def _model():
    m = nn.Module()
    m.decoder = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
    m.router = nn.Module()
    m.router.register_buffer("expert_bias", torch.zeros(3))
    m.router.register_buffer("other_buffer", torch.zeros(3))  # not exported
    return m


def _reference(m):
    return [p for _, p in m.named_parameters()] + [m.router.expert_bias]


def test_lookup_follows_replaced_tensors_and_shapes_reveal_changes():
    m = _model()
    idx = ParamIndex([m])
    assert [n for _, n in idx.keys] == [n for n, _ in m.named_parameters()] + ["router.expert_bias"]
    ts = idx.lookup()
    assert all(a is b for a, b in zip(ts, _reference(m)))
    before = ParamIndex.shapes(ts)
    assert ParamIndex.shapes(idx.lookup()) == before

    m.decoder[0].weight = nn.Parameter(torch.ones(8, 4))  # new tensor, same shape: plan still valid
    m.router.expert_bias = torch.ones(3)
    ts = idx.lookup()
    assert all(a is b for a, b in zip(ts, _reference(m)))
    assert all(idx.get(i) is t for i, t in enumerate(_reference(m)))  # one tensor at a time, as the export reads
    assert ParamIndex.shapes(ts) == before

    m.decoder[0].weight.data = torch.ones(8, 5)  # same Parameter object, new shape: stale
    assert ParamIndex.shapes(idx.lookup()) != before
    m.decoder[0].weight.data = torch.ones(8, 4, dtype=torch.float64)  # new dtype: stale
    assert ParamIndex.shapes(idx.lookup()) != before


def test_lookup_raises_when_a_parameter_is_gone():
    m = _model()
    idx = ParamIndex([m])
    del m.decoder[1].bias
    with pytest.raises(KeyError, match="decoder.1.bias"):
        idx.lookup()
    assert idx.get(idx.pos[(0, "decoder.1.bias")]) is None


def test_chunked_map_equals_map_across_chunk_boundaries(monkeypatch):
    from skyrl_mega.weight_sync import params

    monkeypatch.setattr(params, "MAP_CHUNK", 4)
    for n in (0, 1, 4, 5, 9, 12):
        a, b = list(range(n)), list(range(100, 100 + n + 3))
        assert params.chunked_map(lambda x, y: (x, y), a, b) == list(zip(a, b))
