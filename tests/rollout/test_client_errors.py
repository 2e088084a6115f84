"""Client failure modes against a local fake engine (fast, no vLLM): every bad answer is a
clear RolloutError, retries are bounded, nothing hangs."""

import asyncio
import time

import numpy as np
import pytest
from aiohttp import web

from skyrl_mega.rollout import r3_wire
from skyrl_mega.rollout.client import RolloutClient, SamplingParams
from skyrl_mega.rollout.errors import (
    RolloutBadRequestError,
    RolloutConnectionError,
    RolloutError,
    RolloutHTTPError,
    RolloutResponseError,
    RolloutTimeoutError,
)
from skyrl_mega.ports import free_port

PROMPT = [3, 4, 5]


def good_choice(i=0, n_tokens=2, prompt_len=len(PROMPT), rows=None):
    rows = prompt_len + n_tokens - 1 if rows is None else rows
    return {
        "index": i,
        "token_ids": list(range(10, 10 + n_tokens)),
        "finish_reason": "length",
        "logprobs": {"content": [{"token": "x", "logprob": -0.5}] * n_tokens},
        "routed_experts": r3_wire.encode_vllm(np.full((rows, 4, 2), 3, dtype=np.uint8)),
    }


class FakeEngine:
    """In-process aiohttp server whose /inference/v1/generate answer is set per test."""

    def __init__(self):
        self.mode = "good"
        self.calls = 0
        self.delay = 0.0
        self.in_flight = 0
        self.max_in_flight = 0

    async def handler(self, request):
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request):
        body = await request.json()
        n = body["sampling_params"]["n"]
        m = self.mode
        if m == "good":
            return web.json_response({"choices": [good_choice(i) for i in range(n)]})
        if m == "notjson":
            return web.Response(text="<html>surprise</html>", status=200)
        if m == "nochoices":
            return web.json_response({"result": []})
        if m == "missing_logprobs":
            ch = good_choice()
            del ch["logprobs"]
            return web.json_response({"choices": [ch]})
        if m == "missing_tokens":
            ch = good_choice()
            del ch["token_ids"]
            return web.json_response({"choices": [ch]})
        if m == "missing_routes":
            ch = good_choice()
            ch["routed_experts"] = None
            return web.json_response({"choices": [ch]})
        if m == "bad_routes":
            ch = good_choice()
            ch["routed_experts"] = "%%%garbage%%%"
            return web.json_response({"choices": [ch]})
        if m == "wrong_rows":
            return web.json_response({"choices": [good_choice(rows=99)]})
        if m == "n_mismatch":
            return web.json_response({"choices": [good_choice(0)]})
        if m == "http500":
            return web.json_response({"error": "engine dead"}, status=500)
        if m == "http400":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        if m == "flaky":
            if self.calls <= 2:
                return web.Response(text="try later", status=503)
            return web.json_response({"choices": [good_choice(i) for i in range(n)]})
        if m == "slow":
            await asyncio.sleep(3)
        if m == "drop":
            request.transport.close()
            await asyncio.sleep(1)
        raise AssertionError(m)


@pytest.fixture
def fake():
    """Yields (engine, url) with the server running on its own loop in a thread."""
    import threading

    engine = FakeEngine()
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder = {}

    async def up():
        app = web.Application()
        app.router.add_post("/inference/v1/generate", engine.handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        holder["runner"] = runner
        started.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(up()), loop.run_forever()), daemon=True)
    t.start()
    assert started.wait(10)
    yield engine, f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(20)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def run(coro, timeout=30):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def one(url, sampling=None, **kw):
    kw.setdefault("backoff_base_s", 0.01)
    kw.setdefault("backoff_max_s", 0.05)
    async with RolloutClient(url, **kw) as c:
        return await c.generate(PROMPT, sampling or SamplingParams(max_tokens=2))


def test_good_response_parses(fake):
    engine, url = fake
    gen = run(one(url, SamplingParams(max_tokens=2, n=3), moe_layers=[1, 2, 3], num_experts=8))
    assert len(gen.samples) == 3
    s = gen.samples[0]
    assert s.token_ids == [10, 11] and s.logprobs == [-0.5, -0.5] and s.finish_reason == "length"
    assert s.routed_experts.shape == (len(PROMPT) + 1, 3, 2) and s.routed_experts.dtype == np.uint8
    routes, valid = s.aligned_routes(len(PROMPT))
    assert routes.shape[0] == len(PROMPT) + 2 and not valid[-1]


