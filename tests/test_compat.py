"""The compat shims (skyrl_mega/compat): each CPU shim on two real gloo ranks in a fresh process,
that each is needed here, that the guards decide what is applied, and the other shims' effects."""

import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from skyrl_mega import compat
from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

CPU_SHIMS = ["cuda_stubs", "te_general_gemm", "gloo_all_to_all", "rng_tracker", "cuda_to_cpu_mode"]


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("compat") / "probe.json"
    run_torchrun(os.path.join(REPO, "tests/workers/compat_probe.py"), 2, [str(out)], timeout=180)
    return json.load(open(out))


@pytest.mark.multiprocess
def test_all_patches_applied_once(probe):
    assert sorted(probe["applied"]) == sorted(
        ["cuda_stubs", "te_general_gemm", "gloo_all_to_all", "gloo_uneven_all_gather", "rng_tracker",
         "cuda_to_cpu_mode"])
    assert probe["idempotent"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", [
    "current_device_is_cpu", "stream_event_ok",  # cuda_stubs
    "cuda_factory_on_cpu", "dot_cuda_identity", "float_type_reported_cuda", "to_cuda_stays_cpu",  # mode
    "te_general_gemm_none",  # te_general_gemm
    "gloo_all_to_all_tensor_splits",  # gloo_all_to_all
    "gloo_uneven_all_gather_rows",  # gloo_uneven_all_gather
    "fork_restores_outer_state", "fork_stream_advances", "fork_uses_tp_rank_seed",  # rng_tracker
    "tp_ranks_differ", "states_round_trip",
])
def test_patch_behaviour(probe, check):
    assert probe[check] is True, check


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", CPU_SHIMS)
def test_each_cpu_shim_is_needed_here(probe, name):
    """Before the shims, megatron-core 0.16.1 / torch on CPU fail where each one helps."""
    assert probe[f"needed_{name}"] is True, name


@pytest.mark.multiprocess
def test_guards_decide_what_is_applied(probe):
    assert probe["applied_before"] == []  # importing compat applied nothing
    assert probe["applied"] == probe["guard_says_needed"]
    assert probe["recorded"] == [f"megatron_core.{n}" for n in probe["applied"]]


def test_every_shim_is_listed_guarded_and_tested():
    shims = compat.all_shims()
    assert len({s.key for s in shims}) == len(shims)
    for s in shims:
        assert s.name in compat.__doc__, f"{s.key} is not listed in skyrl_mega/compat/__init__.py"
        s.needed_on("0.0.1")  # a valid PEP 440 range
        path, func = s.test.split("::")
        text = open(os.path.join(REPO, path)).read()
        assert re.search(rf"^def {func}\(", text, re.M), f"{s.key}: no test {s.test}"


@pytest.mark.parametrize("shim, version, needed", [
    ("te_general_gemm", "0.16.1", True), ("te_general_gemm", "0.17.0", False),
    ("te_general_gemm", "0.19.2", False), ("gloo_all_to_all", "0.19.2", True),
    ("rng_tracker", "0.19.2", True), ("cuda_stubs", "0.20.0rc0", True), ("adam_steps", "0.19.2", True),
])
def test_megatron_core_version_guards(shim, version, needed):
    from skyrl_mega.compat.megatron_core import SHIMS_BY_NAME

    assert SHIMS_BY_NAME[shim].needed_on(version) is needed


def test_importing_compat_applies_nothing():
    code = ("import torch, torch.distributed as d\n"
            "device, a2a = torch.cuda.current_device, d.all_to_all_single\n"
            "import skyrl_mega.compat as c\n"
            "from skyrl_mega.compat import megatron_core, mbridge, transformers, mamba_ssm\n"
            "import sys\n"
            "c.all_shims()\n"
            "print(c.applied() == [], torch.cuda.current_device is device, d.all_to_all_single is a2a,\n"
            "      torch._C._is_torch_function_mode_enabled(), 'causal_conv1d' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["True", "True", "True", "False", "False"]


def test_rope_theta_from_rope_parameters():
    from transformers import Qwen3MoeConfig

    from skyrl_mega.compat.transformers import SHIMS, fix_hf_config

    cfg = Qwen3MoeConfig(rope_parameters={"rope_type": "default", "rope_theta": 123456.0})
    assert getattr(cfg, "rope_theta", None) is None  # transformers 5: only in rope_parameters
    assert SHIMS[0].needed_here() and not SHIMS[0].needed_on("4.57.1")
    assert fix_hf_config(cfg).rope_theta == 123456.0
    assert "transformers.rope_theta" in compat.applied()


def _wrapped(adam):
    """The shapes megatron hands the shims: a chained optimizer of optimizers holding torch Adam."""
    return SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])


