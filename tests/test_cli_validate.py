"""`skyrl-mega validate` / `train` run the one validator in the launching process: every bad
field is named in one message, exit 2, before torchrun or any engine starts."""

import http.server
import re
import threading

import pytest
import torch.distributed as dist

from skyrl_mega import cli
from skyrl_mega.ports import free_port

RECIPE = cli.DEFAULT_RECIPE
NO_LAUNCH = ["--entry", "no_such_module_would_fail_if_launched"]


def _problems(capsys):
    err = capsys.readouterr().err
    return err, [ln for ln in err.splitlines() if ln.strip()]


def _count(err):
    """How many problems the one message lists ("invalid config (N problems)"; 1 without a count)."""
    m = re.search(r"invalid config \((\d+) problems\)", err)
    return int(m.group(1)) if m else err.count("invalid config")


def test_validate_names_bad_algorithm_names_and_cp_on_a_hybrid(tiny_nemotron3, capsys):
    rc = cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_nemotron3}",
                   "algorithm.kl_estimator=k9", "algorithm.reduction=bogus", "parallel.cp=2"])
    err, _ = _problems(capsys)
    assert rc == 2, err
    assert "algorithm.kl_estimator='k9'" in err and "k3" in err  # names the key and the choices
    assert "algorithm.reduction='bogus'" in err and "token_mean" in err
    assert "parallel.cp=2" in err and "Mamba2" in err and "parallel.cp=1" in err


def test_a_config_the_bridge_cannot_build_is_one_line_before_any_rank(tmp_path, capsys):
    """Before, `convert` started torchrun and each rank died with a ValueError traceback."""
    from skyrl_mega.models.tiny import make_tiny

    hf = make_tiny("nemotron3", str(tmp_path / "latent"), moe_latent_size=16)
    capsys.readouterr()  # make-tiny's own progress lines
    rc = cli.main(["convert", "hf-to-mcore", hf, str(tmp_path / "out"), "--nproc", "2"])
    err, lines = _problems(capsys)
    assert rc == 2 and len(lines) == 1, err
    assert "moe_latent_size=16" in err and f"{hf}/config.json" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not dist.is_initialized()


def test_cp_is_valid_on_the_local_and_fast_specs(tiny_qwen3_moe, capsys):
    for spec in ("local", "fast"):
        rc = cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", "parallel.cp=2",
                       "parallel.world_size=2", f"model.spec={spec}", "train.packing=true"])
        assert rc == 0, capsys.readouterr().err


def test_train_rejects_them_before_torchrun(tiny_qwen3_moe, capsys):
    rc = cli.main(["train", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", "algorithm.kl_estimator=k9",
                   "algorithm.policy_loss=nope", *NO_LAUNCH])
    err, _ = _problems(capsys)
    assert rc == 2 and "algorithm.kl_estimator='k9'" in err and "algorithm.policy_loss='nope'" in err
    assert not dist.is_initialized()


# one bad value per field; each must be named (by its key) in the one message
BAD_FIELDS = {
    "model.dtype": "float16", "model.spec": "turbo", "parallel.tp": "0", "parallel.world_size": "0",
    "optim.lr": "-1", "optim.min_lr": "1.0", "optim.weight_decay": "-0.1", "optim.adam_beta1": "1.5",
    "optim.adam_beta2": "-0.1", "optim.adam_eps": "0", "optim.clip_grad": "-1", "optim.lr_warmup_steps": "-1",
    "optim.lr_decay_style": "linear",
    "train.micro_batch_size": "0", "train.max_tokens_per_microbatch": "0", "train.steps": "0",
    "train.recompute_granularity": "selective",
    "algorithm.advantage": "ppo_gae", "algorithm.policy_loss": "foo", "algorithm.off_policy": "bar",
    "algorithm.old_logprobs": "x", "algorithm.kl_coef": "-1", "algorithm.temperature": "0",
    "algorithm.max_len_norm": "0",
    "rollout.num_servers": "0", "rollout.prompts_per_step": "0", "rollout.max_tokens": "0",
    "rollout.temperature": "-1", "rollout.top_p": "0", "rollout.max_model_len": "0", "rollout.kv_cache_gib": "0",
    "rollout.dtype": "fp9", "rollout.startup_timeout_s": "0", "rollout.request_deadline_s": "0",
    "rollout.max_step_retries": "-1", "rollout.max_concurrency": "0", "rollout.sleep_level": "3",
    "rollout.weight_transport": "rdma",
    "data.synthetic": "sudoku", "data.synthetic_size": "0", "data.max_prompt_len": "0", "data.reward": "nope",
    "data.reward_timeout_s": "0", "data.reward_workers": "0",
    "checkpoint.every_n_steps": "-1", "checkpoint.keep_last": "-1", "checkpoint.resume": "/no/such/step_000001",
    "checkpoint.hf_export_every_n_steps": "-1", "placement": "remote", "output_dir": "''",
}


