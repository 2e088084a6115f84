"""Weight sync on CPU: bucketed export, expert-grouped plan, receivers, verification, abort, vLLM.

Two torchruns (tests/workers/weight_sync_worker.py), one per layout:
- tp2pp2ep2 (8 gloo ranks: TP=2, PP=2, EP=2, ETP=2): bucketed export vs the HF checkpoint
  and mbridge's per-tensor export; the bucket plan; a standalone transformers receiver synced
  over the packed-bucket protocol (gloo) with verification; a corrupted bucket; a sync that
  dies half-way; new parameter tensors on the next sync; the CPU shared-memory transport.
- ep2 (2 ranks, EP=2) against a real vLLM CPU server that runs the "skyrl_bucket"
  weight-transfer backend (registered by the project's vLLM plugin) and is driven through
  vLLM's /init_weight_transfer_engine and, per update, its worker's start / update / finish
  calls through /collective_rpc (one round trip each round); a standalone receiver sits in the
  same transfer group and is compared with the trainer's own (Megatron EP=2) logits; then a
  sync into the engine asleep with its weights woken (colocated), which needs no pause.
(Megatron's forward at TP=2 x ETP=2 needs uneven all_gathers that gloo lacks, so the
tp2pp2ep2 run checks the receiver against transformers on the trainer's exact weights.)
The trainer loads a perturbed copy of the tiny checkpoint; receivers start from the original.
"""

import asyncio
import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega.launcher import run_torchrun

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
WORKER = os.path.join(REPO, "tests/workers/weight_sync_worker.py")


@pytest.fixture(scope="module")
def trainer_ckpt(tiny_qwen3_moe, tmp_path_factory):
    from tests.rollout.hf_reference import perturbed_checkpoint

    d = str(tmp_path_factory.mktemp("trainer_weights"))
    perturbed_checkpoint(tiny_qwen3_moe, d, seed=11)
    return d


@pytest.fixture(scope="module")
def layouts_run(tiny_qwen3_moe, trainer_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("ws_tp2pp2ep2")
    # alltoall dispatch: gloo's allgather cannot take the uneven token counts of TP x EP
    run_torchrun(WORKER, 8, [str(d), "receiver", f"receiver_model={tiny_qwen3_moe}", "dispatcher=alltoall", "--",
                             f"model.path={trainer_ckpt}", "parallel.tp=2", "parallel.pp=2", "parallel.ep=2"],
                 timeout=400, log_file=str(d / "log.txt"))
    return d, json.load(open(d / "results.json"))


def test_bucketed_export_is_bit_exact_at_tp2_pp2_ep2(layouts_run, trainer_ckpt):
    d, _ = layouts_run
    exported = load_file(d / "export.safetensors")
    original = load_file(os.path.join(trainer_ckpt, "model.safetensors"))  # what world size 1 exports
    per_tensor = load_file(d / "mbridge.safetensors")
    assert sorted(exported) == sorted(original) == sorted(per_tensor)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
        assert torch.equal(exported[name], per_tensor[name]), name


def test_plan_puts_every_expert_of_a_layer_in_one_bucket(layouts_run, tiny_qwen3_moe):
    d, _ = layouts_run
    plan = json.load(open(d / "plan.json"))
    cfg = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))
    E, moe_layers = cfg.get("num_experts") or cfg["num_local_experts"], [1, 2, 3]
    where: dict[str, int] = {}
    for i, b in enumerate(plan["wire"]["buckets"]):
        for name, dtype, shape, off, nbytes in b["tensors"]:
            assert name not in where, f"{name} in two buckets"
            where[name] = i
            assert off >= 512 and off + nbytes <= b["nbytes"]
        if b["kind"] == "experts":
            assert all(".mlp.experts." in t[0] for t in b["tensors"])
        else:
            assert not any(".mlp.experts." in t[0] for t in b["tensors"])
            assert b["nbytes"] <= plan["bucket_bytes"] or len(b["tensors"]) == 1
    for layer in moe_layers:
        names = [f"model.layers.{layer}.mlp.experts.{e}.{k}.weight" for e in range(E)
                 for k in ("gate_proj", "up_proj", "down_proj")]
        buckets = {where[n] for n in names}
        assert len(buckets) == 1, (layer, buckets)
        b = plan["wire"]["buckets"][buckets.pop()]
        assert len(b["tensors"]) == 3 * E  # dedicated: that layer's experts only
    assert plan["summary"]["expert_buckets"] == len(moe_layers)
    # bucket order per pipeline stage: dense first when asked (plan.json), experts first by default
    assert plan["first"] == "dense"
    kinds = [b["kind"] for b in plan["wire"]["buckets"]]
    for stage in set(plan["stages"]):
        mine = [k for k, s in zip(kinds, plan["stages"]) if s == stage]
        assert mine == sorted(mine, key=lambda k: k == "experts"), (stage, mine)
        other = [k for k, s in zip(plan["experts_first_kinds"], plan["stages"]) if s == stage]
        assert other == sorted(mine, key=lambda k: k != "experts"), (stage, other)
    assert plan["stages"] == sorted(plan["stages"])
    assert plan["summary"]["buckets"] > plan["summary"]["expert_buckets"] + 2  # dense ones split by size


