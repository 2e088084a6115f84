"""An engine bound beyond loopback refuses control calls without the job's secret.

Unit: the middleware's open / protected paths on a FastAPI app. Real: a vLLM CPU server bound to
this host's own routed address (ServerConfig adds vLLM's --middleware with the project's
require_secret there): /health and rollouts stay open; /pause without the secret is 401, with it
(control.http_json sends $SKYRL_ENGINE_SECRET) it pauses and resumes.
"""

import os

import pytest

from skyrl_mega.rollout import engine_auth
from skyrl_mega.rollout.client import SamplingParams
from skyrl_mega.rollout.control import EngineControl, http_json
from skyrl_mega.rollout.errors import RolloutHTTPError
from skyrl_mega.rollout.servers import ServerConfig, ServerManager

from ..test_ports import own_ipv4
from .vllm_stack import MARKS, MAX_MODEL_LEN, prompts, rollout, run


def test_middleware_opens_rollouts_and_guards_control(monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.middleware("http")(engine_auth.require_secret)
    for path in ("/health", "/inference/v1/generate", "/v1/models", "/pause", "/collective_rpc",
                 "/init_weight_transfer_engine", "/sleep"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    client = TestClient(app)
    monkeypatch.delenv(engine_auth.SECRET_ENV, raising=False)
    assert client.post("/pause").status_code == 403  # a server without a secret refuses control
    monkeypatch.setenv(engine_auth.SECRET_ENV, "s3cret")
    for path in ("/health", "/inference/v1/generate", "/v1/models"):
        assert client.post(path).status_code == 200, path
    for path in ("/pause", "/collective_rpc", "/init_weight_transfer_engine", "/sleep"):
        assert client.post(path).status_code == 401, path
        assert client.post(path, headers={engine_auth.HEADER: "wrong"}).status_code == 401, path
        assert client.post(path, headers=engine_auth.client_headers()).status_code == 200, path


def test_only_servers_beyond_loopback_get_the_middleware(tmp_path, monkeypatch):
    monkeypatch.delenv(engine_auth.SECRET_ENV, raising=False)
    assert "--middleware" not in ServerConfig(model="/m").argv(8000)
    argv = ServerConfig(model="/m", host="10.1.2.3").argv(8000)
    assert argv[argv.index("--middleware") + 1] == engine_auth.MIDDLEWARE
    assert len(os.environ[engine_auth.SECRET_ENV]) == 32  # made for this job, inherited by the server


def _with_vllm(test):
    """MARKS (skipped without vLLM; vllm, multiprocess) on one test, not on the unit tests."""
    for mark in MARKS:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def remote_server(tiny_qwen3_moe_vllm, tmp_path_factory):
    host = own_ipv4()
    if host is None:
        pytest.skip("this host has no routed IPv4 interface")
    os.environ.pop(engine_auth.SECRET_ENV, None)
    cfg = ServerConfig(model=tiny_qwen3_moe_vllm, dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, host=host)
    sm = ServerManager(cfg, num_servers=1, log_dir=str(tmp_path_factory.mktemp("auth_logs")), startup_timeout_s=240,
                       watch_interval_s=0.5)
    sm.start()
    try:
        yield sm
    finally:
        sm.stop()
        os.environ.pop(engine_auth.SECRET_ENV, None)


@_with_vllm
def test_a_control_call_without_the_job_secret_is_refused(remote_server):
    url = remote_server.urls[0]
    assert not url.startswith("http://127.")
    secret = os.environ.pop(engine_auth.SECRET_ENV)
    try:
        with pytest.raises(RolloutHTTPError) as e:
            http_json("POST", url + "/pause?mode=keep", timeout_s=30)
        assert e.value.status == 401
        assert http_json("GET", url + "/health", timeout_s=30) is None  # open
    finally:
        os.environ[engine_auth.SECRET_ENV] = secret
    ctl = EngineControl([url], timeout_s=60)
    ctl.pause("keep")
    assert all(ctl.is_paused().values())
    ctl.resume()
    gens = run(rollout(url, prompts(1), SamplingParams(max_tokens=4, seed=1)))
    assert len(gens[0].samples[0].token_ids) == 4  # rollouts need no secret
