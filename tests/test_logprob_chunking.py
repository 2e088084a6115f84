"""Token-chunked vocab-parallel logprobs / entropy (`logprobs.vocab_parallel_logprobs`,
`chunk_tokens`): the same values and gradients as one chunk, and no fp32 [tokens, V] tensor
kept for backward or built at once (single rank: the tp_group None path)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from skyrl_mega.megatron.logprobs import reference_logprobs, vocab_parallel_entropy, vocab_parallel_logprobs


def _call(logits, labels, temperature, vocab_size, entropy_grad, chunk, w1, w2, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, ent = vocab_parallel_logprobs(x, labels, temperature, with_entropy=True, entropy_grad=entropy_grad,
                                      vocab_size=vocab_size, chunk_tokens=chunk, **kw)
    loss = (lp * w1).sum() + ((ent * w2).sum() if entropy_grad else 0.0)
    (grad,) = torch.autograd.grad(loss, x)
    return lp.detach(), ent.detach(), grad


@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("temperature,vocab_size", [(1.0, None), (0.7, 45), (1.3, 45)])
@pytest.mark.parametrize("chunk", [1, 5, 16, 33, "auto"])  # 33 > 3*7 tokens: one chunk anyway
def test_chunked_equals_one_chunk(chunk, temperature, vocab_size, entropy_grad):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 48, generator=g) * 4
    labels = torch.randint(0, vocab_size or 48, (3, 7), generator=g)
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    plain = _call(logits, labels, temperature, vocab_size, entropy_grad, None, w1, w2)
    zero = _call(logits, labels, temperature, vocab_size, entropy_grad, 0, w1, w2)
    got = _call(logits, labels, temperature, vocab_size, entropy_grad, chunk, w1, w2)
    for a, b, c in zip(plain, zero, got):
        assert a.shape == c.shape and a.dtype == c.dtype
        assert torch.equal(a, b)
        assert (a - c).abs().max().item() < 1e-6
    if vocab_size is not None:
        assert (got[2][..., vocab_size:] == 0).all()
    rlp, rent = reference_logprobs(logits, labels, temperature, vocab_size=vocab_size)
    assert (got[0].double() - rlp).abs().max() < 1e-5 and (got[1].double() - rent).abs().max() < 1e-5


def test_chunked_gradients_match_float64_autograd():
    """float64 logits stay float64; chunk 4 over 10 tokens (not a divisor) vs plain autograd."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(10, 40, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 36, (10,), generator=g)
    w1, w2 = torch.randn(10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
    lp, ent, grad = _call(logits, labels, 0.6, 36, True, 4, w1, w2)
    x = logits.clone().requires_grad_()
    logp = torch.log_softmax(x[..., :36] / 0.6, -1)
    ref = (logp.gather(-1, labels[..., None])[..., 0] * w1 - (logp.exp() * logp).sum(-1) * w2).sum()
    (rgrad,) = torch.autograd.grad(ref, x)
    rlp, rent = reference_logprobs(logits, labels, 0.6, vocab_size=36)
    assert lp.dtype == torch.float64 and grad.dtype == torch.float64
    assert (lp - rlp).abs().max() < 1e-12 and (ent - rent).abs().max() < 1e-12
    assert (grad - rgrad).abs().max() < 1e-12


def test_chunk_not_dividing_token_count_bf16():
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 37, 96, generator=g) * 3).bfloat16()
    labels = torch.randint(0, 90, (2, 37), generator=g)
    w1, w2 = torch.randn(2, 37, generator=g), torch.randn(2, 37, generator=g)
    plain = _call(logits, labels, 0.8, 90, True, None, w1, w2)
    for chunk in (7, 10, 73):  # 74 tokens: remainders 4, 4, 1
        got = _call(logits, labels, 0.8, 90, True, chunk, w1, w2)
        assert got[2].dtype == torch.bfloat16 and got[0].dtype == torch.float32
        assert (plain[0] - got[0]).abs().max() < 1e-6 and (plain[1] - got[1]).abs().max() < 1e-6
        assert (plain[2].float() - got[2].float()).abs().max() < 1e-6
    ent = vocab_parallel_entropy(logits, 0.8, vocab_size=90, chunk_tokens=7)
    assert (ent - plain[1]).abs().max() < 1e-6


def test_logprob_only_and_entropy_only_gradients():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 30, generator=g)
    labels = torch.randint(0, 30, (9,), generator=g)
    for chunk in (None, 2):
        x = logits.clone().requires_grad_()
        lp, _ = vocab_parallel_logprobs(x, labels, 0.9, chunk_tokens=chunk)
        (g_lp,) = torch.autograd.grad(lp.sum(), x)
        x = logits.clone().requires_grad_()
        ent = vocab_parallel_entropy(x, 0.9, chunk_tokens=chunk)
        (g_ent,) = torch.autograd.grad(ent.sum(), x)
        r = logits.clone().requires_grad_()
        logp = torch.log_softmax(r / 0.9, -1)
        (r_lp,) = torch.autograd.grad(logp.gather(-1, labels[:, None]).sum(), r)
        r = logits.clone().requires_grad_()
        logp = torch.log_softmax(r / 0.9, -1)
        (r_ent,) = torch.autograd.grad(-(logp.exp() * logp).sum(), r)
        assert (g_lp - r_lp).abs().max() < 1e-5 and (g_ent - r_ent).abs().max() < 1e-5