def _hf_logits(ckpt, scale=None):
    from transformers import AutoModelForCausalLM

    from tests.workers.weight_sync_worker import fixed_ids

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    if scale is not None:  # the worker's second version: every parameter * 1.01, as the trainer did
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone() * scale
    with torch.no_grad():
        return model(fixed_ids()).logits


def test_receiver_holds_the_trainers_weights(layouts_run, trainer_ckpt):
    """After each sync the receiver's logits equal transformers on the trainer's exact weights."""
    d, r = layouts_run
    for v, scale in ((1, None), (4, 1.01)):
        got = load_file(d / f"receiver_v{v}.safetensors")["logits"]
        ref = _hf_logits(trainer_ckpt, scale)
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() < 1e-5, v
    # version 4 = new parameter tensors after version 1: the plan is reused, the data is new
    v1 = load_file(d / "receiver_v1.safetensors")["logits"]
    v4 = load_file(d / "receiver_v4.safetensors")["logits"]
    assert (v1 - v4).abs().max().item() > 1e-2
    # built once, never again: new tensors of the same shapes reuse the plan
    assert r["sync4"]["weight_sync/plan_rebuilds"] == 1
    assert r["report_v1"]["version"] == 1 and r["report_v4"]["version"] == 4 and r["report_v4"]["consistent"]
    # per-tensor checksums of what landed in the receiver equal the sender's
    assert r["report_v1"]["checksum"] == r["sender_digest_v1"]
    assert r["report_v4"]["checksum"] == r["sender_digest_v4"] != r["sender_digest_v1"]
    assert r["sync4"]["weight_sync/stale_retries"] == 0


def test_a_shape_change_on_another_stage_aborts_and_resends_on_a_new_plan(layouts_run, tiny_qwen3_moe):
    """Version 5: the first router of pipeline stage 1 was reshaped (same bytes). Rank 0 cannot see it
    locally; the export's end-of-sync check catches it, the first attempt is aborted before its
    commit, and the second attempt runs on a rebuilt plan that carries the new shape."""
    _, r = layouts_run
    cfg = json.load(open(os.path.join(tiny_qwen3_moe, "config.json")))
    E, h = cfg.get("num_experts") or cfg["num_local_experts"], cfg["hidden_size"]
    assert r["sync5"]["weight_sync/stale_retries"] == 1
    assert r["sync5"]["weight_sync/plan_rebuilds"] == r["sync4"]["weight_sync/plan_rebuilds"] + 1
    shapes = r["router_shapes_v5"]
    assert shapes["model.layers.2.mlp.gate.weight"] == [h, E]  # the first router of stage 1
    assert shapes["model.layers.1.mlp.gate.weight"] == shapes["model.layers.3.mlp.gate.weight"] == [E, h]
    rep = r["report_v5"]
    assert rep["version"] == 5 and rep["consistent"] and rep["checksum"] == r["sender_digest_v5"]


def test_verification_catches_a_corrupted_bucket(layouts_run):
    _, r = layouts_run
    assert r["corrupt_error"] and "checksum mismatch" in r["corrupt_error"]
    rep = r["report_after_corrupt"]
    assert rep["version"] == 1 and rep["consistent"] is False and "mismatch" in rep["last_error"]


def test_sync_dying_half_way_keeps_the_old_version(layouts_run):
    _, r = layouts_run
    assert r["abort_error"] and "injected failure" in r["abort_error"]
    rep = r["report_after_abort"]
    assert rep["version"] == 1 and rep["consistent"] is False and "aborted" in rep["last_error"]


def test_colocated_protocol_commits_aborts_and_resends_a_stale_plan(layouts_run):
    """The CUDA IPC protocol (rounds; on CPU its staging buffer is a /dev/shm file) at TP2 PP2
    EP2: a verified sync commits what the sender checksummed; a sync dying half-way keeps the
    old version; a shape change found after the last bucket (whose round is already posted)
    aborts before the commit and is resent on a new plan, which then commits."""
    _, r = layouts_run
    assert r["ipc_sync11"]["weight_sync/rounds"] > 1
    rep = r["ipc_report_v11"]
    assert rep["version"] == 11 and rep["consistent"] and rep["checksum"] == r["ipc_digest_v11"]
    assert r["ipc_abort_error"] and "injected failure" in r["ipc_abort_error"]
    assert r["ipc_report_after_abort"]["version"] == 11
    assert r["ipc_sync13"]["weight_sync/stale_retries"] == 1
    rep = r["ipc_report_v13"]
    assert rep["version"] == 13 and rep["consistent"] and rep["checksum"] == r["ipc_digest_v13"]
    assert r["ipc_digest_v13"] == r["ipc_digest_v11"]  # the same weights as version 11


