"""Registries: user extension in a few lines, clear errors for unknown names."""

from __future__ import annotations

import pytest
import torch

from skyrl_mega import algorithms as alg


@pytest.fixture
def cleanup():
    added: list[tuple[dict, str]] = []
    yield added
    for registry, name in added:
        registry.pop(name, None)


def test_user_registers_advantage_estimator(cleanup):
    cleanup.append((alg.ADVANTAGE_ESTIMATORS, "group_max_baseline"))

    @alg.register_advantage_estimator("group_max_baseline")
    def group_max_baseline(rewards, response_mask, group_index=None, *, group_size=None):
        best = rewards.view(-1, group_size).max(-1, keepdim=True).values
        return (rewards.view(-1, group_size) - best).view(-1)[:, None] * response_mask

    assert alg.get_advantage_estimator("group_max_baseline") is group_max_baseline
    rewards = torch.tensor([0.2, 1.0, 0.5, 0.0])
    out = alg.compute_advantages("group_max_baseline", rewards, torch.ones(4, 2), group_size=2)
    assert out[:, 0].tolist() == pytest.approx([-0.8, 0.0, 0.0, -0.5])


def test_user_registers_policy_loss_and_uses_it(cleanup):
    cleanup.append((alg.POLICY_LOSSES, "vanilla_pg"))

    @alg.register_policy_loss("vanilla_pg")
    def vanilla_pg(logprobs, old_logprobs, advantages, mask, *, scale=1.0):
        return torch.where(mask, -scale * advantages * logprobs, 0.0), {"one": mask.float()}

    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, False]])
    loss, metrics = alg.compute_policy_loss(
        lp, lp.detach(), torch.tensor([[2.0, 2.0]]), mask,
        policy_loss="vanilla_pg", policy_loss_kwargs=dict(scale=3.0), global_num_tokens=1,
    )
    assert loss.item() == 6.0 and metrics["token_sum/pg/one"].item() == 1.0


def test_user_registers_off_policy_and_kl(cleanup):
    cleanup += [(alg.OFF_POLICY_CORRECTIONS, "none"), (alg.KL_ESTIMATORS, "abs")]

    @alg.register_off_policy_correction("none")
    def no_correction(old_logprobs, rollout_logprobs, mask):
        return alg.OffPolicyCorrection(mask.to(old_logprobs.dtype), mask, {})

    @alg.register_kl_estimator("abs")
    def kl_abs(logprobs, ref_logprobs):
        return (logprobs - ref_logprobs).abs()

    assert alg.kl_penalty(torch.tensor([-1.0]), torch.tensor([-3.0]), "abs").item() == 2.0
    assert alg.get_off_policy_correction("none") is no_correction


@pytest.mark.parametrize(
    "getter,kind,known",
    [
        (alg.get_advantage_estimator, "advantage estimator", ["grpo", "grpo_no_std", "maxrl", "reinforce_pp_baseline", "rloo"]),
        (alg.get_policy_loss, "policy loss", ["cispo", "gspo", "ppo"]),
        (alg.get_off_policy_correction, "off-policy correction", ["mis", "seq_tis", "tis"]),
        (alg.get_kl_estimator, "KL estimator", ["k1", "k2", "k3", "kl", "low_var_kl", "mse"]),
    ],
)
def test_unknown_name_lists_choices(getter, kind, known):
    with pytest.raises(ValueError) as err:
        getter("no_such_thing")
    msg = str(err.value)
    assert f"unknown {kind} 'no_such_thing'" in msg
    assert msg.endswith("choices: " + ", ".join(known))


def test_duplicate_registration_needs_override(cleanup):
    cleanup.append((alg.POLICY_LOSSES, "dup"))
    alg.register_policy_loss("dup")(lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        alg.register_policy_loss("dup")(lambda *a: None)
    with pytest.raises(ValueError, match="already registered"):
        alg.register_policy_loss("ppo")(lambda *a: None)

    def replacement(*a):
        return None

    alg.register_policy_loss("dup", override=True)(replacement)
    assert alg.get_policy_loss("dup") is replacement
    with pytest.raises(ValueError, match="non-empty"):
        alg.register_policy_loss("")
    with pytest.raises(TypeError, match="callable"):
        alg.register_policy_loss("x")(42)