def test_optimizer_state_shims():
    from skyrl_mega.compat.megatron_core import SHIMS_BY_NAME, ensure_optimizer_state, restore_adam_steps

    assert SHIMS_BY_NAME["optimizer_state"].needed_here()  # megatron-core 0.16.1, no TE / apex here
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    before = [p.detach().clone() for p in params]
    adam = torch.optim.Adam(params, lr=0.1)
    ensure_optimizer_state(_wrapped(adam))
    # every parameter has Adam state with one step, and the zero-gradient step moved nothing
    assert all(float(adam.state[p]["step"]) == 1.0 for p in params)
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(p.grad is None or not p.grad.any() for p in params)
    # a checkpoint's step lives in the param group; the per-parameter steps follow it, unshared
    adam.param_groups[0]["step"] = 7
    restore_adam_steps(_wrapped(adam))
    steps = [adam.state[p]["step"] for p in params]
    assert [float(s) for s in steps] == [7.0, 7.0] and steps[0] is not steps[1]
    # the next step is Adam's 8th: from zero moments and a gradient of ones, each element moves
    # by lr * m_hat / (sqrt(v_hat) + eps) with the step-8 bias corrections
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    m_hat, v_hat = 0.1 / (1 - 0.9 ** 8), 0.001 / (1 - 0.999 ** 8)
    expected = 0.1 * m_hat / (v_hat ** 0.5 + 1e-8)
    for p, b in zip(params, before):
        assert torch.allclose(b - p.detach(), torch.full_like(b, expected), atol=1e-6)
    assert {"megatron_core.optimizer_state", "megatron_core.adam_steps"} <= set(compat.applied())


def test_foreach_grad_norm_equals_megatron_local_norm():
    """The grad-norm shim: the same total norm as megatron's local fallback (and a float64
    reference), the same clipping scale, and clip_grads uses it once applied."""
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    from skyrl_mega.compat import applied
    from skyrl_mega.compat.megatron_core import apply_optimizer_shims, foreach_l2_norm, foreach_scale

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(*shape, generator=g) for shape in [(7, 5), (3,), (64, 16), (1,)]]
    ref = torch.sqrt(sum((x.double() ** 2).sum() for x in grads))
    norm, none = foreach_l2_norm(2048 * 32, None, [grads], False)
    assert none is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert abs(norm.item() - ref.item()) <= 1e-6 * ref.item()
    # megatron's local_multi_tensor_l2_norm's math (it puts its answer on "cuda", so not called here)
    local = torch.norm(torch.tensor([torch.norm(x) for x in grads]))
    assert abs(norm.item() - local.item()) <= 1e-6 * ref.item()
    copies, want = [x.clone() for x in grads], [x * 0.25 for x in grads]
    foreach_scale(0, None, [copies, copies], 0.25)  # in place, as clip_grads calls it
    out = [torch.empty_like(x) for x in grads]
    foreach_scale(0, None, [grads, out], 0.25)
    assert all(torch.equal(a, b) and torch.equal(c, b) for a, b, c in zip(copies, want, out))
    assert apply_optimizer_shims() == ["foreach_grad_norm"]  # no apex / TE here: megatron's fallback was in use
    assert clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale
    assert "megatron_core.foreach_grad_norm" in applied()
    assert apply_optimizer_shims() == ["foreach_grad_norm"]  # idempotent


def _adamw_float64(p0, grads, lr, betas, eps, wd):
    """AdamW (decoupled weight decay) by its formula in float64: the reference for the shim."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, 1):
        g = g.double()
        p *= 1 - lr * wd
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p -= lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return p


def test_fused_torch_adam_equals_float64_adam():
    """The fused-Adam shim: the groups megatron's torch AdamW gets are switched to the fused
    kernel before the first step (not after: the state is made then), the update equals AdamW's
    float64 formula over several steps, and a dist-ckpt step restore puts the step where the
    fused kernel wants it."""
    from skyrl_mega.compat.megatron_core import restore_adam_steps, use_fused_torch_adam

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in [(33, 7), (5,)]]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(4)]
    adam = torch.optim.AdamW(params, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    assert not adam.param_groups[0].get("fused")
    assert use_fused_torch_adam(_wrapped(adam)) is True
    assert adam.param_groups[0]["fused"] is True and adam.param_groups[0]["foreach"] is False
    for step in grads:
        for p, x in zip(params, step):
            p.grad = x.clone()
        adam.step()
    for i, p in enumerate(params):
        ref = _adamw_float64(start[i], [s[i] for s in grads], 0.01, (0.9, 0.95), 1e-8, 0.1)
        assert (p.detach().double() - ref).abs().max() < 1e-6
    assert "megatron_core.fused_torch_adam" in compat.applied()
    assert use_fused_torch_adam(_wrapped(adam)) is False  # it has state now: left as it is
    adam.param_groups[0]["step"] = 9
    restore_adam_steps(_wrapped(adam))
    step = adam.state[params[0]]["step"]
    assert float(step) == 9.0 and step.dtype == torch.float32 and step.device == params[0].device


def test_megatron_optimizer_uses_fused_torch_adam(tiny_qwen3_moe):
    """build_optimizer on a real megatron model (a fresh process): megatron's torch AdamW runs
    the fused kernel."""
    code = f"""
