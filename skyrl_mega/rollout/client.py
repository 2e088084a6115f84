"""Async rollout client (aiohttp): token ids in; token ids, sampled logprobs, finish reason
and routed experts out.

Endpoint: vLLM's token-in/token-out `POST /inference/v1/generate` (`--enable-scale-out`),
directly on a server or through vllm-router. Request: `{"token_ids": [...],
"sampling_params": {"n", "temperature", "top_p", "top_k", "max_tokens", "seed",
"stop_token_ids", "logprobs": 0, ...}}`. Response: `choices[i]` with `token_ids`,
`logprobs.content[j].logprob` (the sampled token's logprob; logprobs=0 asks for it alone),
`finish_reason` ("stop" | "length" | "abort") and `routed_experts` (see r3_wire).

    async with RolloutClient(url, max_concurrency=32, moe_layers=[1, 2, 3], num_experts=8) as c:
        gens = await c.generate_batch(prompts, SamplingParams(max_tokens=64, n=4, seed=1))
    gens[0].samples[0].token_ids / .logprobs / .finish_reason / .routed_experts

Failure policy: connection errors, HTTP 5xx/408/429 are retried with exponential backoff
(with jitter) until `max_retries` or the per-request `deadline_s`, whichever comes first;
a retry gets a fresh request id and the same seed, so it reproduces the same sample on a
healthy engine. HTTP 4xx and malformed bodies are not retried. Every failure is a
RolloutError subclass (errors.py).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
import numpy as np

from . import r3_wire
from .errors import (
    RolloutBadRequestError,
    RolloutConnectionError,
    RolloutError,
    RolloutHTTPError,
    RolloutResponseError,
    RolloutTimeoutError,
)

GENERATE_PATH = "/inference/v1/generate"
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}
FINAL_ONLY = 2  # vllm.sampling_params.RequestOutputKind.FINAL_ONLY


@dataclass
class SamplingParams:
    """The subset of vLLM's SamplingParams a rollout needs (`extra` passes anything else)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "logprobs": 0,  # the sampled token's logprob only
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": False,
            "detokenize": False,
            # the final output only: vLLM 0.26's token endpoint left non-streaming requests
            # CUMULATIVE and then answered n>1 with fewer choices (vllm#52398; 0.30 sets it itself)
            "output_kind": FINAL_ONLY,
        }
        if self.seed is not None:
            d["seed"] = int(self.seed)
        if self.stop_token_ids:
            d["stop_token_ids"] = [int(t) for t in self.stop_token_ids]
        d.update(self.extra)
        return d


