"""The fast layer spec (grouped-GEMM experts, varlen flash attention) against the local spec.

On real torchrun gloo ranks (tests/workers/fast_spec_worker.py): the same HF weights built with
model.spec=local and model.spec=fast, the same packed RL batch with R3 replaying the same routes:
logprobs, RL-loss gradients and the weights after one update agree to fp32 rounding, for every
family and for the expert layouts that shard the experts (EP, expert TP). On CPU torch's grouped
GEMM runs (fp32) and the varlen flash kernel does not (CUDA only: the fast attention keeps the
per-sequence SDPA there, checked on GPU by tests/test_fast_spec_gpu.py).
"""

import json
import os

import pytest
import torch

from skyrl_mega.launcher import run_torchrun
from skyrl_mega.megatron import specs
from skyrl_mega.megatron.kernels.grouped_mm import expert_linear, grouped_linear, grouped_mm_runs

from .conftest import REPO

LAYOUTS = {"ws1": (1, []), "ep2": (2, ["parallel.ep=2"]), "tp2": (2, ["parallel.tp=2"])}
CASES = [("qwen3_moe", "ws1"), ("qwen3_moe", "ep2"), ("qwen3_moe", "tp2"), ("nemotron3", "ws1"),
         ("qwen3_5_moe", "ws1")]


@pytest.mark.multiprocess
@pytest.mark.parametrize("family, layout", CASES)
def test_fast_spec_equals_local_spec(family, layout, request, tmp_path):
    nproc, extra = LAYOUTS[layout]
    model = request.getfixturevalue(f"tiny_{family}")
    run_torchrun(os.path.join(REPO, "tests/workers/fast_spec_worker.py"), nproc,
                 [str(tmp_path), f"model.path={model}", *extra], timeout=400, log_file=str(tmp_path / "log.txt"))
    r = json.load(open(tmp_path / "fast_spec.json"))
    local, fast = r["local"]["slots"], r["fast"]["slots"]
    assert (local["experts"], local["core_attention"]) == (["SequentialMLP"], ["SdpaDotProductAttention"])
    assert (fast["experts"], fast["core_attention"]) == (["GroupedGemmExperts"], ["VarlenDotProductAttention"])
    # (the hybrids' other layers hold an IdentityOp / MLP in these slots)
    assert "SelfAttention" in local["self_attention"] and "SelfAttention" not in fast["self_attention"]
    assert "PackedRopeSelfAttention" in fast["self_attention"]
    assert "MoELayer" in local["mlp"] and "MoELayer" not in fast["mlp"] and "SyncFreeMoELayer" in fast["mlp"]
    assert r["local"]["grouped_gemms"] == 0 and r["fast"]["grouped_gemms"] > 0  # the grouped path ran
    # the sync-free dispatch where every expert is local, megatron's dispatcher where tokens move
    local_experts = layout == "ws1"
    assert fast["token_dispatcher"] == (["LocalExpertsDispatcher"] if local_experts else local["token_dispatcher"])
    assert (r["fast"]["device_sorts"] > 0) == local_experts and r["local"]["device_sorts"] == 0
    # RoPE from device positions wherever the family has RoPE on THD (Nemotron 3's attention has none)
    assert (r["fast"]["packed_rope_calls"] > 0) == (family != "nemotron3") and r["local"]["packed_rope_calls"] == 0
    assert r["fast"]["r3_coverage"] == r["local"]["r3_coverage"] == 1.0
    for name in ("logprobs", "grads", "weights_after_update"):
        assert r[f"{name}_rel_diff"] < 1e-5, (name, r)


