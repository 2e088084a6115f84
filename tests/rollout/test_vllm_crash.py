"""A vLLM CPU server whose engine is killed mid-rollout: the server is restarted and the
rollout completes (tiny Qwen3-MoE behind vllm-router). A stack of its own, so the kill touches
no other test. Every wait is on an observed event, with a timeout.
"""

import asyncio
import os
import signal
import time

import pytest

from skyrl_mega.rollout.client import RolloutClient, SamplingParams
from skyrl_mega.rollout.control import EngineControl
from skyrl_mega.rollout.errors import RolloutConnectionError, RolloutError, RolloutTimeoutError

from .vllm_stack import MARKS, MOE, TOL, check_against_hf, prompts, run

pytestmark = MARKS


def _engine_worker_pids(leader):
    def kids(pid):
        out = []
        for p in os.listdir("/proc"):
            if p.isdigit():
                try:
                    with open(f"/proc/{p}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                            out.append(int(p))
                except (OSError, ValueError, IndexError):
                    pass
        return out

    return [w for c in kids(leader) for w in kids(c)] or kids(leader)


def _metric(text, name):
    import re

    return sum(float(v) for v in re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def _metrics_text(server_url):
    import urllib.request

    return urllib.request.urlopen(f"{server_url}/metrics", timeout=10).read().decode()


def _wait_generation_started(server_url, timeout_s, gave_up=lambda: False):
    """Until the engine's Prometheus metrics show requests running (False: the caller's batch
    ended first, `gave_up()`, e.g. with an error before reaching the engine)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = _metrics_text(server_url)
        if _metric(text, "num_requests_running") > 0:
            return True
        if gave_up():
            return False
        time.sleep(0.02)
    raise AssertionError(f"no request ran on {server_url} within {timeout_s}s "
                         f"(waiting there: {_metric(text, 'num_requests_waiting')})")


@pytest.mark.slow
def test_server_crash_mid_rollout_is_restarted_and_rollout_completes(stack, hf):
    sm, url = stack["sm"], stack["router"].url
    server = sm.servers[0]
    leader = server.child.pid
    ps = prompts(8, seed=41)
    sampling = SamplingParams(max_tokens=400, n=2, seed=5, ignore_eos=True)
    victims = _engine_worker_pids(leader)
    assert victims

    async def go():
        # bounded by the deadline alone: a restart on a loaded box may take minutes
        patient = RolloutClient(url, deadline_s=360, max_retries=1_000_000, backoff_max_s=2.0, **MOE)
        impatient = RolloutClient(url, deadline_s=4.0, max_retries=100, backoff_max_s=0.5)
        async with patient, impatient:
            # Kill on observed events, never after a sleep: once the engine reports requests
            # running, pause it with the requests frozen in flight (keep), so however loaded the
            # box is the batch cannot finish before the kill lands.
            batch = asyncio.ensure_future(patient.generate_batch(ps, sampling))
            if not await asyncio.to_thread(_wait_generation_started, server.url, 120, batch.done):
                await batch  # it ended before any request ran: its own error is the failure
                pytest.fail(f"the batch finished before the engine reported it running ({patient.stats})")
            await asyncio.to_thread(EngineControl([server.url], timeout_s=120).pause, "keep")
            assert not batch.done()
            for pid in victims:  # the engine's worker dies, as in a real crash
                os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            await asyncio.sleep(1.0)
            # a short-deadline caller gets a clear error, not a hang
            with pytest.raises(RolloutError) as ei:
                await impatient.generate(ps[0], SamplingParams(max_tokens=8))
            assert isinstance(ei.value, (RolloutTimeoutError, RolloutConnectionError)) or (
                getattr(ei.value, "status", 0) or 0) >= 500, repr(ei.value)
            gens = await batch
            return gens, time.monotonic() - t_kill, patient.stats

    gens, recovered_s, stats = run(go(), timeout=480)
    assert server.restarts == 1 and server.child.pid != leader, sm.events
    assert any("restarting" in e for e in sm.events)
    assert stats["retries"] > 0
    assert all(len(s.token_ids) == 400 and s.finish_reason == "length" for g in gens for s in g.samples)
    # prompts answered after the restart come from the original weights: exact again
    retried = [g for g in gens if g.attempts > 1]
    assert retried
    hf.load(stack["model"])
    worst, _ = check_against_hf(hf, retried)
    assert worst < TOL
    assert recovered_s < 180
