"""The Mamba2 CPU kernel stand-ins (skyrl_mega/megatron/kernels/) against float64 references
written here step by step from the definitions: the SSD recurrence, the causal conv1d sum, the
gated RMSNorm formula. Packed sequences (seq_idx) must restart the state at each boundary; the
scan's gradients must equal the recurrence's."""

import pytest
import torch
import torch.nn.functional as F

from skyrl_mega.megatron.kernels.conv1d import causal_conv1d_fn, causal_conv1d_update
from skyrl_mega.megatron.kernels.gated_rmsnorm import gated_rmsnorm
from skyrl_mega.megatron.kernels.ssd import mamba_chunk_scan_combined

REL = 1e-5


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def ssd_recurrence(x, dt, A, B, C, D, z, dt_bias, seq_idx, init):
    """S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t + D x_t, one step at a time (float64)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    b, l, h, p = x.shape
    g = B.shape[2]
    dt = F.softplus(dt + dt_bias.double())
    rows, finals = [], []
    for i in range(b):
        S = init[i].double().clone() if init is not None else torch.zeros(h, p, B.shape[-1], dtype=torch.float64)
        ys = []
        for t in range(l):
            if t and seq_idx is not None and seq_idx[i, t] != seq_idx[i, t - 1]:
                S = torch.zeros_like(S)
            heads, outs = [], []
            for hh in range(h):
                gg = hh // (h // g)
                Sh = torch.exp(dt[i, t, hh] * A[hh]) * S[hh] + dt[i, t, hh] * torch.outer(x[i, t, hh], B[i, t, gg])
                heads.append(Sh)
                outs.append(Sh @ C[i, t, gg] + D.double()[hh] * x[i, t, hh])
            S = torch.stack(heads)
            ys.append(torch.stack(outs))
        rows.append(torch.stack(ys))
        finals.append(S)
    y = torch.stack(rows)
    if z is not None:
        y = y * F.silu(z.double())
    return y, torch.stack(finals)


def _ssd_inputs(b=2, l=37, h=4, p=3, g=2, n=5, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(dtype)

    return dict(x=r(b, l, h, p), dt=r(b, l, h, scale=0.5), A=-torch.rand(h, generator=gen).to(dtype) * 2 - 0.1,
                B=r(b, l, g, n), C=r(b, l, g, n), D=r(h), z=r(b, l, h, p), dt_bias=r(h, scale=0.3))


@pytest.mark.parametrize("chunk", [8, 16, 64])
@pytest.mark.parametrize("packed", [False, True])
def test_ssd_scan_equals_the_recurrence(chunk, packed):
    a = _ssd_inputs()
    b, l = a["x"].shape[:2]
    # packed rows: sequence starts inside and at chunk edges (the state must restart at each)
    seq = torch.tensor([[0] * 5 + [1] * 11 + [2] * 21, [0] * 16 + [1] * 16 + [2] * 5], dtype=torch.int32) if packed else None
    init = torch.randn(b, 4, 3, 5, generator=torch.Generator().manual_seed(3))
    y, final = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk, D=a["D"], z=a["z"],
                                         dt_bias=a["dt_bias"], initial_states=init, seq_idx=seq, dt_softplus=True,
                                         return_final_states=True)
    ref_init = init if not packed else init  # the initial state belongs to each row's first sequence
    ref, ref_final = ssd_recurrence(a["x"], a["dt"], a["A"], a["B"], a["C"], a["D"], a["z"], a["dt_bias"], seq, ref_init)
    assert y.dtype == torch.float32 and y.shape == a["x"].shape
    assert _rel(y, ref) < REL, _rel(y, ref)
    assert _rel(final, ref_final) < REL


def test_packed_sequences_do_not_leak_state():
    """The second sequence of a packed row gives what it gives alone."""
    a = _ssd_inputs(b=1, l=30)
    seq = torch.tensor([[0] * 12 + [1] * 18], dtype=torch.int32)
    kw = dict(D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True)
    y = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8, z=a["z"], seq_idx=seq, **kw)
    s = slice(12, None)
    alone = mamba_chunk_scan_combined(a["x"][:, s], a["dt"][:, s], a["A"], a["B"][:, s], a["C"][:, s], 8,
                                      z=a["z"][:, s], **kw)
    assert _rel(y[:, s], alone) < REL  # float32 rounding only (chunks fall elsewhere)
    unpacked = mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 8, z=a["z"], **kw)
    assert (unpacked[:, s] - alone).abs().max() > 1e-3  # without seq_idx the state does flow on


def test_ssd_scan_gradients_equal_the_recurrences():
    a = _ssd_inputs(b=1, l=19, dtype=torch.float64)
    leaves = {k: a[k].clone().requires_grad_() for k in ("x", "dt", "B", "C", "z")}
    seq = torch.tensor([[0] * 7 + [1] * 12], dtype=torch.int32)
    y = mamba_chunk_scan_combined(leaves["x"], leaves["dt"], a["A"], leaves["B"], leaves["C"], 8, D=a["D"],
                                  z=leaves["z"], dt_bias=a["dt_bias"], seq_idx=seq, dt_softplus=True)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    got = torch.autograd.grad((y * w).sum(), list(leaves.values()))
    ref_leaves = {k: a[k].clone().requires_grad_() for k in leaves}
    ref, _ = ssd_recurrence(ref_leaves["x"], ref_leaves["dt"], a["A"], ref_leaves["B"], ref_leaves["C"], a["D"],
                            ref_leaves["z"], a["dt_bias"], seq, None)
    want = torch.autograd.grad((ref * w).sum(), list(ref_leaves.values()))
    for k, g1, g2 in zip(leaves, got, want):
        assert _rel(g1, g2) < 1e-10, k


def conv_reference(x, weight, bias, seq_idx):
    b, d, l = x.shape
    w = weight.shape[1]
    y = torch.zeros(b, d, l, dtype=torch.float64)
    for i in range(b):
        for t in range(l):
            for k in range(w):
                s = t - (w - 1) + k
                if s >= 0 and (seq_idx is None or seq_idx[i, s] == seq_idx[i, t]):
                    y[i, :, t] += weight[:, k].double() * x[i, :, s].double()
    return F.silu(y + bias.double()[None, :, None])


@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d_equals_the_sum(packed):
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(2, 6, 20, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    seq = torch.tensor([[0] * 3 + [1] * 9 + [2] * 8, [0] * 20], dtype=torch.int32) if packed else None
    y = causal_conv1d_fn(x, weight, bias, seq_idx=seq, activation="silu")
    assert _rel(y, conv_reference(x, weight, bias, seq)) < REL


def test_conv1d_cpp_functions_forward_and_backward_equal_the_sum():
    """The causal-conv1d cpp_functions stand-ins mamba-ssm's fused Triton path calls: forward on a
    channels-last view (the layout that path hands over), backward into the given dx view, both
    against autograd through the float64 sum over a packed batch."""
    from skyrl_mega.megatron.kernels.conv1d import causal_conv1d_bwd_function, causal_conv1d_fwd_function

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 20, 6, generator=gen).transpose(1, 2)  # (b, d, l) with stride 1 on d
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    seq = torch.tensor([[0] * 3 + [1] * 9 + [2] * 8, [0] * 7 + [1] * 13], dtype=torch.int32)
    dout = torch.randn(2, 6, 20, generator=gen)
    y = causal_conv1d_fwd_function(x, weight, bias, seq, None, None, True)
    leaves = [t.double().requires_grad_() for t in (x, weight, bias)]
    ref = conv_reference(*leaves, seq)
    want = torch.autograd.grad(ref, leaves, dout.double())
    assert _rel(y, ref) < REL
    dx = torch.empty(2, 20, 6).transpose(1, 2)
    got_dx, dw, db, dinit = causal_conv1d_bwd_function(x, weight, bias, dout, seq, None, None, dx, False, True)
    assert got_dx is dx and dinit is None
    for g, w in zip((dx, dw, db), want):
        assert _rel(g, w) < REL


def test_conv1d_decode_steps_continue_the_full_sequence():
    gen = torch.Generator().manual_seed(2)
    x, weight, bias = torch.randn(2, 6, 12, generator=gen), torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    full = causal_conv1d_fn(x, weight, bias, activation="silu")
    y, state = causal_conv1d_fn(x[:, :, :8], weight, bias, activation="silu", return_final_states=True)
    conv_state = torch.cat([torch.zeros(2, 6, 1), state], -1)  # the update keeps w inputs
    steps = [causal_conv1d_update(x[:, :, t], conv_state, weight, bias, activation="silu") for t in range(8, 12)]
    assert _rel(torch.cat([y, torch.stack(steps, -1)], -1), full.double()) < REL


@pytest.mark.parametrize("before", [False, True])
def test_gated_rmsnorm_equals_the_formula(before):
    gen = torch.Generator().manual_seed(4)
    x, z, wt = torch.randn(3, 5, 8, generator=gen), torch.randn(3, 5, 8, generator=gen), torch.randn(8, generator=gen)
    y = gated_rmsnorm(x, wt, z, eps=1e-5, group_size=4, norm_before_gate=before)
    xd, zd = x.double(), z.double()
    h = xd if before else xd * F.silu(zd)
    groups = h.reshape(3, 5, 2, 4)
    ref = (groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(3, 5, 8) * wt.double()
    if before:
        ref = ref * F.silu(zd)
    assert _rel(y, ref) < REL


@pytest.mark.multiprocess
@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_mamba_mixer_on_the_standins_equals_transformers(tp, tmp_path):
    """megatron-core's own MambaMixer (TP shards, packed sequences) on the stand-ins vs
    transformers' NemotronH mixer (its torch path) on the same weights, fp32."""
    import json
    import os

    from skyrl_mega.launcher import run_torchrun

    from .conftest import REPO

    out = tmp_path / "mixer.json"
    run_torchrun(os.path.join(REPO, "tests/workers/mamba_mixer_worker.py"), tp, [str(out)], timeout=300)
    res = json.loads(out.read_text())
    assert res["max_abs"] < 1e-5 * res["scale"], res
    assert res["grad_max_abs"] < 1e-5 * res["grad_scale"], res
    assert res["packed_vs_alone_max_abs"] < 1e-5, res


