"""The Gated DeltaNet CPU kernel stand-ins (skyrl_mega/megatron/kernels/gated_delta_rule.py) against a
float64 reference written here one token at a time from the definition (decay, then the delta-rule
write, then the read), against transformers' torch path, and the fla shim (skyrl_mega/compat/fla.py)
serving them to megatron-core's GatedDeltaNet module. Packed sequences (cu_seqlens) must restart the
state at each boundary; the chunked form's gradients must equal the reference's."""

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from skyrl_mega.megatron.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    l2norm,
)

from .conftest import REPO

REL = 1e-5


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def gdn_reference(q, k, v, g, beta, scale=None, init=None):
    """Per row, value head and token (float64): S <- exp(g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = scale S^T q_t. q / k head h serves value heads h * HV/H .. (h+1) * HV/H - 1."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV = v.shape[2]
    per = HV // H
    scale = K ** -0.5 if scale is None else scale
    rows, finals = [], []
    for b in range(B):
        heads, states = [], []
        for hv in range(HV):
            S = init[b, hv].double() if init is not None else torch.zeros(K, v.shape[-1], dtype=torch.float64)
            outs = []
            for t in range(T):
                S = torch.exp(g[b, t, hv]) * S
                kt = k[b, t, hv // per]
                S = S + beta[b, t, hv] * torch.outer(kt, v[b, t, hv] - S.T @ kt)
                outs.append(scale * (S.T @ q[b, t, hv // per]))
            heads.append(torch.stack(outs))
            states.append(S)
        rows.append(torch.stack(heads, 1))  # (T, HV, V)
        finals.append(torch.stack(states))
    return torch.stack(rows), torch.stack(finals)


def _unit(x):
    """L2-normalised along the last axis, as Qwen3.5 feeds q and k (written here, not the kernel's)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _inputs(B, T, H, HV, K, V, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    return dict(q=_unit(r(B, T, H, K)).to(dtype), k=_unit(r(B, T, H, K)).to(dtype), v=r(B, T, HV, V).to(dtype),
                g=F.logsigmoid(r(B, T, HV) + 2.0).to(dtype),  # log decays in about (-3, 0)
                beta=torch.sigmoid(r(B, T, HV)).to(dtype), h0=(0.5 * r(B, HV, K, V)).to(dtype))


SHAPES = [  # B, T, H, HV, K, V, chunk
    (2, 37, 2, 4, 8, 6, 16),  # T not a multiple of the chunk, GVA (H < HV)
    (1, 64, 3, 3, 16, 16, 64),  # one exact chunk
    (2, 5, 1, 2, 4, 4, 64),  # shorter than one chunk
    (1, 50, 2, 2, 32, 8, 8),  # many chunks, K > V
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}HV{}K{}V{}C{}".format(*s))
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_and_recurrent_equal_the_reference(shape, with_state):
    B, T, H, HV, K, V, C = shape
    a = _inputs(B, T, H, HV, K, V)
    h0 = a["h0"] if with_state else None
    ref, ref_final = gdn_reference(a["q"], a["k"], a["v"], a["g"], a["beta"], init=h0)
    o, final = chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=h0,
                                      output_final_state=True, chunk_size=C)
    assert o.dtype == torch.float32 and o.shape == (B, T, HV, V) and final.shape == (B, HV, K, V)
    assert _rel(o, ref) < REL, _rel(o, ref)
    assert _rel(final, ref_final) < REL, _rel(final, ref_final)
    o_r, final_r = fused_recurrent_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], beta=a["beta"], initial_state=h0,
                                                    output_final_state=True)
    assert _rel(o_r, ref) < REL, _rel(o_r, ref)
    assert _rel(final_r, ref_final) < REL
    # no final state unless asked
    assert chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=h0, chunk_size=C)[1] is None


