"""The rollout stack against a real vLLM CPU server behind vllm-router (tiny Qwen3-MoE, fp32).

ONE server and ONE router for the whole module (module-scoped fixture, tests/rollout/
vllm_stack.py); the tests run in file order. The engine crash has its own stack
(test_vllm_crash.py). Every wait has a timeout.
"""

import asyncio
import os
import time

import numpy as np
import pytest

from skyrl_mega.rollout import r3_wire
from skyrl_mega.rollout.client import RolloutClient, SamplingParams
from skyrl_mega.rollout.control import EngineControl
from skyrl_mega.rollout.engine_caps import EngineCaps
from skyrl_mega.rollout.errors import RolloutBadRequestError, RolloutConnectionError
from skyrl_mega.weight_sync.transports.shm import SharedMemoryTransport

from .hf_reference import max_abs_diff, perturbed_checkpoint
from .vllm_stack import MARKS, MAX_MODEL_LEN, MOE, TOL, check_against_hf, prompts, rollout, run, send_update

pytestmark = MARKS


# -- 1. parity ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def first_rollout(stack):
    """4 prompts x n=3 through the router; routes as vLLM reports them (all layers)."""
    sampling = SamplingParams(max_tokens=24, n=3, temperature=1.0, seed=1234)
    return run(rollout(stack["router"].url, prompts(4), sampling))


def test_logprobs_match_transformers(hf, first_rollout):
    worst, _ = check_against_hf(hf, first_rollout, check_routes=False)
    assert sum(len(s.token_ids) for g in first_rollout for s in g.samples) > 50
    assert worst < TOL, f"max |logprob diff| {worst}"


def test_routed_experts_match_transformers(hf, first_rollout):
    n_layers = hf.config.num_hidden_layers
    moe = r3_wire.moe_layer_ids(hf.config)
    assert moe == hf.moe_layers == [1, 2, 3]
    checked = 0
    for g in first_rollout:
        for s in g.samples:
            raw = s.routed_experts  # vLLM: all layers, dense layer 0 holds zeros
            assert raw.dtype == np.uint8 and raw.shape[1] == n_layers
            assert not raw[:, 0].any()
            moe_routes = r3_wire.select_moe_layers(raw, moe, n_layers)
            _, ref = hf.score(g.prompt_token_ids, s.token_ids)
            rows = len(g.prompt_token_ids) + len(s.token_ids) - 1
            # every token (prompt + all generated but the last) and every MoE layer: 100%
            np.testing.assert_array_equal(moe_routes, ref[:rows])
            aligned, valid = s.aligned_routes(len(g.prompt_token_ids))
            assert aligned.shape[0] == rows + 1 and valid.sum() == rows
            checked += moe_routes.size
    assert checked > 1000


def test_client_maps_moe_layers_and_direct_equals_router(stack, hf):
    """moe_layers on the client gives [tokens, moe_layers, k]; same seed, same sample on both paths."""
    sampling = SamplingParams(max_tokens=12, n=2, seed=7)
    ps = prompts(2, seed=5)
    direct = run(rollout(stack["sm"].urls[0], ps, sampling, **MOE))
    routed = run(rollout(stack["router"].url, ps, sampling, **MOE))
    for a, b in zip(direct, routed):
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids == sb.token_ids
            np.testing.assert_array_equal(sa.routed_experts, sb.routed_experts)
    worst, n = check_against_hf(hf, direct)
    assert worst < TOL and n > 0


# -- 2. bad inputs on the real server ----------------------------------------------------------
def test_bad_inputs_are_clear_errors(stack):
    url = stack["router"].url

    async def go():
        async with RolloutClient(url, deadline_s=30) as c:
            with pytest.raises(RolloutBadRequestError, match="empty"):
                await c.generate([], SamplingParams(max_tokens=4))
            with pytest.raises(RolloutBadRequestError, match="maximum model length") as ei:
                await c.generate(list(range(3, 3 + MAX_MODEL_LEN + 10)), SamplingParams(max_tokens=4))
            assert ei.value.status == 400
            # at exactly max_model_len there is no room for one generated token: also 400
            with pytest.raises(RolloutBadRequestError):
                await c.generate([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=4))
            # the server is fine afterwards
            g = await c.generate([5, 6, 7], SamplingParams(max_tokens=4, seed=0))
            assert len(g.samples[0].token_ids) >= 1
        async with RolloutClient(url, deadline_s=30, max_model_len=MAX_MODEL_LEN) as c:
            with pytest.raises(RolloutBadRequestError, match="before sending"):
                await c.generate([5] * MAX_MODEL_LEN, SamplingParams(max_tokens=4))

    t0 = time.monotonic()
    run(go(), timeout=60)
    assert time.monotonic() - t0 < 30


