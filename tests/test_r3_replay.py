"""R3 index transforms, live fallback, and vocab-parallel logprobs at one rank (no process group).

The multi-rank replay checks (TP/SP, EP, PP, packing, recompute) are in test_train_step.py.
"""

import pytest
import torch

from skyrl_mega.megatron.logprobs import reference_logprobs, vocab_parallel_entropy, vocab_parallel_logprobs
from skyrl_mega.megatron.packing import MicroBatchLayout
from skyrl_mega.megatron.r3_replay import (
    R3Error,
    R3RouterReplay,
    align_routes,
    microbatch_routes,
    padding_routes,
    route_positions,
)

E, K, NL = 8, 2, 3


def _routes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n * NL)]).view(n, NL, K)


def test_align_routes_engine_rows_get_a_missing_last_row():
    r = _routes(6).to(torch.uint8)[:5]
    a = align_routes(r, 6, NL, K, E)
    assert a.dtype == torch.long and a.shape == (6, NL, K)
    assert torch.equal(a[:5], r.long()) and (a[5] == -1).all()
    assert torch.equal(align_routes(_routes(6), 6, NL, K, E), _routes(6))


def test_align_routes_valid_mask_and_partial_rows():
    r = _routes(4)
    r[1, 2, 0] = -1  # a partially missing row counts as missing
    a = align_routes(r, 4, NL, K, E, valid=torch.tensor([True, True, False, True]))
    assert (a[1, 2] == -1).all() and (a[1, :2] >= 0).all()
    assert (a[2] == -1).all() and (a[3] >= 0).all()


@pytest.mark.parametrize("bad, match", [
    (lambda r: r[:, :2], "2 layers but the model has 3"),
    (lambda r: r[..., :1], "top-k 1"),
    (lambda r: r[:3], "3 rows for a sequence of 6"),
    (lambda r: r.float(), "integers"),
    (lambda r: torch.where(r == r[0, 0, 0], torch.full_like(r, E), r), r"\[0, 8\)"),
    (lambda r: torch.cat([r[:, :, :1], r[:, :, :1]], -1), "repeated expert"),
])
def test_align_routes_errors(bad, match):
    with pytest.raises(R3Error, match=match):
        align_routes(bad(_routes(6)), 6, NL, K, E)


def test_padding_routes_are_distinct_and_valid():
    p = padding_routes(50, NL, K, E)
    assert p.shape == (50, NL, K) and p.min() >= 0 and p.max() < E
    assert all(len(set(row)) == K for row in p.view(-1, K).tolist())
    assert len(set(p[:, 0].flatten().tolist())) == E  # spread over the experts
    with pytest.raises(R3Error):
        padding_routes(1, NL, 9, E)


@pytest.mark.parametrize("packed, tp", [(True, 1), (True, 2), (False, 2)])
def test_microbatch_routes_follow_tokens_through_sp_split(packed, tp):
    lens = [5, 9, 3]
    routes = [align_routes(_routes(n, seed=i)[:-1], n, NL, K, E) for i, n in enumerate(lens)]
    lay = MicroBatchLayout.build(lens, packed=packed, multiple=tp)
    per_rank = [microbatch_routes(lay, routes, num_moe_layers=NL, topk=K, num_experts=E, tp_size=tp, tp_rank=r)
                for r in range(tp)]
    total = torch.cat(per_rank)
    assert total.shape == (lay.num_tokens, NL, K)
    for r in range(tp):
        pos = route_positions(lay, tp, r)
        got = per_rank[r]
        assert pos.shape[0] == got.shape[0]
        for row, (k, t) in enumerate(pos.tolist()):
            if k < 0:  # padding: distinct valid experts
                assert got[row].min() >= 0 and all(len(set(x)) == K for x in got[row].tolist())
            else:
                assert torch.equal(got[row], routes[k][t])
    if not packed:  # router order is [s, b] flattened: s-major
        pos = torch.cat([route_positions(lay, tp, r) for r in range(tp)])
        assert pos[:3, 0].tolist() == [0, 1, 2] and pos[:3, 1].tolist() == [0, 0, 0]


def test_microbatch_routes_cp_zigzag():
    lens = [8, 4]
    routes = [_routes(n, seed=i) for i, n in enumerate(lens)]
    seen = []
    for r in range(2):
        lay = MicroBatchLayout.build(lens, packed=True, multiple=4, cp_size=2, cp_rank=r)
        got = microbatch_routes(lay, routes, num_moe_layers=NL, topk=K, num_experts=E)
        pos = route_positions(lay)
        assert got.shape[0] == pos.shape[0] == 6
        for row, (k, t) in enumerate(pos.tolist()):
            assert torch.equal(got[row], routes[k][t])
            seen.append((k, t))
    assert sorted(seen) == [(0, t) for t in range(8)] + [(1, t) for t in range(4)]


@pytest.fixture
def router():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    before = list(RouterReplay.global_router_replay_instances)
    rr = R3RouterReplay()
    assert RouterReplay.global_router_replay_instances == before  # per-model state, not megatron's list
    return rr


