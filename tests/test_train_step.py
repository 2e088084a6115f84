"""RL train step on real torchrun gloo ranks: packing, vocab-parallel logprobs, R3, one update.

One torchrun per layout (world size 1, TP=2 with SP, EP=2, PP=2; and, marked slow, four ranks:
TP=2 x EP=2, PP=2 x EP=2) runs tests/workers/train_step_worker.py on the same 8 mixed-length
samples, each layout's run the first time a selected test needs it. The samples' rollout
logprobs and routed experts come from transformers (float64 logprobs; top-k of the HF router
with the original weights, the engine's L-1 rows), like a rollout engine would report them.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO
from .support.lazy_runs import LazyRuns

pytestmark = pytest.mark.multiprocess
LAYOUTS = {"ws1": (1, []), "tp2": (2, ["parallel.tp=2"]), "ep2": (2, ["parallel.ep=2"]),
           "pp2": (2, ["parallel.pp=2"]),
           # packed rows padded to multiples of 40 tokens (train.pad_packed_to): the same numbers
           "ws1_pad40": (1, ["train.pad_packed_to=40"]),
           # four ranks (slow: `make test-slow`): expert parallel inside tensor / pipeline parallel
           "tp2ep2": (4, ["parallel.tp=2", "parallel.ep=2"]), "pp2ep2": (4, ["parallel.pp=2", "parallel.ep=2"])}
WS4 = ("tp2ep2", "pp2ep2")


def layouts(*names):
    """The named layouts (all by default) as parameters; the four-rank ones marked slow."""
    return [pytest.param(n, marks=pytest.mark.slow) if n in WS4 else n for n in (names or LAYOUTS)]
LENGTHS = [5, 27, 9, 40, 12, 3, 22, 14]
TEMPERATURE = 0.9  # the worker's algorithm.temperature


def make_inputs(model_path, out_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    topk = model.config.num_experts_per_tok
    tensors = {"prompt_lens": torch.tensor([min(3, n - 1) for n in LENGTHS]),
               "advantages": torch.randn(len(LENGTHS), generator=g)}
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 500, (n,), generator=g)
        with torch.no_grad():
            out = model(ids[None], output_router_logits=True)
        logp = torch.log_softmax(out.logits[0].double() / TEMPERATURE, -1)[:-1]
        lp = torch.cat([torch.zeros(1, dtype=torch.float64), logp.gather(-1, ids[1:, None])[:, 0]])
        routes = torch.stack([r.topk(topk, -1).indices for r in out.router_logits], 1)  # [n, moe, k]
        tensors[f"ids_{i}"] = ids
        tensors[f"rollout_{i}"] = lp.float()
        tensors[f"routes_{i}"] = routes[:-1].to(torch.uint8).contiguous()  # the engine: no route for the last token
    save_file(tensors, out_file)
    return out_file


@pytest.fixture(scope="module")
def runs(tiny_qwen3_moe, tmp_path_factory):
    """Layout -> its worker run's outputs, each run the first time a test asks for it."""
    inputs = make_inputs(tiny_qwen3_moe, str(tmp_path_factory.mktemp("inputs") / "inputs.safetensors"))

    def run(name):
        nproc, extra = LAYOUTS[name]
        d = tmp_path_factory.mktemp(name)
        run_torchrun(os.path.join(REPO, "tests/workers/train_step_worker.py"), nproc,
                     [str(d), inputs, f"model.path={tiny_qwen3_moe}", *extra],
                     timeout=600, log_file=str(d / "log.txt"))
        return {"dir": d, "checks": json.load(open(d / "checks.json")), "metrics": json.load(open(d / "metrics.json"))}

    return LazyRuns(run, inputs=inputs)


def _logprobs(run, kind):
    t = load_file(run["dir"] / "logprobs.safetensors")
    return [t[f"{kind}_{i}"] for i in range(len(LENGTHS))]


@pytest.mark.parametrize("layout", layouts())
def test_packed_equals_padded_logprobs(runs, layout):
    packed, padded = _logprobs(runs[layout], "packed"), _logprobs(runs[layout], "padded")
    for i, n in enumerate(LENGTHS):
        assert packed[i].shape == (n,)
        assert packed[i][0] == 0
        assert (packed[i] - padded[i]).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", layouts("tp2", "ep2", "pp2", *WS4))
def test_logprobs_equal_world_size_one(runs, layout):
    ref = _logprobs(runs["ws1"], "packed")
    for a, b in zip(_logprobs(runs[layout], "packed"), ref):
        assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", ["ws1", "tp2"])