def test_options_equal_the_reference():
    """scale, the in-kernel q/k L2 norm, the in-kernel gate and beta sigmoid, and the V-first state
    layout, each against the reference on the inputs computed here by hand."""
    B, T, H, HV, K, V = 1, 29, 2, 4, 8, 4
    a = _inputs(B, T, H, HV, K, V, seed=1)
    gen = torch.Generator().manual_seed(7)
    q_raw, k_raw = 3 * torch.randn(B, T, H, K, generator=gen), 2 * torch.randn(B, T, H, K, generator=gen)
    alpha, b_logit = torch.randn(B, T, HV, generator=gen), torch.randn(B, T, HV, generator=gen)
    A_log, dt_bias = torch.randn(HV, generator=gen) * 0.5, torch.randn(HV, generator=gen) * 0.5
    g = -A_log.double().exp() * F.softplus(alpha.double() + dt_bias.double())
    beta = torch.sigmoid(b_logit.double())
    ref, ref_final = gdn_reference(_unit(q_raw.double()), _unit(k_raw.double()), a["v"], g, beta, scale=0.3,
                                   init=a["h0"])
    for fn, extra in ((chunk_gated_delta_rule, dict(chunk_size=16, use_gate_in_kernel=True)),
                      (fused_recurrent_gated_delta_rule, dict(use_gate_in_kernel=True))):
        o, final = fn(q_raw, k_raw, a["v"], alpha, beta=b_logit, scale=0.3, initial_state=a["h0"].transpose(-1, -2),
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                      state_v_first=True, A_log=A_log, dt_bias=dt_bias, **extra)
        assert _rel(o, ref) < REL, (fn.__name__, _rel(o, ref))
        assert _rel(final.transpose(-1, -2), ref_final) < REL, fn.__name__
    # allow_neg_eigval: beta = 2 sigmoid(logit)
    ref2, _ = gdn_reference(a["q"], a["k"], a["v"], a["g"], 2 * beta, init=None)
    o2, _ = chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], b_logit, use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=True, chunk_size=8)
    assert _rel(o2, ref2) < REL
    with pytest.raises(ValueError):
        chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], allow_neg_eigval=True)
    with pytest.raises(ValueError):  # HV must be a multiple of H
        chunk_gated_delta_rule(a["q"], a["k"], a["v"][:, :, :3], a["g"][..., :3], a["beta"][..., :3])


def test_l2norm_equals_the_formula():
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(2))
    y = l2norm(x)
    assert y.dtype == x.dtype and _rel(y, _unit(x.double())) < REL
    assert l2norm(x.double()).dtype == torch.float64
    assert l2norm(x, output_dtype=torch.bfloat16).dtype == torch.bfloat16


# packed sequences: starts inside chunks, at chunk edges, an empty sequence and one a token long
LENGTHS = [5, 16, 0, 21, 1, 9]


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_packed_sequences_restart_the_state(form):
    H, HV, K, V, C = 2, 4, 8, 6, 16
    T = sum(LENGTHS)
    a = _inputs(1, T, H, HV, K, V, seed=3)
    N = len(LENGTHS)
    h0 = (0.5 * torch.randn(N, HV, K, V, generator=torch.Generator().manual_seed(4)))
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist(), dtype=torch.long)

    def run(q, k, v, g, beta, init, cu_seqlens=None):
        if form == "chunk":
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                          cu_seqlens=cu_seqlens, chunk_size=C)
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=init, output_final_state=True,
                                                cu_seqlens=cu_seqlens)

    for init in (None, h0):
        o, finals = run(a["q"], a["k"], a["v"], a["g"], a["beta"], init, cu)
        assert o.shape == (1, T, HV, V) and finals.shape == (N, HV, K, V)
        for i in range(N):
            s = slice(int(cu[i]), int(cu[i + 1]))
            one = None if init is None else init[i:i + 1]
            if LENGTHS[i] == 0:  # an empty sequence keeps its initial state
                want = init[i] if init is not None else torch.zeros(HV, K, V)
                assert torch.equal(finals[i], want)
                continue
            alone, alone_final = run(a["q"][:, s], a["k"][:, s], a["v"][:, s], a["g"][:, s], a["beta"][:, s], one)
            assert _rel(o[:, s], alone) < REL, (i, _rel(o[:, s], alone))
            assert _rel(finals[i], alone_final[0]) < REL, i
            ref, ref_final = gdn_reference(a["q"][:, s], a["k"][:, s], a["v"][:, s], a["g"][:, s], a["beta"][:, s],
                                           init=one)
            assert _rel(o[:, s], ref) < REL and _rel(finals[i], ref_final[0]) < REL, i
    # without cu_seqlens the state does flow from one sequence into the next
    flowing, _ = run(a["q"], a["k"], a["v"], a["g"], a["beta"], None)
    s = slice(int(cu[3]), int(cu[4]))
    assert (flowing[:, s] - o[:, s]).abs().max() > 1e-3
    with pytest.raises(ValueError):  # packed sequences take B == 1
        run(a["q"].expand(2, -1, -1, -1), a["k"].expand(2, -1, -1, -1), a["v"].expand(2, -1, -1, -1),
            a["g"].expand(2, -1, -1), a["beta"].expand(2, -1, -1), None, cu)