def test_unreachable_server_is_a_clear_error():
    from skyrl_mega.ports import free_port

    t0 = time.monotonic()
    with pytest.raises(RolloutConnectionError):
        run(rollout(f"http://127.0.0.1:{free_port()}", [[5, 6]], SamplingParams(max_tokens=2),
                    max_retries=2, backoff_base_s=0.05), timeout=30)
    assert time.monotonic() - t0 < 10


def test_seeded_long_prompts_in_one_step_do_not_kill_the_engine(stack):
    """More prompt tokens than one step holds, every request seeded: with chunked prefill a
    split prefill would rewind a CPU generator (set_offset) and kill the engine; the manager
    starts CPU servers without chunked prefill. Seeded samples do not depend on batching."""
    url = stack["router"].url
    long_prompts = prompts(6, seed=61, lo=650, hi=700)  # ~4000 prompt tokens > 2048 per step
    sampling = SamplingParams(max_tokens=8, n=2, seed=17)
    first = run(rollout(url, long_prompts, sampling, **MOE))
    alone = run(rollout(url, long_prompts[3:4], sampling, **MOE))
    assert all(len(s.token_ids) == 8 for g in first for s in g.samples)
    assert [s.token_ids for s in alone[0].samples] == [s.token_ids for s in first[3].samples]
    assert stack["sm"].servers[0].restarts == 0


# -- 3. pause modes ------------------------------------------------------------------------------
# Long enough (seconds) that a pause lands mid-generation even when this process is starved
# of CPU by the engine on a 2-core box.
LONG = SamplingParams(max_tokens=MAX_MODEL_LEN - 40, n=1, seed=99, ignore_eos=True)


async def pause_mid_generation(client, ctl, prompt, sampling, mode, delays=(0.3, 0.15, 0.08, 0.04, 0.3, 0.15)):
    """Starts a long generation and pauses every engine while it runs; returns its task.

    The generation may finish before the pause takes hold (a fast machine, or a starved
    2-core box that delays the pause call): then resume and try again, pausing sooner each
    time (a keep-paused request stays unfinished; an aborted one comes back "abort"; for
    "wait" it must still be running when the pause is sent). A pause that came before the
    request reached the engine leaves it waiting: resume, let it finish, try again.
    """
    for delay in delays:
        task = asyncio.ensure_future(client.generate(prompt, sampling))
        await asyncio.sleep(delay)
        if task.done():
            continue
        await asyncio.to_thread(ctl.pause, mode)
        if mode == "wait":
            return task
        await asyncio.sleep(0.3)
        if mode == "keep" and not task.done():
            return task
        if mode == "abort":
            try:
                gen = await asyncio.wait_for(asyncio.shield(task), 30)
            except asyncio.TimeoutError:
                gen = None
            if gen is not None and gen.samples[0].finish_reason == "abort":
                return task
        await asyncio.to_thread(ctl.resume)
        await task
    pytest.fail(f"could not pause ({mode}) a generation in flight in {len(delays)} tries")


def test_pause_keep_inflight_finishes_correctly_after_resume(stack):
    url, ctl = stack["router"].url, stack["ctl"]
    prompt = prompts(1, seed=11)[0]

    async def go():
        async with RolloutClient(url, deadline_s=120) as c:
            t0 = time.monotonic()
            ref = await c.generate(prompt, LONG)
            plain_s = time.monotonic() - t0
            task = await pause_mid_generation(c, ctl, prompt, LONG, "keep")
            assert (await asyncio.to_thread(ctl.is_paused)) == {u: True for u in ctl.urls}
            await asyncio.sleep(max(1.0, 1.2 * plain_s))  # long enough to have finished unpaused
            assert not task.done(), "a keep-mode pause did not freeze the request"
            # a request sent while paused queues and runs after resume
            queued = asyncio.ensure_future(c.generate(prompt, LONG))
            await asyncio.sleep(0.3)
            assert not queued.done()
            await asyncio.to_thread(ctl.resume)
            got, again = await asyncio.gather(task, queued)
            return ref, got, again

    ref, got, again = run(go(), timeout=180)
    for g in (got, again):
        s, r = g.samples[0], ref.samples[0]
        assert s.finish_reason == "length" and len(s.token_ids) == LONG.max_tokens
        assert s.token_ids == r.token_ids  # same seed: the frozen request continued exactly
        assert max_abs_diff(s.logprobs, r.logprobs) < TOL
        np.testing.assert_array_equal(s.routed_experts, r.routed_experts)
    assert ctl.is_paused() == {u: False for u in ctl.urls}


