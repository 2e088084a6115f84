"""The fast spec's kernels on CUDA (marked gpu; skipped without it): bf16 tolerances stated here.

- varlen flash attention over a packed row equals per-sequence causal SDPA (the local spec's
  math) in output and q / k / v gradients, GQA included;
- the fast spec vs the local spec on a real torchrun rank in bf16 (tests/workers/fast_spec_worker.py,
  R3 replaying the same routes): the grouped GEMM, varlen, sync-free dispatch / RoPE and fused
  (torch.compile) paths ran, and logprobs, RL-loss gradients and updated weights agree within
  bf16 tolerance.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.gpu


def test_varlen_attention_equals_per_sequence_sdpa_bf16():
    from skyrl_mega.megatron.kernels.varlen_attention import varlen_causal_attention, varlen_runs

    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [700, 1, 129, 2048, 64]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), 8, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    k = torch.randn(sum(lens), 2, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    v = torch.randn(sum(lens), 2, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    assert varlen_runs(q)
    out = varlen_causal_attention(q, k, v, cu, max(lens), scale=0.1)
    dout = torch.randn(out.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    out.backward(dout)
    grads = [t.grad.float() for t in (q, k, v)]
    # reference: float32 SDPA, one sequence at a time
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    parts = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q2, k2, v2))
        parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.1,
                                                    enable_gqa=True)[0].transpose(0, 1))
    ref = torch.cat(parts)
    ref.backward(dout.float())
    assert (out.float() - ref).abs().max() < 2e-2
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        assert (got - want).abs().max() / want.abs().max() < 2e-2


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron3"])
def test_fast_spec_equals_local_spec_bf16(family, request, tmp_path):
    model = request.getfixturevalue(f"tiny_{family}")
    run_torchrun(os.path.join(REPO, "tests/workers/fast_spec_worker.py"), 1,
                 [str(tmp_path), f"model.path={model}", "model.dtype=bfloat16"], timeout=600,
                 log_file=str(tmp_path / "log.txt"))
    r = json.load(open(tmp_path / "fast_spec.json"))
    print(json.dumps({k: v for k, v in r.items() if "diff" in k}))
    assert r["fast"]["grouped_gemms"] > 0
    assert r["fast"]["varlen_attention_calls"] > 0 and r["local"]["varlen_attention_calls"] == 0
    # no host syncs in the layers: the local-experts dispatch, RoPE from device positions (Qwen3's)
    assert r["fast"]["slots"]["token_dispatcher"] == ["LocalExpertsDispatcher"] and r["fast"]["device_sorts"] > 0
    assert (r["fast"]["packed_rope_calls"] > 0) == (family == "qwen3_moe")
    # the fused chains were compiled (norm; SwiGLU and RoPE where the family has them; the
    # local spec, built first, compiles none)
    assert r["local"]["compiled_chains"] == []
    want = {"_rms_norm", "_swiglu_probs", "_rope"} if family == "qwen3_moe" else {"_rms_norm"}
    assert want <= set(r["fast"]["compiled_chains"]), r["fast"]["compiled_chains"]
    assert family == "qwen3_moe" or "_swiglu_probs" not in r["fast"]["compiled_chains"]  # relu2 experts
    assert r["logprobs_max_diff"] < 0.1
    assert r["grads_rel_diff"] < 5e-2 and r["weights_after_update_rel_diff"] < 1e-2