from skyrl_mega.config import load_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron.policy import build_policy
cfg = load_config(None, ["model.path={tiny_qwen3_moe}", "algorithm.use_reference=false"])
parallel.init_layout()
policy = build_policy(cfg, total_steps=1)
from skyrl_mega.compat.megatron_core.optimizer import _inner_optimizers
groups = [g for o in _inner_optimizers(policy.optimizer) for g in o.param_groups]
print("FUSED", len(groups), all(g["fused"] and not g["foreach"] for g in groups))
parallel.destroy()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("FUSED")][-1].split()
    assert int(line[1]) > 0 and line[2] == "True", line


_GLOO_GRAD_SYNC = """
import os, sys, torch, torch.distributed as dist
import torch.multiprocessing as mp

def rank(r, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=2)
    from megatron.core.distributed import param_and_grad_buffer as pgb
    from skyrl_mega.compat.megatron_core import apply_gloo_cuda_shims, one_op_at_a_time
    assert apply_gloo_cuda_shims() == ["gloo_cuda_grad_sync"] and pgb._coalescing_manager is one_op_at_a_time
    a, b = torch.full((3,), float(r + 1)), torch.full((2,), 10.0 * (r + 1))
    with pgb._coalescing_manager(dist.group.WORLD, async_ops=False) as cm:
        dist.all_reduce(a)
        assert torch.equal(a, torch.full((3,), 3.0))  # issued at the call, not at the exit
        dist.all_reduce(b)
    assert cm.wait() and torch.equal(b, torch.full((2,), 30.0))
    try:
        with pgb._coalescing_manager(dist.group.WORLD, async_ops=True):
            pass
        raise SystemExit("async accepted")
    except RuntimeError as e:
        assert "synchronous grad sync" in str(e)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank, args=(int(sys.argv[1]),), nprocs=2)
    print("OK")
"""


def test_gloo_cuda_grad_sync_issues_each_op(tmp_path):
    """The gloo-on-CUDA shim on two real gloo ranks (a fresh process): megatron's grad buffer's
    coalescing manager runs each all-reduce as it is called, with the right sums, and refuses
    the asynchronous grad sync it cannot serve."""
    from skyrl_mega.ports import free_port

    script = tmp_path / "gloo_grad_sync.py"
    script.write_text(_GLOO_GRAD_SYNC)
    out = subprocess.run([sys.executable, str(script), str(free_port())], capture_output=True, text=True,
                         timeout=300, cwd=REPO)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_gloo_cuda_leaf_broadcast_lands_in_the_parameter(monkeypatch):
    """gloo's CUDA broadcast copies the received values back into the tensor on its worker
    thread, where grad mode is on (ProcessGroupGloo's AsyncBroadcastCUDAWork::run). Stand-in with
    that behaviour: the copy into a parameter that requires grad fails unwrapped, and with the
    shim lands in the parameter, which stays a leaf without grad."""
    import threading

    import torch.distributed as dist

    from skyrl_mega.compat.torch_distributed import _detached_broadcast, apply_gloo_cuda_broadcast

    received = torch.arange(6, dtype=torch.float32).reshape(2, 3)

    def gloo_like_broadcast(tensor, src=0, group=None, async_op=False):
        err = []

        def copy_back():  # a new thread: grad mode on, as on gloo's worker thread
            try:
                tensor.copy_(received)
            except RuntimeError as e:
                err.append(e)

        t = threading.Thread(target=copy_back)
        t.start()
        t.join()
        if err:
            raise err[0]

    with torch.no_grad():  # the caller's grad mode does not reach the worker thread
        param = torch.nn.Parameter(torch.zeros(2, 3))
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
            gloo_like_broadcast(param)
        _detached_broadcast(gloo_like_broadcast)(param, src=0)
    assert torch.equal(param.detach(), received) and param.is_leaf and param.requires_grad and param.grad is None

    monkeypatch.setattr(dist, "broadcast", gloo_like_broadcast)
    assert apply_gloo_cuda_broadcast() == ["gloo_cuda_leaf_broadcast"]
    assert apply_gloo_cuda_broadcast() == ["gloo_cuda_leaf_broadcast"] and dist.broadcast.__wrapped__ is gloo_like_broadcast
    p2 = torch.nn.Parameter(torch.ones(2, 3))
    dist.broadcast(p2, src=0)
    assert torch.equal(p2.detach(), received)
    assert "torch_distributed.gloo_cuda_leaf_broadcast" in compat.applied()