def test_grouped_linear_equals_per_group_matmuls_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    sizes = [5, 0, 11, 3]
    x = torch.randn(sum(sizes), 16, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(len(sizes), 8, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    offs = torch.tensor(sizes).cumsum(0).int()
    assert grouped_mm_runs(x, w)
    y = grouped_linear(x, w, offs)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    ref, dx, dws = _per_expert_reference(x, list(w), sizes, dy)  # float64, one matmul per group
    assert (y.double() - ref).abs().max() < 1e-5
    assert (x.grad.double() - dx).abs().max() < 1e-5 and (w.grad.double() - torch.stack(dws)).abs().max() < 1e-5


def _per_expert_reference(x, weights, sizes, dy):
    """float64: one matmul per expert; returns y, dx, [dW_e]."""
    x64 = x.detach().double().requires_grad_()
    w64 = [w.detach().double().requires_grad_() for w in weights]
    parts, start = [], 0
    for e, n in enumerate(sizes):
        parts.append(x64[start:start + n] @ w64[e].T)
        start += n
    ref = torch.cat(parts)
    ref.backward(dy.double())
    return ref, x64.grad, [w.grad for w in w64]


@pytest.mark.parametrize("layout", ["no_main_grad", "ascending", "descending", "uneven"])
def test_expert_linear_adds_weight_gradients_into_megatron_main_grads(layout):
    """expert_linear vs float64 per-expert matmuls, twice (two micro-batches accumulate): without
    main_grad the gradients land in .grad; with megatron's buffer slices (back to back in either
    order, or unevenly spaced) they are added into main_grad and .grad is a placeholder."""
    g = torch.Generator().manual_seed(0)
    sizes, n, k = [5, 0, 11, 3], 8, 16
    weights = [torch.randn(n, k, generator=g).requires_grad_() for _ in sizes]
    if layout != "no_main_grad":
        gap = {"ascending": 0, "descending": 0, "uneven": 7}[layout]
        buf = torch.zeros(len(sizes) * (n * k + gap) + gap * len(sizes))
        order = list(range(len(sizes)))[::-1] if layout == "descending" else range(len(sizes))
        at = 0
        for i in order:
            weights[i].main_grad = buf[at: at + n * k].view(n, k)
            weights[i].grad_added_to_main_grad = False
            at += n * k + gap * (i + 1)  # uneven: a different gap after each slice
    total = [torch.zeros(n, k, dtype=torch.float64) for _ in sizes]
    for _ in range(2):
        x = torch.randn(sum(sizes), k, generator=g).requires_grad_()
        y = expert_linear(x, weights, torch.tensor(sizes).cumsum(0).int())
        dy = torch.randn(y.shape, generator=g)
        y.backward(dy)
        ref, dx, dws = _per_expert_reference(x, weights, sizes, dy)
        assert (y.double() - ref).abs().max() < 1e-5 and (x.grad.double() - dx).abs().max() < 1e-5
        total = [t + d for t, d in zip(total, dws)]
        if layout == "no_main_grad":
            for w, d in zip(weights, dws):
                assert (w.grad.double() - d).abs().max() < 1e-5
                w.grad = None
        else:  # megatron's hook drops .grad once the gradient is in main_grad
            assert all(w.grad_added_to_main_grad for w in weights)
            for w in weights:
                w.grad = None
    if layout != "no_main_grad":
        for w, t in zip(weights, total):
            assert (w.main_grad.double() - t).abs().max() < 1e-5


def test_grouped_gemm_is_not_used_where_torch_cannot_run_it():
    x = torch.randn(4, 16)
    assert not grouped_mm_runs(x, torch.randn(2, 6, 16))  # 6 floats = 24 bytes: rows not 16-byte aligned
    assert not grouped_mm_runs(x.double(), torch.randn(2, 8, 16, dtype=torch.float64))  # no float64 kernel
    assert not grouped_mm_runs(x, torch.randn(2, 8, 16, dtype=torch.bfloat16))  # mixed dtypes


def test_auto_picks_te_then_fast_on_cuda_then_local(monkeypatch):
    monkeypatch.setattr(specs, "te_available", lambda: False)
    monkeypatch.setattr(specs, "cuda_available", lambda: True)
    assert [specs.resolve_spec("auto", f) for f in ("qwen3_moe", "nemotron_h", "qwen3_5_moe")] == ["fast"] * 3
    monkeypatch.setattr(specs, "cuda_available", lambda: False)
    assert specs.resolve_spec("auto", "qwen3_moe") == "local"
    assert specs.resolve_spec("fast", "nemotron_h") == "fast"  # chosen explicitly: also on CPU
    monkeypatch.setattr(specs, "te_available", lambda: True)
    monkeypatch.setattr(specs, "cuda_available", lambda: True)
    assert specs.resolve_spec("auto", "qwen3_moe") == "te"
    assert specs.resolve_spec("auto", "nemotron_h") == "fast"  # no TE spec for the hybrids