def test_empty_token_axis():
    x = torch.zeros(0, 16, requires_grad=True)
    lp, ent = vocab_parallel_logprobs(x, torch.zeros(0, dtype=torch.long), with_entropy=True, chunk_tokens=4)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert x.grad.shape == (0, 16)


def test_saved_for_backward_holds_no_fp32_full_vocab_tensor():
    """Backward keeps the bf16 logits plus per-token vectors, never fp32 [tokens, V] (the softmax,
    the scaled logits): at 16K tokens x 248K vocab each such tensor is 16 GB."""
    n, v = 64, 1000
    logits = torch.randn(n, v).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,))
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel(), t.data_ptr() == logits.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = vocab_parallel_logprobs(logits, labels, 0.7, with_entropy=True, vocab_size=990)
    assert saved
    big = [(d, k) for d, k, is_input in saved if k > 4 * n and not is_input]
    assert not big, f"saved for backward beyond per-token vectors: {big}"
    assert all(d == torch.bfloat16 for d, k, is_input in saved if is_input)
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16 and logits.grad.shape == (n, v)


class _LargestFloat32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_fp32_tensor_larger_than_a_chunk():
    """Forward and backward build fp32 tensors of at most chunk_tokens x V (the one-chunk path
    builds [tokens, V] ones: the plain baseline)."""
    n, v, chunk = 96, 500, 16
    logits = torch.randn(n, v).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,))
    for c, bound in ((chunk, chunk * v), (None, n * v)):
        mode = _LargestFloat32()
        with mode:
            lp, ent = vocab_parallel_logprobs(logits, labels, 0.7, with_entropy=True, chunk_tokens=c)
            torch.autograd.grad(lp.sum() + ent.sum(), logits)
        assert mode.largest == bound, (c, mode.largest, bound)


def _tp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        logits, labels, w1, w2 = _tp_inputs()
        part = logits.chunk(world, -1)[rank]
        out = {}
        for chunk in (None, 5):
            lp, ent, grad = _call(part, labels, 0.8, 90, True, chunk, w1, w2, tp_group=dist.group.WORLD)
            out[chunk] = {"lp": lp, "ent": ent, "grad": grad}
        torch.save(out, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _tp_inputs():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(37, 96, generator=g) * 3
    labels = torch.randint(0, 90, (37,), generator=g)
    return logits, labels, torch.randn(37, generator=g), torch.randn(37, generator=g)


@pytest.mark.multiprocess
def test_tensor_parallel_chunked_equals_unchunked(tmp_path):
    """TP=2 on gloo (rank 1's slice holds the vocabulary padding), 37 tokens in chunks of 5 vs
    one chunk: the per-chunk all-reduces give the same values and gradient slices, and both
    match the single-rank full-vocabulary result (to float32 summation order across ranks)."""
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    logits, labels, w1, w2 = _tp_inputs()
    lp, ent, grad = _call(logits, labels, 0.8, 90, True, None, w1, w2)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in got:
        for k in ("lp", "ent", "grad"):
            assert (r[5][k] - r[None][k]).abs().max() < 1e-6, k
        assert (r[5]["lp"] - lp).abs().max() < 1e-5 and (r[5]["ent"] - ent).abs().max() < 1e-5
        assert torch.equal(r[5]["lp"], got[0][5]["lp"]) and torch.equal(r[5]["ent"], got[0][5]["ent"])
    scale = grad.abs().max().clamp(min=1.0)  # |grad| reaches ~ |w| (1/T) (1 + |x - E_p[x]|)
    assert (torch.cat([r[5]["grad"] for r in got], -1) - grad).abs().max() < 1e-5 * scale
    assert (got[1][5]["grad"][:, 90 - 48:] == 0).all()  # rank 1's padded vocabulary


def test_chunk_size_rule():
    from skyrl_mega.megatron.logprobs import AUTO_CHUNK_BYTES, chunk_size

    for v in (248320, 248320 // 8, 1000):
        c = chunk_size("auto", 10**7, v)
        assert c & (c - 1) == 0 and 4 * c * v <= AUTO_CHUNK_BYTES < 8 * c * v
    assert chunk_size("auto", 100, 248320) == 100 and chunk_size(None, 100, 8) == chunk_size(0, 100, 8) == 100
    assert chunk_size(7, 100, 8) == 7 and chunk_size(7, 0, 8) == 1
    for bad in (-1, "big", 2.5):
        with pytest.raises(ValueError):
            chunk_size(bad, 100, 8)
