"""Bad configs fail fast with one clear message, before any process group starts."""

import pytest
import torch.distributed as dist

from skyrl_mega import cli
from skyrl_mega.config import ConfigError, load_config, validate_config

RECIPE = cli.DEFAULT_RECIPE


def _validate(model_dir, overrides, world):
    cfg = load_config(RECIPE, [f"model.path={model_dir}", *overrides])
    validate_config(cfg, world)


def test_tiny_recipe_is_valid(tiny_qwen3_moe):
    _validate(tiny_qwen3_moe, [], 2)


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron3", "qwen3_5_moe"])
def test_every_family_has_a_valid_one_gpu_recipe(family, request):
    """recipes/<family>/tiny_gpu.yaml: the colocated one-GPU run (bench/gpu_colocated_rl.py) validates
    on the family's tiny model at world size 1, with R3 and CUDA IPC weight sync."""
    model = request.getfixturevalue(f"tiny_{family}")
    cfg = load_config(f"{family}/tiny_gpu", [f"model.path={model}"])
    validate_config(cfg, 1)
    assert (cfg.placement, cfg.algorithm.routing_replay, cfg.rollout.sleep_level) == ("colocated", True, 1)


@pytest.mark.parametrize("overrides, world, needle", [
    (["parallel.tp=2", "parallel.ep=1"], 3, "world size 3 is not divisible by tp*pp*cp"),
    (["parallel.ep=3"], 3, "8 experts are not divisible by parallel.ep=3"),
    (["parallel.tp=2", "parallel.ep=1", "parallel.sequence_parallel=false"], 2, "needs sequence parallel"),
    (["parallel.pp=3", "parallel.ep=1"], 3, "4 layers are not divisible by parallel.pp=3"),
    (["model.dtype=float16"], 2, "model.dtype='float16' is not one of"),
    (["rollout.weight_transport=rdma"], 2, "rollout.weight_transport='rdma' is not one of"),
    (["rollout.gpu_memory_utilization=1.2"], 2, "rollout.gpu_memory_utilization=1.2 must be in (0, 1]"),
    (["rollout.engine_tp=0"], 2, "rollout.engine_tp must be >= 1"),
    (["rollout.num_servers=2", "rollout.engine_gpus=[0]"], 2, "names 1 GPU sets for rollout.num_servers=2"),
    (["rollout.engine_tp=2", "rollout.engine_gpus=[0]"], 2, "must list rollout.engine_tp=2 GPU index"),
])
def test_bad_parallel_layouts(tiny_qwen3_moe, overrides, world, needle):
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*").replace("(", r"\(")):
        _validate(tiny_qwen3_moe, overrides, world)


def test_missing_model_path():
    cfg = load_config(None, [])
    with pytest.raises(ConfigError, match="model.path is missing"):
        validate_config(cfg, 1)
    cfg = load_config(None, ["model.path=/nonexistent/model"])
    with pytest.raises(ConfigError, match="does not exist"):
        validate_config(cfg, 1)


@pytest.mark.parametrize("overrides, needle", [
    (["parallel.tpp=2"], "Key 'tpp' not in 'ParallelConfig'"),
    (["bogus=1"], "Key 'bogus'"),
    (["parallel.tp=two"], "tp"),
    (["just_a_word"], "key=value"),
])
def test_unknown_or_malformed_keys(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(RECIPE, overrides)


def test_every_problem_reported_in_one_message(tiny_qwen3_moe):
    with pytest.raises(ConfigError) as e:
        _validate(tiny_qwen3_moe, ["parallel.ep=3", "parallel.pp=3"], 4)
    msg = str(e.value)
    assert "experts are not divisible" in msg and "layers are not divisible" in msg
    assert msg.count("\n  - ") >= 3


def test_cli_rejects_before_launching(tiny_qwen3_moe, capsys):
    rc = cli.main(["train", "--recipe", RECIPE, "--nproc", "2", f"model.path={tiny_qwen3_moe}",
                   "parallel.ep=3", "--entry", "no_such_module_would_fail_if_launched"])
    assert rc == 2
    assert "8 experts are not divisible by parallel.ep=3" in capsys.readouterr().err
    assert not dist.is_initialized()


@pytest.mark.parametrize("argv, needle", [
    (["nemotron3", "--multimodal"], "multimodal=True: only for qwen3_5_moe"),
    (["mixtral"], "unknown model family 'mixtral'"),
])
def test_make_tiny_user_errors_are_one_line(argv, needle, tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "skyrl_mega.cli", "make-tiny", argv[0], str(tmp_path / "m"), *argv[1:]],
                         capture_output=True, text=True)
    assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / "m").exists()
