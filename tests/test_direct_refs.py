"""The IPC layout's cached direct tensors (export.BucketExporter._direct_experts, plan.DirectRefs).

On a plan's later syncs the exporter hands out each expert bucket's direct tensors from a cache
without looking them up (thousands of tensors, a microsecond each before the first round can
leave), and checks after the last bucket that none of them moved. Reference: the HF checkpoint
the model was built from (fp32: the conversion is exact), and that checkpoint plus the change."""

import json
import os

import torch
from safetensors.torch import load_file

from skyrl_mega.launcher import run_torchrun

WORKER = os.path.join(os.path.dirname(__file__), "workers", "direct_refs_worker.py")


def _checkpoint(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def test_cached_direct_tensors_are_reused_and_a_moved_one_aborts_the_sync(tiny_qwen3_moe, tmp_path):
    run_torchrun(WORKER, 1, [tiny_qwen3_moe, str(tmp_path)], timeout=300)
    rep = json.load(open(tmp_path / "report.json"))
    ref = _checkpoint(tiny_qwen3_moe)
    walks = {k: load_file(str(tmp_path / f"{k}.safetensors")) for k in ("first", "again", "moved", "rebuilt")}
    for k in ("first", "again"):
        assert sorted(walks[k]) == sorted(ref), k
        assert all(torch.equal(walks[k][n], ref[n]) for n in ref), k
    # the expert buckets' direct lists: keyed, the same objects on the unchanged walk
    experts = [r for r in rep["first"]["refs"] if r[0] == "experts"]
    assert experts and all(r[2] is not None and r[3] > 0 for r in experts)
    assert [r for r in rep["again"]["refs"] if r[0] == "experts"] == experts
    assert not rep["first"]["stale"] and not rep["again"]["stale"]
    # a parameter moved (same shape and dtype): only its address changed; the sync must not commit
    assert rep["moved"]["stale"], rep["moved"]
    # after the rebuild: new keys, and the moved expert's tensors read from where it is now
    new = [r for r in rep["rebuilt"]["refs"] if r[0] == "experts"]
    assert not rep["rebuilt"]["stale"] and rep["rebuilt"]["rebuilds"] == rep["first"]["rebuilds"] + 1
    assert not {r[2][2] for r in new} & {r[2][2] for r in experts}
    changed = sorted(n for n in ref if not torch.equal(walks["rebuilt"][n], ref[n]))
    layer, expert = rep["moved_param"].split(".layers.")[1].split(".")[0], rep["moved_param"].split(
        ".local_experts.")[1].split(".")[0]
    assert changed and all(f"layers.{layer}.mlp.experts.{expert}." in n for n in changed), (changed, rep["moved_param"])
    assert all(torch.equal(walks["rebuilt"][n], ref[n] + 1.0) for n in changed)