def test_vocab_parallel_logprobs_match_float64_reference(runs, layout):
    c = runs[layout]["checks"]
    assert c["vocab_parallel_vs_float64_logprob"] < 1e-5
    assert c["vocab_parallel_vs_float64_entropy"] < 1e-5


def test_logprobs_match_transformers(runs):
    """The trainer's logprobs (alignment: token t from position t-1) equal the HF rollout ones."""
    inputs = load_file(runs["inputs"])
    for i, lp in enumerate(_logprobs(runs["ws1"], "packed")):
        assert (lp - inputs[f"rollout_{i}"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("layout", layouts("tp2", "ep2", "pp2", "ws1_pad40", *WS4))
def test_rl_update_matches_world_size_one(runs, layout):
    ref, got = runs["ws1"]["metrics"], runs[layout]["metrics"]
    if layout == "ws1_pad40":  # the rows were padded: more positions, each row a multiple of 40
        assert got["tokens/padded"] > ref["tokens/padded"] and got["tokens/padded"] % 40 == 0, got["tokens/padded"]
    for key in ("loss", "pg_loss", "kl", "entropy", "pg_clipfrac", "logprob_diff_mean", "grad_norm"):
        assert abs(got[key] - ref[key]) < 1e-5, (key, got[key], ref[key])
    assert got["tokens/response"] == ref["tokens/response"]
    final_ref = load_file(runs["ws1"]["dir"] / "final.safetensors")
    final = load_file(runs[layout]["dir"] / "final.safetensors")
    for k in final_ref:
        assert (final[k] - final_ref[k]).abs().max().item() < 1e-5, k


def test_rl_update_moves_weights_and_reports(runs, tiny_qwen3_moe):
    m = runs["ws1"]["metrics"]
    start = load_file(os.path.join(tiny_qwen3_moe, "model.safetensors"))
    final = load_file(runs["ws1"]["dir"] / "final.safetensors")
    assert max((final[k] - start[k]).abs().max().item() for k in start) > 1e-4
    assert m["skipped"] == 0 and m["grad_norm"] > 0 and m["kl"] >= 0 and m["entropy"] > 0
    assert 0 <= m["pg_clipfrac"] <= 1
    assert m["logprob_diff_mean"] < 1e-5 and m["logprob_diff_max"] < 1e-4  # rollout = HF logprobs
    assert m["tokens/response"] == sum(n - min(3, n - 1) for n in LENGTHS)
    # the engine's L-1 rows cover every token whose routing reaches the loss
    assert m["r3/coverage"] == 1.0


@pytest.mark.parametrize("layout", layouts())
def test_nonfinite_loss_skips_update(runs, layout):
    c = runs[layout]["checks"]
    assert c["nan_skipped"] == 1.0
    assert c["nan_weights_changed"] == 0.0


def test_token_mean_gradient_is_split_invariant(runs):
    c = runs["ws1"]["checks"]
    assert c["num_microbatches_1x8"] == 1 and c["num_microbatches_4x2"] == 4
    assert c["grad_norm_1x8"] > 0
    assert c["grad_diff_4x2"] < 1e-6 * max(1.0, c["grad_norm_1x8"])
    assert c["grad_diff_pad_4x2"] < 1e-6 * max(1.0, c["grad_norm_1x8"])


@pytest.mark.parametrize("layout", layouts())
def test_recompute_replays_the_same_routes(runs, layout):
    """Full activation recompute + R3: the backward recompute pops REPLAY_BACKWARD routes and the
    gradients equal the ones without recompute."""
    c = runs[layout]["checks"]
    n_mb = c["num_microbatches_4x2"]
    assert all(calls == 2 * n_mb for calls in c["recompute_router_calls_per_layer"])
    assert c["grad_diff_recompute"] < 1e-6 * max(1.0, c["grad_norm_1x8"])


@pytest.mark.parametrize("layout", layouts())
def test_r3_replays_recorded_routing(runs, layout):
    c = runs[layout]["checks"]
    moe_layers = 3
    assert c["r3_checked"] == moe_layers * sum(n - 1 for n in LENGTHS)  # every routed token, every layer
    assert c["r3_replay_mismatch"] == 0
    assert c["r3_live_mismatch"] > 0  # the perturbed router alone routes differently
    if layout.startswith("tp2"):  # sequences padded to a multiple of TP: padding rows got distinct valid experts
        assert c["r3_pad_rows"] > 0
    assert c["r3_min_router_grad_norm"] > 0  # routers still receive gradients under replay
    assert c["global_replay_instances_after_attach"] == 0
