"""Several optimizer updates per rollout batch (train.mini_batches x train.epochs): old logprobs
once for the batch, then one update per mini-batch. One mini-batch and one epoch is today's train
step exactly; k mini-batches are k sequential steps on those slices (with the rollout's old
logprobs both see the same ratio's denominator); real torchrun ranks at EP=2 (DP=2)."""

import json
import os

import pytest

from skyrl_mega.launcher import run_torchrun
from skyrl_mega.megatron.batch import RLBatch
from skyrl_mega.megatron.packing import mini_batches

from .conftest import REPO


def test_mini_batches_are_whole_samples_in_order():
    import torch

    batch = RLBatch([torch.arange(n + 2) for n in range(10)], [torch.ones(n + 2) for n in range(10)],
                    [torch.zeros(1)] * 10)
    parts = mini_batches(batch, 3)
    assert [len(p) for p in parts] == [3, 3, 4]
    assert [int(x.numel()) for p in parts for x in p.input_ids] == [n + 2 for n in range(10)]
    with pytest.raises(ValueError):
        mini_batches(batch, 11)


@pytest.mark.multiprocess
def test_updates_per_batch_match_plain_steps(tiny_qwen3_moe, tmp_path):
    out = str(tmp_path / "res.json")
    run_torchrun(os.path.join(REPO, "tests/workers/minibatch_worker.py"), 2, [tiny_qwen3_moe, out, "parallel.ep=2"],
                 timeout=600)
    res = json.load(open(out))
    assert res["one_vs_step"] == 0.0, res  # the same computation: bit for bit
    assert res["two_vs_sequential"] == 0.0, res
    assert res["moved"] > 1e-3 and res["one_vs_two"] > 1e-4 and res["epochs"] > 1e-4, res
    assert res["updates"] == [1.0, 2.0, 4.0]
    assert res["schedule_steps"] == [1, 1, 1]  # the LR schedule counts rollout batches, not updates
    assert all(0.0 <= c <= 1.0 for c in res["clipfrac_first_last"]), res


def test_mini_batches_validated(tiny_qwen3_moe, tmp_path, capsys):
    from skyrl_mega import cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    base = ["validate", "--recipe", "qwen3_moe/tiny_cpu", f"model.path={tiny_qwen3_moe}", f"data.train_path={prompts}",
            "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4"]
    assert cli.main([*base, "train.mini_batches=4"]) == 0  # 8 samples, 2 a mini-batch, DP=2
    capsys.readouterr()
    assert cli.main([*base, "train.mini_batches=8"]) == 2
    err = capsys.readouterr().err
    assert "train.mini_batches=8: a mini-batch of 1 samples leaves some of the 2 data-parallel ranks" in err, err
    assert cli.main([*base, "train.mini_batches=9"]) == 2
    assert "more than the 8 samples" in capsys.readouterr().err
    assert cli.main([*base, "train.epochs=0"]) == 2