def test_triton_only_mamba_ssm_loads_without_its_init(tmp_path):
    """A mamba_ssm source tree whose __init__ needs the uncompiled CUDA extension: registered
    without its __init__, its kernel modules load from the files (a stand-in tree here, with the
    real package's failing __init__ and a kernel module), its __version__ read from the __init__,
    and causal_conv1d is the stand-in, registered first: the kernel module binds the stand-in's
    cpp_functions at import (mamba-ssm's fused conv + scan path)."""
    import subprocess
    import sys

    pkg = tmp_path / "mamba_ssm"
    (pkg / "ops" / "triton").mkdir(parents=True)
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(  # binds causal-conv1d's functions at import
        "from causal_conv1d.cpp_functions import causal_conv1d_fwd_function as conv\n"
        "def mamba_chunk_scan_combined(*a, **k): return 'file'\nmamba_split_conv1d_scan_combined = None\n")
    (pkg / "__init__.py").write_text('__version__ = "2.3.2.post1"\nimport selective_scan_cuda\n')
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\n"
            "from skyrl_mega.compat import mamba_ssm as m, applied\n"
            "m.apply_mamba_kernel_standins()\n"
            "import mamba_ssm, mamba_ssm.ops.triton.ssd_combined as s, causal_conv1d\n"
            "print(s.mamba_chunk_scan_combined(), getattr(causal_conv1d, '__skyrl_standin__', False),"
            " getattr(s.conv, '__module__', ''), mamba_ssm.__version__, 'mamba_ssm.triton_only' in applied())\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["file", "True", "skyrl_mega.megatron.kernels.conv1d", "2.3.2.post1", "True"]