@dataclass
class Sample:
    """One sampled continuation."""

    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the engine's (unprocessed) policy
    finish_reason: str  # "stop" | "length" | "abort"
    # [prompt_len + len(token_ids) - 1, layers, top_k]; layers = the client's moe_layers when
    # it has them, else as the engine reported them (vLLM: all layers). None when not captured.
    routed_experts: np.ndarray | None = None

    def aligned_routes(self, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(routes [prompt_len + response_len, layers, k], valid mask): see r3_wire.align_to_sequence."""
        if self.routed_experts is None:
            raise RolloutError("this sample carries no routed experts")
        return r3_wire.align_to_sequence(self.routed_experts, prompt_len, len(self.token_ids))


@dataclass
class Generation:
    """All samples of one prompt."""

    prompt_token_ids: list[int]
    samples: list[Sample]
    request_id: str
    url: str
    attempts: int = 1
    seconds: float = 0.0


class RolloutClient:
    """Async client for one base URL (a vLLM server or vllm-router)."""

    def __init__(
        self,
        base_url: str,
        max_concurrency: int = 64,
        deadline_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 8,
        backoff_base_s: float = 0.25,
        backoff_max_s: float = 8.0,
        return_routed_experts: bool = True,
        moe_layers: Sequence[int] | None = None,
        num_hidden_layers: int | None = None,
        num_experts: int | None = None,
        max_model_len: int | None = None,
        model: str | None = None,
    ):
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + GENERATE_PATH
        self.max_concurrency = max_concurrency
        self.deadline_s = deadline_s
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.return_routed_experts = return_routed_experts
        self.moe_layers = list(moe_layers) if moe_layers is not None else None
        self.num_hidden_layers = num_hidden_layers
        self.num_experts = num_experts
        self.max_model_len = max_model_len
        self.model = model
        self._session: aiohttp.ClientSession | None = None
        self._sem: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"requests": 0, "retries": 0, "samples": 0, "tokens": 0}

    # -- session ---------------------------------------------------------------------------
    async def __aenter__(self) -> "RolloutClient":
        self._ensure_session()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
        self._sem = None
        self._loop = None

    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_concurrency + 8, force_close=False),
                raise_for_status=False,
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)
            self._loop = loop
        return self._session

    # -- generation ------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None) -> Generation:
        """All `sampling.n` samples of one prompt."""
        sampling = sampling or SamplingParams()
        prompt = self._validate(prompt_token_ids, sampling)
        session = self._ensure_session()
        assert self._sem is not None
        async with self._sem:
            return await self._post_with_retries(session, prompt, sampling)

    async def generate_batch(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | None = None
    ) -> list[Generation]:
        """One Generation per prompt, in order; at most max_concurrency requests in flight.

        The first failing prompt raises (the others are cancelled).
        """
        sampling = sampling or SamplingParams()
        for p in prompts:
            self._validate(p, sampling)
        tasks = [asyncio.ensure_future(self.generate(p, sampling)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _validate(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        try:
            sampling.validate()
        except ValueError as e:
            raise RolloutBadRequestError(self.url, None, str(e)) from None
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RolloutBadRequestError(self.url, None, "prompt_token_ids is empty")
        if min(prompt) < 0:
            raise RolloutBadRequestError(self.url, None, "prompt_token_ids holds negative ids")
        if self.max_model_len is not None and len(prompt) >= self.max_model_len:
            raise RolloutBadRequestError(
                self.url, None,
                f"prompt has {len(prompt)} tokens; max_model_len {self.max_model_len} leaves no room to generate",
            )
        return prompt

    def _backoff(self, attempt: int) -> float:
        base = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return base * (0.5 + random.random() / 2)

    async def _post_with_retries(self, session, prompt: list[int], sampling: SamplingParams) -> Generation:
        t0 = time.monotonic()
        deadline = t0 + self.deadline_s
        base_id = uuid.uuid4().hex[:16]
        last: Exception | None = None
        attempt = 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RolloutTimeoutError(
                    f"{self.url}: no answer within the {self.deadline_s:.0f}s deadline "
                    f"after {attempt - 1} attempt(s); last error: {last!r}"
                )
            payload = {
                "request_id": f"skyrl-{base_id}-{attempt}",
                "token_ids": prompt,
                "sampling_params": sampling.to_json(),
            }
            if self.model:
                payload["model"] = self.model
            timeout = aiohttp.ClientTimeout(total=remaining, sock_connect=min(self.connect_timeout_s, remaining))
            self.stats["requests"] += 1
            try:
                async with session.post(self.url, json=payload, timeout=timeout) as resp:
                    status = resp.status
                    body = await resp.text()
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = RolloutConnectionError(f"{self.url}: {type(e).__name__}: {e}")
            except asyncio.TimeoutError:
                raise RolloutTimeoutError(
                    f"{self.url}: request ran past the {self.deadline_s:.0f}s deadline (attempt {attempt})"
                ) from None
            else:
                if status == 200:
                    gen = self._parse(body, prompt, sampling, payload["request_id"])
                    gen.attempts = attempt
                    gen.seconds = time.monotonic() - t0
                    self.stats["samples"] += len(gen.samples)
                    self.stats["tokens"] += sum(len(s.token_ids) for s in gen.samples)
                    return gen
                if status in _RETRY_STATUS:
                    last = RolloutHTTPError(self.url, status, body)
                elif 400 <= status < 500:
                    raise RolloutBadRequestError(self.url, status, body)
                else:
                    raise RolloutHTTPError(self.url, status, body)
            if attempt > self.max_retries:
                if isinstance(last, RolloutHTTPError):
                    raise last
                raise RolloutConnectionError(f"gave up after {attempt} attempts: {last}") from None
            self.stats["retries"] += 1
            await asyncio.sleep(min(self._backoff(attempt), max(0.0, deadline - time.monotonic())))

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self, body: str, prompt: list[int], sampling: SamplingParams, request_id: str) -> Generation:
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            raise RolloutResponseError(f"{self.url}: response is not JSON ({e}): {body[:200]!r}") from None
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise RolloutResponseError(f"{self.url}: response has no 'choices' list: {body[:200]!r}")
        choices = data["choices"]
        if len(choices) != sampling.n:
            raise RolloutResponseError(f"{self.url}: asked for n={sampling.n} samples, got {len(choices)}")
        samples: list[Sample | None] = [None] * len(choices)
        for pos, ch in enumerate(choices):
            if not isinstance(ch, dict):
                raise RolloutResponseError(f"{self.url}: choice {pos} is not an object")
            idx = ch.get("index", pos)
            if not isinstance(idx, int) or not 0 <= idx < len(choices) or samples[idx] is not None:
                raise RolloutResponseError(f"{self.url}: bad or repeated choice index {idx!r}")
            samples[idx] = self._parse_choice(ch, idx, len(prompt))
        return Generation(prompt, samples, data.get("request_id", request_id), self.base_url)

    def _parse_choice(self, ch: dict, idx: int, prompt_len: int) -> Sample:
        where = f"{self.url}: choice {idx}"
        token_ids = ch.get("token_ids")
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise RolloutResponseError(f"{where}: missing or non-integer 'token_ids'")
        finish = ch.get("finish_reason")
        if not isinstance(finish, str):
            raise RolloutResponseError(f"{where}: missing 'finish_reason'")
        lp = ch.get("logprobs")
        content = lp.get("content") if isinstance(lp, dict) else None
        if not isinstance(content, list) or len(content) != len(token_ids):
            raise RolloutResponseError(
                f"{where}: 'logprobs.content' must hold one entry per token ({len(token_ids)}), got "
                f"{len(content) if isinstance(content, list) else type(content).__name__}"
            )
        logprobs = []
        for j, entry in enumerate(content):
            v = entry.get("logprob") if isinstance(entry, dict) else None
            if not isinstance(v, (int, float)):
                raise RolloutResponseError(f"{where}: token {j} has no numeric logprob")
            logprobs.append(float(v))
        routes = None
        if self.return_routed_experts:
            raw = ch.get("routed_experts")
            if raw is None:
                if finish != "abort" and token_ids:
                    raise RolloutResponseError(
                        f"{where}: no 'routed_experts' (start the server with --enable-return-routed-experts, "
                        f"or make the client with return_routed_experts=False)"
                    )
            else:
                try:
                    routes = r3_wire.decode_vllm(raw)
                    if finish != "abort" and routes.shape[0] != prompt_len + len(token_ids) - 1:
                        raise r3_wire.R3FormatError(
                            f"routes have {routes.shape[0]} rows; prompt {prompt_len} + response "
                            f"{len(token_ids)} - 1 = {prompt_len + len(token_ids) - 1} expected"
                        )
                    if self.moe_layers is not None:
                        routes = r3_wire.select_moe_layers(routes, self.moe_layers, self.num_hidden_layers)
                    if self.num_experts is not None:
                        routes = r3_wire.compact(routes, self.num_experts)
                except r3_wire.R3FormatError as e:
                    raise RolloutResponseError(f"{where}: {e}") from None
        return Sample(token_ids, logprobs, finish, routes)


def generate_sync(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | None = None,
    **client_kwargs,
) -> list[Generation]:
    """Blocking helper for scripts: one client, one batch, event loop of its own."""

    async def _run():
        async with RolloutClient(base_url, **client_kwargs) as c:
            return await c.generate_batch(prompts, sampling)

    return asyncio.run(_run())