def test_pause_wait_and_abort(stack):
    url, ctl = stack["router"].url, stack["ctl"]
    prompt = prompts(1, seed=12)[0]

    async def go():
        async with RolloutClient(url, deadline_s=120) as c:
            # wait: /pause returns only after the in-flight request finished normally
            task = await pause_mid_generation(c, ctl, prompt, LONG, "wait")
            # its response is already on the way back (router -> client): allow for transit
            waited = await asyncio.wait_for(task, 30)
            await asyncio.to_thread(ctl.resume)
            # abort: the in-flight request comes back at once with finish_reason "abort"
            task = await pause_mid_generation(c, ctl, prompt, LONG, "abort")
            aborted = task.result()
            await asyncio.to_thread(ctl.resume)
            after = await c.generate(prompt, SamplingParams(max_tokens=4, seed=1))
            return waited, aborted, after

    waited, aborted, after = run(go(), timeout=180)
    assert waited.samples[0].finish_reason == "length" and len(waited.samples[0].token_ids) == LONG.max_tokens
    s = aborted.samples[0]
    assert s.finish_reason == "abort" and len(s.token_ids) < LONG.max_tokens
    assert len(after.samples[0].token_ids) == 4


def test_control_calls_reach_every_server(stack):
    """sleep/wake (no-ops on CPU), prefix-cache reset, weight version, collective_rpc: direct to each server."""
    ctl, url = stack["ctl"], stack["router"].url
    assert ctl.health() == {u: True for u in ctl.urls}
    assert ctl.reset_prefix_cache() == {u: True for u in ctl.urls}
    ctl.sleep(1)  # vLLM's sleep pauses scheduling (held_by_sleep: a sync then skips its own pause)
    seen = [ctl.held_by_sleep, ctl.is_paused()]
    ctl.wake_up(tags=["weights"])
    seen += [ctl.held_by_sleep, ctl.is_paused()]
    ctl.wake_up()
    print("held_by_sleep after sleep / partial wake:", seen)
    assert seen[0] and seen[1] == {u: True for u in ctl.urls}
    assert seen[2] == all(seen[3].values())  # seen, not assumed (the CPU executor never sleeps)
    assert not ctl.held_by_sleep and ctl.is_paused() == {u: False for u in ctl.urls}
    ctl.set_weight_version("0")
    assert ctl.weight_versions() == {u: "0" for u in ctl.urls}
    assert ctl.collective_rpc("skyrl_weight_version") == {u: [{"version": None, "rank": 0}] for u in ctl.urls}
    assert ctl.caps.version.startswith("0.30") and ctl.caps.has("/weight_info")
    # a vLLM without /update_weight_version and /weight_info (0.26): the worker extension keeps it
    no_version_api = EngineCaps("0.26.0", frozenset(p for p in ctl.caps.endpoints
                                                    if p not in ("/weight_info", "/update_weight_version")))
    old = EngineControl(ctl.urls, caps=no_version_api)
    assert old.weight_versions() == {u: None for u in ctl.urls}
    old.set_weight_version("7")
    assert old.weight_versions() == {u: "7" for u in ctl.urls}
    assert ctl.weight_versions() == {u: "0" for u in ctl.urls}  # vLLM's own record is untouched
    with pytest.raises(ValueError):
        ctl.pause("freeze")
    gen = run(rollout(url, [[5, 6, 7]], SamplingParams(max_tokens=4, seed=0)))
    assert len(gen[0].samples[0].token_ids) == 4