def _grads(fn, a, leaves, w):
    out, final = fn(**{n: leaves.get(n, a[n]) for n in ("q", "k", "v", "g", "beta", "h0")})
    loss = (out * w[0]).sum() + (final * w[1]).sum()
    return torch.autograd.grad(loss, [leaves[n] for n in leaves])


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("packed", [False, True])
def test_chunk_gradients_equal_the_references(dtype, tol, packed):
    """d(q, k, v, g, beta, initial_state) of the chunked form (float64, and float32) against autograd
    through the float64 token loop, the loss reading the outputs and the final states."""
    B, T, H, HV, K, V, C = 1, 19, 1, 2, 4, 3, 8
    a = _inputs(B, T, H, HV, K, V, seed=5, dtype=torch.float64)
    lengths = [7, 12] if packed else [T]
    cu = torch.tensor([0, 7, 19]) if packed else None
    a["h0"] = a["h0"].expand(len(lengths), -1, -1, -1).clone()
    gen = torch.Generator().manual_seed(6)
    w = (torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64),
         torch.randn(len(lengths), HV, K, V, generator=gen, dtype=torch.float64))

    def ours(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      chunk_size=C)

    def reference(q, k, v, g, beta, h0):
        outs, finals, at = [], [], 0
        for i, n in enumerate(lengths):
            s = slice(at, at + n)
            o, f = gdn_reference(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], init=h0[i:i + 1])
            outs.append(o)
            finals.append(f)
            at += n
        return torch.cat(outs, 1), torch.cat(finals)

    names = ("q", "k", "v", "g", "beta", "h0")
    got = _grads(ours, a, {n: a[n].to(dtype).requires_grad_() for n in names}, w)
    want = _grads(reference, a, {n: a[n].clone().requires_grad_() for n in names}, w)
    for n, g1, g2 in zip(names, got, want):
        assert g1.dtype == dtype
        assert _rel(g1, g2) < tol, (n, _rel(g1, g2))


def test_recurrent_gradients_equal_the_reference():
    B, T, H, HV, K, V = 1, 11, 1, 2, 4, 3
    a = _inputs(B, T, H, HV, K, V, seed=8, dtype=torch.float64)
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(B, T, HV, V, generator=gen, dtype=torch.float64),
         torch.randn(B, HV, K, V, generator=gen, dtype=torch.float64))
    names = ("q", "k", "v", "g", "beta", "h0")

    def ours(q, k, v, g, beta, h0):
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0, output_final_state=True)

    def reference(q, k, v, g, beta, h0):
        return gdn_reference(q, k, v, g, beta, init=h0)

    got = _grads(ours, a, {n: a[n].clone().requires_grad_() for n in names}, w)
    want = _grads(reference, a, {n: a[n].clone().requires_grad_() for n in names}, w)
    for n, g1, g2 in zip(names, got, want):
        assert _rel(g1, g2) < 1e-10, n