def test_every_field_is_checked_and_all_problems_come_in_one_message(tiny_qwen3_moe, capsys):
    rc = cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}",
                   *[f"{k}={v}" for k, v in BAD_FIELDS.items()],
                   "algorithm.reduction=seq_mean_token_sum_norm", "algorithm.use_reference=false",
                   "algorithm.ref_routing_replay=true", "+data.reward_by_source.math=nope2"])
    err, _ = _problems(capsys)
    assert rc == 2
    missing = [k for k in BAD_FIELDS if k not in err]
    assert not missing, (missing, err)
    assert "algorithm.ref_routing_replay" in err and "data.reward_by_source.math='nope2'" in err
    assert _count(err) > len(BAD_FIELDS) and err.count("invalid config") == 1  # all of them, in one message
    assert "Traceback" not in err


def test_options_must_be_options_of_the_registered_function(tiny_qwen3_moe, capsys):
    """*_kwargs go to the chosen estimator / loss / correction: a misspelt option is named."""
    rc = cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", "algorithm.off_policy=tis",
                   "+algorithm.policy_loss_kwargs.eps_low=0.1", "+algorithm.policy_loss_kwargs.eps_lo=0.1",
                   "+algorithm.advantage_kwargs.epsilon=1e-6", "+algorithm.advantage_kwargs.norm=true",
                   "+algorithm.off_policy_kwargs.cap=3.0", "+algorithm.off_policy_kwargs.capp=3.0"])
    err, _ = _problems(capsys)
    assert rc == 2 and _count(err) == 3, err  # the three misspelt options, not the good ones
    assert "algorithm.policy_loss_kwargs.eps_lo:" in err and "algorithm.advantage_kwargs.norm:" in err
    assert "algorithm.off_policy_kwargs.capp:" in err
    assert cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}",
                     "+algorithm.policy_loss_kwargs.eps_high=0.3"]) == 0


def test_training_needs_data(tiny_qwen3_moe, tmp_path, capsys):
    assert cli.main(["validate", f"model.path={tiny_qwen3_moe}"]) == 2  # no recipe: schema defaults
    assert "data.train_path is missing" in capsys.readouterr().err
    missing = tmp_path / "none.jsonl"
    assert cli.main(["validate", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", f"data.train_path={missing}",
                     "data.synthetic=null"]) == 2
    assert f"data.train_path={str(missing)!r} does not exist" in capsys.readouterr().err


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_external_engine_urls_must_be_well_formed_and_reachable(tiny_qwen3_moe, health_server, capsys):
    base = ["--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", "placement=disaggregated"]
    assert cli.main(["validate", *base, f"rollout.external_urls=[{health_server}]"]) == 0
    assert "config OK" in capsys.readouterr().out
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    rc = cli.main(["train", *base, f"rollout.external_urls=[{health_server},{dead},ftp://host:1,http://]",
                   *NO_LAUNCH])
    err, _ = _problems(capsys)
    assert rc == 2 and _count(err) == 3, err  # the dead engine and the two malformed URLs
    assert err.count(dead) == 1 and f"the engine at {dead} is not reachable" in err
    assert "'ftp://host:1'" in err and "'http://'" in err
    assert health_server + " " not in err and f"{health_server}'" not in err  # the live one is fine
    assert cli.main(["validate", *base, f"rollout.external_urls=[{dead}]"]) == 2
    err, lines = _problems(capsys)
    assert len(lines) == 1 and dead in lines[0], err  # alone, the problem is one line


@pytest.mark.parametrize("family, size, bridge, recipe", [
    ("nemotron3", "30b_a3b", "nemotron_h", "nemotron3/nano_30b_a3b"),  # EP=8 divides 128 experts
    ("qwen3_5_moe", "35b_a3b", "qwen3_5_moe", "qwen3_5_moe/35b_a3b"),  # EP=8 divides 256 experts
])
def test_large_recipe_validates_on_its_shapes(family, size, bridge, recipe, tmp_path, capsys):
    """An 8-GPU recipe against a config-only checkpoint of the real model's shapes: its
    parallelism fits the model and the bridge maps the config (nothing refused)."""
    import importlib

    from skyrl_mega.models.tiny import FAMILIES, SIZES, make_tiny

    unsupported = importlib.import_module(f"bridges.{bridge}").unsupported
    assert unsupported(FAMILIES[family].make_config(**SIZES[(family, size)])) == []
    model = make_tiny(family, str(tmp_path / size), size=size, weights=False, dtype="bfloat16")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    assert cli.main(["validate", "--recipe", recipe, f"model.path={model}",
                     f"data.train_path={prompts}"]) == 0
    assert "config OK for world size 8" in capsys.readouterr().out


def test_a_bad_dist_backend_is_one_line_before_any_rank(tiny_qwen3_moe, capsys, monkeypatch):
    """SKYRL_DIST_BACKEND is read by every rank; a bad value is refused by the launching process."""
    monkeypatch.setenv("SKYRL_DIST_BACKEND", "mpi")
    rc = cli.main(["train", "--recipe", RECIPE, f"model.path={tiny_qwen3_moe}", *NO_LAUNCH])
    err, lines = _problems(capsys)
    assert rc == 2, err
    assert "SKYRL_DIST_BACKEND='mpi': use nccl or gloo" in err and "Traceback" not in err
