"""CopyPlan (weight_sync/copy_plan.py): the receiver's unpack copies against a per-tensor reference.

The layouts are the ones a receiver meets: a Megatron DDP buffer (experts in descending
address order, fc1/fc2 interleaved: the sources of one kind sit at a negative stride), a
packed bucket (ascending), odd sizes that force narrow element types, and short runs.
Every mode (strided index_select, memcpy loop, _foreach_copy_, chains through _foreach_copy_)
must land exactly the
bytes a tensor-by-tensor copy lands.
"""

import pytest
import torch

from skyrl_mega.weight_sync import row_copy
from skyrl_mega.weight_sync.copy_plan import CopyPlan


def _layout(E: int, n1: int, n2: int, descending: bool, pad: int = 0):
    """Byte offsets of (fc1, fc2) per expert in a source buffer of bf16 elements."""
    pair = (n1 + n2 + pad) * 2
    offs = []
    for e in range(E):
        slot = (E - 1 - e) if descending else e
        offs.append((slot * pair, slot * pair + n1 * 2))
    return offs, E * pair


@pytest.mark.parametrize("descending", [True, False])
@pytest.mark.parametrize("n1,n2,pad", [(64, 32, 0), (66, 33, 3), (4096, 2048, 64)])
@pytest.mark.parametrize("mode", ["strided", "memcpy", "foreach", "chains_foreach"])
def test_copy_plan_matches_per_tensor_copies(descending, n1, n2, pad, mode, monkeypatch):
    E = 8
    offs, total = _layout(E, n1, n2, descending, pad)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (total + 64,), dtype=torch.uint8, generator=g)
    gate_up = torch.zeros(E, n1, dtype=torch.bfloat16)  # destination "parameters"
    down = torch.zeros(E, n2, dtype=torch.bfloat16)
    gu_flat, down_flat = gate_up.view(-1), down.view(-1)  # one flat view per parameter, as receivers keep
    cp = CopyPlan()
    slot = 0
    for e, (o1, o2) in enumerate(offs):  # the order a sender lists them: expert by expert
        cp.add("s", o1, torch.bfloat16, gu_flat, e * n1, n1, slot)
        cp.add("s", o2, torch.bfloat16, down_flat, e * n2, n2, slot + 1)
        slot += 2
    cp.add("s", total, torch.bfloat16, torch.zeros(8, dtype=torch.bfloat16), 0, 8, slot)  # a short, lone run
    monkeypatch.setattr(CopyPlan, "strided", mode in ("strided", "chains_foreach"))
    monkeypatch.setattr(CopyPlan, "loop_min_bytes", 1 if mode in ("memcpy", "chains_foreach") else 1 << 62)
    if mode == "chains_foreach":  # the chains' runs into the _foreach_copy_ lists, whatever their size
        monkeypatch.setattr(CopyPlan, "chain_mode", "foreach")
    cp.execute({"s": src})
    for e, (o1, o2) in enumerate(offs):
        assert torch.equal(gate_up[e].view(torch.uint8), src[o1: o1 + n1 * 2]), e
        assert torch.equal(down[e].view(torch.uint8), src[o2: o2 + n2 * 2]), e
    strided, big, dsts, _ = cp.bind({"s": src})
    assert len(strided) == (2 if mode == "strided" else 0)
    if mode == "chains_foreach":
        assert (len(big), len(dsts)) == (1, 2 * E)  # only the lone run is copied on its own
    # a second execute with new source bytes reuses the bound views and lands the new bytes
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, generator=g))
    cp.execute({"s": src})
    o1, o2 = offs[3]
    assert torch.equal(gate_up[3].view(torch.uint8), src[o1: o1 + n1 * 2])
    assert torch.equal(down[3].view(torch.uint8), src[o2: o2 + n2 * 2])


def test_every_timed_way_lands_the_same_bytes():
    """The ways `chain_mode="auto"` times on CUDA (CopyPlan.WAYS), bound and launched here on the
    CPU one by one: each lands exactly the bytes, and the big-runs-in-foreach way puts the big
    runs in the multi-tensor lists (one launch) instead of one copy each."""
    E, n1, n2 = 6, 4096, 2048
    offs, total = _layout(E, n1, n2, descending=True)
    src = torch.randint(0, 256, (total + 64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for name, (mode, loop_big) in CopyPlan.WAYS.items():
        gate_up, down = torch.zeros(E, n1, dtype=torch.bfloat16), torch.zeros(E, n2, dtype=torch.bfloat16)
        if mode == "row_copy" and not row_copy.available(gate_up):
            continue  # the Triton kernel runs on CUDA (tests/test_copy_plan_gpu.py)
        lone = torch.zeros(1 << 19, dtype=torch.bfloat16)  # 1 MiB: a big run of its own
        cp = CopyPlan()
        gu_flat, down_flat = gate_up.view(-1), down.view(-1)  # one flat view per parameter, as receivers keep
        for e, (o1, o2) in enumerate(offs):
            cp.add("s", o1, torch.bfloat16, gu_flat, e * n1, n1, 2 * e)
            cp.add("s", o2, torch.bfloat16, down_flat, e * n2, n2, 2 * e + 1)
        src_big = torch.randint(0, 256, (lone.numel() * 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
        cp.add("b", 0, torch.bfloat16, lone, 0, lone.numel(), 2 * E)
        sources = {"s": src, "b": src_big}
        chains, rest = cp._chains()
        bound = cp._bound_as(mode, chains, rest, sources, loop_big)
        assert bound is not None, name
        CopyPlan._launch(*bound)
        for e, (o1, o2) in enumerate(offs):
            assert torch.equal(gate_up[e].view(torch.uint8), src[o1: o1 + n1 * 2]), (name, e)
            assert torch.equal(down[e].view(torch.uint8), src[o2: o2 + n2 * 2]), (name, e)
        assert torch.equal(lone.view(torch.uint8), src_big), name
        assert cp._landed(sources), name  # the check "auto" runs after timing each way on CUDA
        down[2, 5] += 1  # one wrong element: the check sees it
        assert not cp._landed(sources), name
        assert len(bound[1]) == (1 if loop_big else 0), name  # the big run: looped, or in the foreach lists
        assert len(bound[0]) == (0 if mode == "foreach" else 2), name  # gate_up's and down's chains
    cp = CopyPlan()  # no big run: the big-runs-in-foreach way would copy the same way, so it is not timed
    cp.add("s", 0, torch.bfloat16, torch.zeros(8, dtype=torch.bfloat16), 0, 8, 0)
    assert cp._bound_as("index_select", [], cp.runs, {"s": src}, loop_big=False) is None


def test_byte_runs_merge_only_back_to_back_pieces_of_one_storage():
    """ipc_handles.byte_runs (the exporter's own rows and the peer reads): the runs copy exactly
    the bytes a piece-by-piece copy would, merging only what is contiguous in one storage."""
    from skyrl_mega.weight_sync.ipc_handles import byte_runs

    a = torch.arange(100, dtype=torch.uint8)
    b = torch.arange(100, 150, dtype=torch.uint8)
    pieces = [(a, 0, 10), (a, 10, 20), (a, 40, 5), (b, 0, 7), (a, 45, 5)]  # gap, other storage
    runs = byte_runs(pieces)
    assert [(p, n) for _, p, n in runs] == [(0, 30), (30, 5), (35, 7), (42, 5)]
    row = torch.cat([src for src, _, _ in runs])
    assert torch.equal(row, torch.cat([w[o: o + n] for w, o, n in pieces]))