def _default_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_replay_router_falls_back_to_live_routing_per_token(router):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    scores = torch.randn(4, E)
    target = torch.tensor([[0, 1], [-1, -1], [5, 3], [-1, -1]])
    router.set_target_indices(target)
    router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    router.capture = []
    probs, idx = router.get_replay_topk(scores, K, None, None, _default_topk)
    live = scores.topk(K, 1).indices
    assert torch.equal(idx[[0, 2]], target[[0, 2]])
    assert torch.equal(idx[[1, 3]], live[[1, 3]])
    assert torch.equal(probs, scores.gather(1, idx))
    assert torch.equal(router.capture[0], idx)
    # recompute pops the same targets, FIFO
    router.set_target_indices(target.flip(0))
    router.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    _, i1 = router.get_replay_topk(scores, K, None, None, _default_topk)
    assert torch.equal(i1[0], target[0])
    _, i2 = router.get_replay_topk(scores, K, None, None, _default_topk)
    assert torch.equal(i2[1], target.flip(0)[1]) and torch.equal(i2[0], live[0])
    with pytest.raises(RuntimeError, match="no routes"):
        router.get_replay_topk(scores, K, None, None, _default_topk)


def test_replay_router_skips_live_routing_for_complete_targets(router):
    """Targets marked complete (R3Replay.set_microbatch checked them once for -1 rows) replay
    as they are, forward and recompute, without running the live top-k; others still do."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    calls = []

    def counting_topk(scores, topk, num_groups=None, group_topk=None):
        calls.append(1)
        return _default_topk(scores, topk)

    scores = torch.randn(3, E)
    target = torch.tensor([[0, 1], [5, 3], [2, 7]])
    router.set_target_indices(target, complete=True)
    router.set_target_indices(torch.tensor([[0, 1], [-1, -1], [2, 7]]))
    for action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
        router.set_router_replay_action(action)
        probs, idx = router.get_replay_topk(scores, K, None, None, counting_topk)
        if action == RouterReplayAction.REPLAY_FORWARD:  # the latest targets: incomplete
            assert len(calls) == 1 and torch.equal(idx[1], scores.topk(K, 1).indices[1])
        else:  # recompute pops the first (complete) targets
            assert len(calls) == 1 and torch.equal(idx, target) and torch.equal(probs, scores.gather(1, target))


def test_replay_router_rejects_a_token_count_mismatch(router):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    router.set_target_indices(torch.zeros(3, K, dtype=torch.long))
    router.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with pytest.raises(R3Error, match="router sees 4 tokens"):
        router.get_replay_topk(torch.randn(4, E), K, None, None, _default_topk)


def test_replay_router_without_action_routes_live(router):
    scores = torch.randn(5, E)
    _, idx = router.get_replay_topk(scores, K, None, None, _default_topk)
    assert torch.equal(idx, scores.topk(K, 1).indices)


def test_replay_router_records_live_routes(router):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    scores = torch.randn(5, E)
    router.set_router_replay_action(RouterReplayAction.RECORD)
    probs, idx = router.get_replay_topk(scores, K, None, None, _default_topk)
    assert torch.equal(idx, scores.topk(K, 1).indices) and torch.equal(probs, scores.topk(K, 1).values)
    assert torch.equal(router.get_recorded_indices(), idx)
    router.clear_indices()
    assert router.get_recorded_indices() is None and router.replay_backward_list == []


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_entropy_and_gradients_single_rank(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 40, generator=g, dtype=torch.float64).requires_grad_()
    labels = torch.randint(0, 36, (2, 7), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, labels, temperature, with_entropy=True, vocab_size=36)
    rlp, rent = reference_logprobs(logits.detach(), labels, temperature, vocab_size=36)
    assert (lp - rlp).abs().max() < 1e-12 and (ent - rent).abs().max() < 1e-12
    w1, w2 = torch.randn(2, 7, dtype=torch.float64), torch.randn(2, 7, dtype=torch.float64)
    grad = torch.autograd.grad((lp * w1 + ent * w2).sum(), logits)[0]
    x = logits.detach().clone().requires_grad_()
    logp = torch.log_softmax(x[..., :36] / temperature, -1)
    ref = (logp.gather(-1, labels[..., None])[..., 0] * w1 - (logp.exp() * logp).sum(-1) * w2).sum()
    rgrad = torch.autograd.grad(ref, x)[0]
    assert (grad - rgrad).abs().max() < 1e-12
    assert (grad[..., 36:] == 0).all()  # padded vocabulary entries never matter
    assert torch.allclose(vocab_parallel_entropy(logits.detach(), temperature, vocab_size=36), rent)


def test_entropy_as_metric_has_no_gradient():
    logits = torch.randn(3, 10, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(logits, torch.zeros(3, dtype=torch.long), with_entropy=True,
                                      entropy_grad=False)
    assert not ent.requires_grad and lp.requires_grad
