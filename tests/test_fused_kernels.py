"""The fast spec's fused elementwise kernels (megatron/kernels/fused.py): the torch.compile'd chain
against the eager formula on the same inputs, values and gradients, fp32 (here compiled for the
CPU with fusion forced on; on CUDA the fast-vs-local bf16 test covers the GPU kernels), and the
local spec's norm module against the formula with fusion off.
"""

import pytest
import torch

from skyrl_mega.megatron.kernels import fused


@pytest.fixture
def fusion_on():
    before = fused.fusion_mode()
    fused.set_fusion("on")
    yield
    fused.set_fusion(before)


def _grads(fn, *inputs):
    inputs = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad((out * w).sum(), [x for x in inputs if x.requires_grad])
    return out.detach(), grads


def _close(a, b, tol=1e-5):
    return (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1.0)


CASES = {  # name: (fused entry, eager formula, inputs for n tokens)
    "rms_norm": (lambda x, w: fused.rms_norm(x, w, 1e-6), lambda x, w: fused._rms_norm(x, w, 1e-6, False),
                 lambda g, n: (torch.randn(n, 2, 64, generator=g), torch.rand(64, generator=g) + 0.5)),
    "rms_norm_zero_centred": (lambda x, w: fused.rms_norm(x, w, 1e-6, True), lambda x, w: fused._rms_norm(x, w, 1e-6, True),
                              lambda g, n: (torch.randn(n, 64, generator=g), torch.randn(64, generator=g) * 0.1)),
    "swiglu_probs": (fused.swiglu_probs, fused._swiglu_probs,
                     lambda g, n: (torch.randn(n, 2 * 48, generator=g), torch.rand(n, generator=g))),
    "rope_partial": (fused.rope, fused._rope,
                     lambda g, n: (torch.randn(n, 1, 4, 32, generator=g), torch.randn(n, 1, 1, 16, generator=g),
                                   torch.randn(n, 1, 1, 16, generator=g))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_chain_equals_eager_formula(name, fusion_on):
    compiled, eager, make = CASES[name]
    g = torch.Generator().manual_seed(0)
    for n in (37, 58):  # dynamic shapes: the second length reuses the compiled kernel
        inputs = make(g, n)
        out, grads = _grads(compiled, *inputs)
        want, want_grads = _grads(eager, *inputs)
        assert _close(out, want) and all(_close(a, b) for a, b in zip(grads, want_grads)), (name, n)


def test_fusion_off_runs_the_eager_formula_and_bad_modes_are_refused():
    before = fused.fusion_mode()
    try:
        fused.set_fusion("off")
        x, w = torch.randn(4, 8), torch.rand(8)
        assert torch.equal(fused.rms_norm(x, w, 1e-5), fused._rms_norm(x, w, 1e-5, False))
        with pytest.raises(ValueError, match="choose one of auto, on, off"):
            fused.set_fusion("fast")
    finally:
        fused.set_fusion(before)


def test_add_flipped_compiled_equals_eager(fusion_on):
    """The experts' reversed weight-gradient add: bf16 gradients widened into an fp32 buffer."""
    g = torch.Generator().manual_seed(1)
    src = torch.randn(5, 8, 16, generator=g).to(torch.bfloat16)
    dst = torch.randn(5, 8, 16, generator=g)
    want = dst + src.flip(0).float()
    fused.add_flipped_(dst, src)
    assert torch.equal(dst, want)  # one exact widening and one fp32 add per element, fused or not


def test_the_config_validator_offers_the_same_fusion_modes():
    from skyrl_mega.config.validate import FUSION_MODES

    assert FUSION_MODES == fused.MODES  # validate.py keeps its own copy: it imports no torch modules