def test_shared_memory_transport_through_sync_weights(layouts_run):
    """The CPU transport behind the same sync_weights as the others: one safetensors file per
    bucket, exactly mbridge's per-tensor export at TP2 PP2 EP2, committed, files removed."""
    _, r = layouts_run
    s = r["shm_sync"]
    assert s["names_equal"] and s["unequal"] == []
    assert s["files"] == s["buckets"] > 5
    assert s["calls"] == ["pause", "skyrl_load_weights", "version 21", "resume"]
    assert s["report"] == {"engine": [{"version": 21, "num_tensors": s["tensors"]}]}
    assert s["left"] == []


# -- a real vLLM CPU server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_run(tiny_qwen3_moe, trainer_ckpt, tmp_path_factory):
    from skyrl_mega.rollout.servers import ServerConfig, ServerManager

    logs = str(tmp_path_factory.mktemp("ws_vllm_logs"))
    cfg = ServerConfig(model=tiny_qwen3_moe, dtype="float32", max_model_len=1024, seed=0,
                       extra_args=["--weight-transfer-config", json.dumps({"backend": "skyrl_bucket"})])
    sm = ServerManager(cfg, num_servers=1, log_dir=logs, startup_timeout_s=240, watch_interval_s=1.0)
    sm.start()
    try:
        d = tmp_path_factory.mktemp("ws_ep2_vllm")
        run_torchrun(WORKER, 2, [str(d), "vllm", f"urls={','.join(sm.urls)}", f"receiver_model={tiny_qwen3_moe}", "--",
                                 f"model.path={trainer_ckpt}", "parallel.ep=2"],
                     timeout=300, log_file=str(d / "log.txt"))
        yield sm, d, json.load(open(d / "results.json"))
    finally:
        sm.stop()


@pytest.mark.vllm
def test_vllm_server_updated_through_its_weight_transfer_api(vllm_run, trainer_ckpt, tiny_qwen3_moe):
    from skyrl_mega.rollout.client import RolloutClient, SamplingParams
    from tests.rollout.hf_reference import HFReference, max_abs_diff

    sm, _, r = vllm_run
    url = sm.urls[0]
    # the half-way failure left the engine paused on its old version; the next sync committed 8
    assert r["abort_error"] and "injected failure" in r["abort_error"]
    assert r["after_abort"]["paused"] == {url: True}
    assert r["after_abort"]["versions"] == r["version_before"]
    assert r["after_abort"]["receiver"]["version"] is None
    assert r["after_sync"] == {"versions": {url: "8"}, "paused": {url: False}}
    assert r["sync"]["weight_sync/buckets"] > 5
    # engine asleep with its weights woken (colocated): no pause of the sync's own, still held after
    # it, resumed by waking the KV cache, serving version 9
    assert r["held_before"] and "pause_s" not in r["held_sync"]["timings"], r["held_sync"]
    assert r["held_sync"]["paused"] == {url: True} and r["held_sync"]["versions"] == {url: "9"}
    assert r["after_wake"] == {"paused": {url: False}, "versions": {url: "9"}}

    async def go():
        rng = np.random.default_rng(0)
        ps = [rng.integers(3, 500, size=int(rng.integers(8, 20))).tolist() for _ in range(3)]
        async with RolloutClient(url, deadline_s=120) as c:
            return await c.generate_batch(ps, SamplingParams(max_tokens=16, n=2, seed=5))

    gens = asyncio.run(asyncio.wait_for(go(), 180))
    new, old = HFReference(trainer_ckpt), HFReference(tiny_qwen3_moe)
    worst_new = worst_old = 0.0
    for g in gens:
        for s in g.samples:
            worst_new = max(worst_new, max_abs_diff(s.logprobs, new.score(g.prompt_token_ids, s.token_ids)[0]))
            worst_old = max(worst_old, max_abs_diff(s.logprobs, old.score(g.prompt_token_ids, s.token_ids)[0]))
    assert worst_new < 1e-4, worst_new
    assert worst_old > 1e-2  # the server really moved to the trainer's weights


@pytest.mark.vllm
def test_receiver_logits_equal_ep2_trainer_logits(vllm_run):
    """The standalone receiver in the same transfer group as the vLLM engine vs Megatron EP=2."""
    _, d, r = vllm_run
    got = load_file(d / "receiver_v8.safetensors")["logits"]
    ref = load_file(d / "trainer_v8.safetensors")["logits"]
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4
    assert r["receiver_v8"]["version"] == 8 and r["receiver_v8"]["checksum"] == r["sender_digest"]