@pytest.mark.parametrize(
    "mode, match",
    [
        ("notjson", "not JSON"),
        ("nochoices", "no 'choices'"),
        ("missing_logprobs", "logprobs"),
        ("missing_tokens", "token_ids"),
        ("missing_routes", "routed_experts"),
        ("bad_routes", "base64"),
        ("wrong_rows", "rows"),
        ("n_mismatch", "n=2"),
    ],
)
def test_malformed_response_is_a_clear_error(fake, mode, match):
    engine, url = fake
    engine.mode = mode
    t0 = time.monotonic()
    with pytest.raises(RolloutResponseError, match=match):
        run(one(url, SamplingParams(max_tokens=2, n=2 if mode == "n_mismatch" else 1)))
    assert engine.calls == 1  # a malformed answer is not retried
    assert time.monotonic() - t0 < 5


def test_routes_not_required_when_disabled(fake):
    engine, url = fake
    engine.mode = "missing_routes"
    gen = run(one(url, return_routed_experts=False))
    assert gen.samples[0].routed_experts is None


def test_http_500_is_retried_then_raised(fake):
    engine, url = fake
    engine.mode = "http500"
    with pytest.raises(RolloutHTTPError) as ei:
        run(one(url, max_retries=3))
    assert ei.value.status == 500 and engine.calls == 4


def test_transient_503_recovers_by_retry(fake):
    engine, url = fake
    engine.mode = "flaky"
    gen = run(one(url, max_retries=5))
    assert gen.attempts == 3 and gen.samples[0].token_ids == [10, 11]


def test_http_400_is_not_retried(fake):
    engine, url = fake
    engine.mode = "http400"
    with pytest.raises(RolloutBadRequestError, match="prompt too long"):
        run(one(url, max_retries=5))
    assert engine.calls == 1


def test_deadline_bounds_a_slow_server(fake):
    engine, url = fake
    engine.mode = "slow"
    t0 = time.monotonic()
    with pytest.raises(RolloutTimeoutError):
        run(one(url, deadline_s=1.0))
    assert time.monotonic() - t0 < 5


def test_dropped_connection_is_retried_then_raised(fake):
    engine, url = fake
    engine.mode = "drop"
    with pytest.raises(RolloutConnectionError):
        run(one(url, max_retries=2))
    assert engine.calls == 3


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RolloutConnectionError, match="gave up after 3 attempts"):
        run(one(url, max_retries=2))
    assert time.monotonic() - t0 < 5
    # with a short deadline and many retries the deadline wins
    with pytest.raises((RolloutTimeoutError, RolloutConnectionError)):
        run(one(url, max_retries=1000, deadline_s=1.0))
    assert time.monotonic() - t0 < 10


def test_bad_requests_are_rejected_before_sending():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RolloutBadRequestError, match="empty"):
        run(_gen(url, []))
    with pytest.raises(RolloutBadRequestError, match="max_model_len"):
        run(_gen(url, list(range(20)), max_model_len=16))
    with pytest.raises(RolloutBadRequestError, match="max_tokens"):
        run(_gen(url, PROMPT, sampling=SamplingParams(max_tokens=0)))
    with pytest.raises(RolloutBadRequestError, match="negative"):
        run(_gen(url, [1, -2]))
    assert issubclass(RolloutBadRequestError, RolloutError)


async def _gen(url, prompt, sampling=None, **kw):
    async with RolloutClient(url, **kw) as c:
        return await c.generate(prompt, sampling)


def test_batch_respects_concurrency_bound(fake):
    engine, url = fake
    engine.delay = 0.05

    async def go():
        async with RolloutClient(url, max_concurrency=3) as c:
            return await c.generate_batch([PROMPT] * 12, SamplingParams(max_tokens=2))

    gens = run(go())
    assert len(gens) == 12 and all(len(g.samples) == 1 for g in gens)
    assert engine.max_in_flight == 3