# -- 4. weight updates through /dev/shm -------------------------------------------------------------
def test_weight_update_cpu_moe_bug_and_fix(stack, hf, tmp_path_factory):
    ctl, url = stack["ctl"], stack["router"].url
    base = stack["model"]
    d1, d2 = (str(tmp_path_factory.mktemp(f"weights_v{i}")) for i in (1, 2))
    w1 = perturbed_checkpoint(base, d1, seed=1)
    w2 = perturbed_checkpoint(base, d2, seed=2)
    transport = SharedMemoryTransport(ctl, pause_mode="keep")
    shm_before = {f for f in os.listdir("/dev/shm") if f.startswith("skyrl_mega_w")}
    sampling = SamplingParams(max_tokens=16, n=2, seed=3)
    ps = prompts(3, seed=21)
    hf.load(d1)

    # without the fix (switched off inside the engine): vLLM CPU's in-place update is wrong
    assert ctl.collective_rpc("skyrl_set_moe_reload_fix", {"enabled": "0"}) == {
        u: [{"enabled": False, "installed": True}] for u in ctl.urls
    }
    try:
        send_update(transport, w1, "1-nofix")
        broken, _ = check_against_hf(hf, run(rollout(url, ps, sampling, **MOE)), check_routes=False)
    finally:
        ctl.collective_rpc("skyrl_set_moe_reload_fix", {"enabled": "1"})
    assert broken > 1e-2, f"expected the known CPU MoE reload bug to show, max diff {broken}"

    # with the fix: same weights again, then a second update
    for version, weights, d in ((1, w1, d1), (2, w2, d2)):
        report = send_update(transport, weights, version)
        assert report == {u: [{"version": version, "num_tensors": len(weights),
                                "seconds": report[u][0]["seconds"], "rank": 0}] for u in ctl.urls}
        assert ctl.weight_versions() == {u: str(version) for u in ctl.urls}
        assert ctl.collective_rpc("skyrl_weight_version") == {u: [{"version": version, "rank": 0}] for u in ctl.urls}
        assert ctl.is_paused() == {u: False for u in ctl.urls}
        hf.load(d)
        worst, n = check_against_hf(hf, run(rollout(url, ps, sampling, **MOE)))
        assert worst < TOL, f"after update {version}: max |logprob diff| {worst}"
        assert n > 0
    # the transport removed its shared-memory files (other runs on this box may have theirs)
    assert {f for f in os.listdir("/dev/shm") if f.startswith("skyrl_mega_w")} <= shm_before


def test_keep_pause_across_a_weight_update(stack, hf, tmp_path_factory):
    """A request frozen by a keep-mode pause survives an update: its tokens before the pause
    were sampled by the old weights, the rest by the new ones (KV recomputed)."""
    ctl, url = stack["ctl"], stack["router"].url
    d_old = str(tmp_path_factory.mktemp("weights_v2_again"))
    d_new = str(tmp_path_factory.mktemp("weights_v3"))
    w_old = perturbed_checkpoint(stack["model"], d_old, seed=2)  # v2, as the previous test leaves it
    w_new = perturbed_checkpoint(stack["model"], d_new, seed=3)
    transport = SharedMemoryTransport(ctl, pause_mode="keep", kv_after_update="recompute")
    if ctl.weight_versions() != {u: "2" for u in ctl.urls}:  # run alone: bring the engine to v2
        send_update(transport, w_old, 2)
    prompt = prompts(1, seed=31)[0]

    async def go():
        async with RolloutClient(url, deadline_s=120) as c:
            task = await pause_mid_generation(c, ctl, prompt, LONG, "keep")  # frozen in flight
            # the transport pauses (keep; already paused), loads, recomputes KV, resumes
            await asyncio.to_thread(send_update, transport, w_new, 3)
            return await asyncio.wait_for(task, 60)

    gen = run(go(), timeout=180)
    s = gen.samples[0]
    assert s.finish_reason == "length" and len(s.token_ids) == LONG.max_tokens
    hf.load(d_old)
    old_lp, _ = hf.score(gen.prompt_token_ids, s.token_ids)
    hf.load(d_new)
    new_lp, _ = hf.score(gen.prompt_token_ids, s.token_ids)
    lp = np.asarray(s.logprobs)
    splits = [k for k in range(1, len(lp)) if max_abs_diff(lp[:k], old_lp[:k]) < TOL and max_abs_diff(lp[k:], new_lp[k:]) < TOL]
    d_o, d_n = np.abs(lp - old_lp), np.abs(lp - new_lp)
    assert splits, f"logprobs are neither old-then-new weights: |old| {np.round(d_o, 5).tolist()} |new| {np.round(d_n, 5).tolist()}"