def test_equals_transformers_torch_path():
    """transformers' Qwen3.5-MoE torch functions (GVA and the q/k L2 norm inside) on the same inputs."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    B, T, H, HV, K, V = 2, 70, 2, 4, 16, 8
    a = _inputs(B, T, H, HV, K, V, seed=10)
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)  # normalised inside
    kw = dict(initial_state=a["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    hf, hf_final = torch_chunk_gated_delta_rule(q, k, a["v"], a["g"], a["beta"], chunk_size=64, **kw)
    o, final = chunk_gated_delta_rule(q, k, a["v"], a["g"], a["beta"], **kw)
    assert _rel(o, hf) < REL, _rel(o, hf)
    assert _rel(final, hf_final) < REL
    hf_r, hf_r_final = torch_recurrent_gated_delta_rule(q, k, a["v"], a["g"], a["beta"], **kw)
    o_r, final_r = fused_recurrent_gated_delta_rule(q, k, a["v"], a["g"], beta=a["beta"], **kw)
    assert _rel(o_r, hf_r) < REL and _rel(final_r, hf_r_final) < REL


_SHIM_CODE = r"""
import json, sys, torch
from skyrl_mega import compat
from skyrl_mega.compat.fla import API_VERSION, apply_fla_kernel_standins
before = "fla" in sys.modules or compat.applied()
ok = apply_fla_kernel_standins()
import megatron.core.ssm.gated_delta_net as m
from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
from skyrl_mega.megatron.kernels import gated_delta_rule as ours
gen = torch.Generator().manual_seed(0)
q, k = torch.randn(2, 40, 4, 8, generator=gen), torch.randn(2, 40, 4, 8, generator=gen)
v, g = torch.randn(2, 40, 4, 8, generator=gen), -torch.rand(2, 40, 4, generator=gen)
beta = torch.rand(2, 40, 4, generator=gen)
q, k = m.l2norm(q), m.l2norm(k)
kw = dict(g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False)
o, _ = m.chunk_gated_delta_rule(q, k, v, **kw)  # megatron's own call
ref, _ = m.torch_chunk_gated_delta_rule(q, k, v, **kw)  # megatron's deterministic torch path
print(json.dumps(dict(
    before=bool(before), ok=ok, again=apply_fla_kernel_standins(), have_fla=m.HAVE_FLA,
    chunk_is_ours=m.chunk_gated_delta_rule is ours.chunk_gated_delta_rule, l2norm_is_ours=m.l2norm is ours.l2norm,
    recurrent_is_ours=fused_recurrent_gated_delta_rule is ours.fused_recurrent_gated_delta_rule,
    version=sys.modules["fla"].__version__ == API_VERSION, standin=sys.modules["fla"].__skyrl_standin__,
    applied=compat.applied(), rel=float((o - ref).abs().max() / ref.abs().max()))))
"""

_TOO_LATE_CODE = r"""
import megatron.core.ssm.gated_delta_net as m
from skyrl_mega.compat.fla import apply_fla_kernel_standins
assert not m.HAVE_FLA
try:
    apply_fla_kernel_standins()
except RuntimeError as e:
    print("refused", "imported before" in str(e))
"""


def _python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout


def test_fla_standins_serve_megatron_gated_delta_net():
    """In a fresh process: the shim registers fla's module names, megatron's gated_delta_net then
    binds our kernels (HAVE_FLA) and its call equals its own torch path; the guard is recorded once.
    Registered after megatron imported the module without fla, the shim refuses."""
    from skyrl_mega.compat.fla import SHIMS

    assert SHIMS[0].needed_here()  # megatron-core 0.16.1 here
    assert not SHIMS[0].needed_on("0.18.2")  # 0.18 also imports fla.modules.convolution
    res = json.loads(_python(_SHIM_CODE).strip().splitlines()[-1])
    assert res["before"] is False and res["ok"] is True and res["again"] is True
    assert res["have_fla"] and res["chunk_is_ours"] and res["l2norm_is_ours"] and res["recurrent_is_ours"]
    assert res["version"] and res["standin"]
    assert res["applied"] == ["fla.kernel_standins"]
    assert res["rel"] < REL, res
    assert _python(_TOO_LATE_CODE).split() == ["refused", "True"]
