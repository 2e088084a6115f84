"""RL train-step settings are checked by the one config validator (before any rank starts),
and the RL batch checks itself (no process group)."""

import pytest
import torch

from skyrl_mega.config import ConfigError, load_config, validate_config
from skyrl_mega.megatron.train_step import RLBatch


def test_defaults_are_valid(tiny_qwen3_moe):
    validate_config(load_config(None, [f"model.path={tiny_qwen3_moe}"]))
    validate_config(load_config(None, [f"model.path={tiny_qwen3_moe}", "algorithm.policy_loss=gspo",
                                       "algorithm.off_policy=mis", "algorithm.reduction=seq_mean_token_sum_norm",
                                       "algorithm.max_len_norm=512", "train.recompute_granularity=full"]))


def test_every_problem_is_listed(tiny_qwen3_moe):
    cfg = load_config(None, [f"model.path={tiny_qwen3_moe}", "algorithm.policy_loss=foo",
                             "algorithm.reduction=seq_mean_token_sum_norm", "algorithm.off_policy=bar",
                             "algorithm.kl_estimator=k9", "algorithm.old_logprobs=x", "algorithm.temperature=0",
                             "algorithm.ref_routing_replay=true", "parallel.cp=2", "train.packing=false",
                             "train.recompute_granularity=selective"])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, 2)
    msg = str(e.value)
    for key in ("policy_loss='foo'", "max_len_norm", "off_policy='bar'", "kl_estimator='k9'", "old_logprobs='x'",
                "temperature", "use_reference", "packing=true", "recompute_granularity"):
        assert key in msg, key


def test_sequence_level_losses_are_rejected_with_context_parallel(tiny_qwen3_moe):
    for loss in ("algorithm.policy_loss=gspo", "algorithm.off_policy=seq_tis"):
        cfg = load_config(None, [f"model.path={tiny_qwen3_moe}", "parallel.cp=2", loss])
        with pytest.raises(ConfigError, match="sequence-level losses"):
            validate_config(cfg, 2)


def _batch(lengths=(4, 6)):
    ids = [torch.arange(n) for n in lengths]
    return RLBatch(ids, [torch.ones(n) for n in lengths], [torch.ones(1) for _ in lengths],
                   rollout_logprobs=[torch.zeros(n) for n in lengths])


def test_batch_validation_and_select():
    b = _batch()
    b.validate()
    assert b.lengths == [4, 6]
    assert b.select([1]).lengths == [6] and b.select([1]).rollout_logprobs[0].shape == (6,)
    bad = _batch()
    bad.rollout_logprobs[1] = torch.zeros(5)
    with pytest.raises(ValueError, match="sample 1: rollout_logprobs"):
        bad.validate()
    bad = _batch()
    bad.advantages = bad.advantages[:1]
    with pytest.raises(ValueError, match="advantages has 1 entries for 2 samples"):
        bad.validate()
    with pytest.raises(ValueError, match=">= 2 tokens"):
        _batch((1, 3)).validate()
