"""Packing layouts, CP zig-zag, token-budget micro-batches (pure functions, no process group)."""

import pytest
import torch

from skyrl_mega.megatron.packing import (
    MicroBatchLayout,
    balanced_partition,
    cp_zigzag_positions,
    pad_multiple,
    plan_microbatches,
    shard_for_dp,
    sp_slice,
)

LENGTHS = [5, 17, 2, 9, 30, 1]


def _samples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (n,), generator=g) for n in lengths]


def test_pad_multiple():
    assert pad_multiple(1, 1) == 1
    assert pad_multiple(2, 1) == 2
    assert pad_multiple(2, 2) == 8  # every zig-zag chunk is a whole number of SP slices
    assert pad_multiple(1, 4) == 8


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_packed_layout_cu_seqlens_positions_and_round_trip(multiple):
    ids = _samples(LENGTHS)
    lay = MicroBatchLayout.build(LENGTHS, packed=True, multiple=multiple)
    padded = [-(-n // multiple) * multiple for n in LENGTHS]
    assert lay.rows == 1 and lay.width == sum(padded) and lay.width % multiple == 0
    assert lay.cu_seqlens().tolist() == [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    assert lay.cu_seqlens(padded=True).tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
    assert lay.cu_seqlens().dtype == torch.int32
    pos = lay.position_ids()[0]
    for a, p in zip(lay.cu_seqlens(True).tolist(), padded):
        assert pos[a : a + p].tolist() == list(range(p))  # restarts per sequence
    packed = lay.scatter(ids, fill=-7)
    assert packed.shape == (1, lay.width)
    assert (packed == -7).sum() == sum(padded) - sum(LENGTHS)
    for a, b in zip(lay.gather(packed), ids):
        assert torch.equal(a, b)  # unpack is exact
    psp = lay.packed_seq_params()
    assert psp.qkv_format == "thd" and psp.max_seqlen_q == max(padded)
    assert torch.equal(psp.cu_seqlens_q_padded, lay.cu_seqlens(True))


def test_round_trip_with_trailing_dims():
    x = [torch.randn(n, 3, 2) for n in LENGTHS]
    lay = MicroBatchLayout.build(LENGTHS, packed=True, multiple=4)
    out = lay.gather(lay.scatter(x, fill=0.0))
    assert all(torch.equal(a, b) for a, b in zip(out, x))
    with pytest.raises(ValueError, match="sample 1"):
        lay.scatter([x[0], x[0]] + x[2:])


def test_padded_layout():
    ids = _samples(LENGTHS)
    lay = MicroBatchLayout.build(LENGTHS, packed=False, multiple=4)
    assert lay.rows == len(LENGTHS) and lay.width == 32
    x = lay.scatter(ids, fill=0)
    assert x.shape == (len(LENGTHS), 32)
    assert all(torch.equal(a, b) for a, b in zip(lay.gather(x), ids))
    assert lay.packed_seq_params() is None
    assert lay.position_ids()[3].tolist() == list(range(32))


@pytest.mark.parametrize("packed", [True, False])
def test_next_token_labels_and_prediction_index(packed):
    """Position start+t predicts token t+1 of the same sequence; the loss rows read exactly those."""
    ids = _samples(LENGTHS)
    lay = MicroBatchLayout.build(LENGTHS, packed=packed, multiple=2)
    labels = lay.next_token_labels(ids).reshape(-1)
    idx, valid = lay.prediction_index()
    assert idx.shape == (len(LENGTHS), max(LENGTHS) - 1)
    for k, x in enumerate(ids):
        n = x.numel()
        assert valid[k].sum() == n - 1
        assert torch.equal(labels[idx[k, : n - 1]], x[1:])
    # the last token of every sequence and all padding get label 0 (never in a loss)
    last = torch.tensor([s.row * lay.width + s.start + s.length - 1 for s in lay.segments])
    assert (labels[last] == 0).all()


def test_dummy_layout_carries_no_loss():
    lay = MicroBatchLayout.dummy(4)
    assert lay.samples == [-1] and lay.width == 4
    _, valid = lay.prediction_index()
    assert not valid.any()


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_zigzag_positions(cp):
    lens = [8 * cp, 4 * cp, 2 * cp]
    lay = MicroBatchLayout.build(lens, packed=True, multiple=2 * cp)
    cu = lay.cu_seqlens(True)
    per_rank = [cp_zigzag_positions(cu, cp, r) for r in range(cp)]
    assert all(p.numel() == lay.width // cp for p in per_rank)
    assert torch.equal(torch.sort(torch.cat(per_rank)).values, torch.arange(lay.width))
    # rank r: chunks r and 2cp-1-r of each sequence
    n, c = lens[0], lens[0] // (2 * cp)
    r0 = per_rank[0][: 2 * c].tolist()
    assert r0 == list(range(0, c)) + list(range(n - c, n))
    # to_local / full_to_local agree
    x = torch.arange(lay.width).view(1, -1)
    for r in range(cp):
        lr = MicroBatchLayout.build(lens, packed=True, multiple=2 * cp, cp_size=cp, cp_rank=r)
        local = lr.to_local(x)
        assert torch.equal(local[0], per_rank[r])
        f2l = lr.full_to_local()
        assert torch.equal(f2l[per_rank[r]], torch.arange(per_rank[r].numel()))
        assert (f2l >= 0).sum() == per_rank[r].numel()
    with pytest.raises(ValueError):
        cp_zigzag_positions(torch.tensor([0, 6]), 2, 0)


def test_sp_slice():
    assert sp_slice(8, 2, 1) == slice(4, 8)
    with pytest.raises(ValueError, match="divisible"):
        sp_slice(7, 2, 0)


def test_balanced_partition_fits_budget_covers_all_and_is_deterministic():
    g = torch.Generator().manual_seed(3)
    costs = torch.randint(1, 60, (40,), generator=g).tolist()
    parts = balanced_partition(costs, 100)
    assert parts == balanced_partition(costs, 100)
    assert sorted(i for p in parts for i in p) == list(range(40))
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) <= 100
    assert len(parts) <= -(-sum(costs) // 100) + 2  # close to the lower bound
    assert max(loads) - min(loads) <= max(costs)  # balanced
    assert all(p == sorted(p) for p in parts)
    assert len(balanced_partition(costs, 100, min_parts=len(parts) + 3)) == len(parts) + 3


def test_balanced_partition_rejects_a_sequence_over_budget():
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        balanced_partition([10, 200, 5], 100)


def test_plan_microbatches_modes():
    lens = [5, 17, 2, 9, 30, 1, 12, 8]
    packed = plan_microbatches(lens, packed=True, max_tokens=32, tp=2)
    assert all(lay.packed and lay.width <= 32 and lay.width % 2 == 0 for lay in packed)
    assert sorted(s for lay in packed for s in lay.samples) == list(range(8))
    fixed = plan_microbatches(lens, packed=True, micro_batch_size=3)
    assert [lay.samples for lay in fixed] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    padded = plan_microbatches(lens, packed=False, micro_batch_size=4, tp=2)
    assert [lay.rows for lay in padded] == [4, 4] and [lay.width for lay in padded] == [18, 30]


def test_pad_to_rounds_every_packed_row_up_and_keeps_the_tokens():
    lens = [5, 3, 7, 9, 2, 6]
    plain = plan_microbatches(lens, packed=True, max_tokens=16, tp=2)
    padded = plan_microbatches(lens, packed=True, max_tokens=16, tp=2, pad_to=11)  # unit 12 (TP multiple)
    assert [m.width for m in padded] == [-(-m.width // 12) * 12 for m in plain] and len(padded) == len(plain)
    for a, b in zip(plain, padded):
        assert [(s.sample, s.start, s.length) for s in a.segments] == [(s.sample, s.start, s.length) for s in b.segments]
        assert a.segments[-1].padded + b.width - a.width == b.segments[-1].padded
        assert torch.equal(a.cu_seqlens(), b.cu_seqlens())  # real tokens: the same sequences
        assert int(b.cu_seqlens(padded=True)[-1]) == b.width
        ids = [_samples(lens)[i] for i in b.samples]
        row = b.scatter(ids, fill=-7)
        assert row.shape == (1, b.width) and (row == -7).sum() == b.width - sum(lens[i] for i in b.samples)
        assert all(torch.equal(u, v) for u, v in zip(b.gather(row), ids))
        assert torch.equal(row[:, : a.width], a.scatter(ids, fill=-7))
        assert torch.equal(b.position_ids()[0, : a.width], a.position_ids()[0])
    with pytest.raises(ValueError, match="no wider"):
        plain[0].padded_to(plain[0].width - 2)


def test_shard_for_dp_is_a_balanced_partition():
    lens = [5, 17, 2, 9, 30, 1, 12, 8]
    shards = [shard_for_dp(lens, 3, r) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(8))
    counts = [len(s) for s in shards]
    assert max(counts) - min(counts) <= 1
    assert shard_for_dp(lens, 1, 0) == list(range(8))


def test_packed_seq_params_carry_the_sequence_index_where_megatron_reads_it():
    """megatron-core 0.19 Mamba layers take seq_idx from PackedSeqParams, built only from
    total_tokens (without it their state runs across the packed sequences); 0.16 builds it in
    the mixer from cu_seqlens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if "total_tokens" not in PackedSeqParams.__dataclass_fields__:
        pytest.skip("this megatron-core builds seq_idx in the Mamba mixer from cu_seqlens")
    lay = MicroBatchLayout.build([3, 2, 4], packed=True, multiple=2)
    psp = lay.packed_seq_params()
    assert psp.seq_idx.flatten().tolist() == [0] * 4 + [1] * 2 + [2] * 4


def test_train_step_packing_gives_megatron_0_19_mamba_layers_their_sequence_starts(monkeypatch):
    """megatron-core 0.19's Mamba layers restart their state only where PackedSeqParams.seq_idx
    says, and build it only from `total_tokens`; the train step's packed micro-batches must set it
    (without it the state runs across the packed sequences). Here a 0.19-shaped PackedSeqParams."""
    import dataclasses

    import megatron.core.packed_seq_params as psp

    from skyrl_mega.megatron.step_inputs import _kwargs_fn

    @dataclasses.dataclass
    class PackedSeqParams019(psp.PackedSeqParams):
        total_tokens: int = None

    monkeypatch.setattr(psp, "PackedSeqParams", PackedSeqParams019)
    layout = plan_microbatches([5, 3, 7], packed=True, max_tokens=64, tp=2)[0]
    mb = {"layout": layout, "cu_seqlens": layout.cu_seqlens(False), "cu_seqlens_padded": layout.cu_seqlens(True)}
    params = _kwargs_fn(None)(mb)["packed_seq_params"]
    assert params.total_tokens == int(layout.cu_seqlens(True)[-1]) == 18  # 6 + 4 + 8, padded to tp
    assert params.qkv_format == "thd" and params.max_seqlen_q == layout.max_seqlen
