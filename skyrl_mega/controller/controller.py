"""Rank 0's half of the RL loop: prompts, engines, rewards.

In: the config and the policy's bridge (HF config, MoE layer numbers). Out: `Controller`, built
only on global rank 0: the prompt dataset and its resumable sampler, the rollout engines
(engines.py), the reward workers (data/reward_pool.py), and `rollout(step)`, which returns one
step's RLBatch and rollout metrics.
"""

from __future__ import annotations

import os

from ..data.dataset import PromptSampler, load_prompts
from ..data.reward_pool import RewardPool
from ..data.synthetic import write_digits_task
from .engines import RolloutEngines
from .log import log0
from .rollout_batch import build_rl_batch


class Controller:
    """Data, engines, rewards. Built only on rank 0."""

    def __init__(self, cfg, bridge):
        from transformers import AutoTokenizer

        d = cfg.data
        if d.synthetic and not os.path.exists(d.train_path):
            write_digits_task(d.train_path, n=d.synthetic_size, seed=cfg.train.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.items, counts = load_prompts(d.train_path, self.tokenizer, chat_template=d.chat_template,
                                          max_prompt_len=d.max_prompt_len)
        log0(f"dataset {d.train_path}: {counts}")
        self.sampler = PromptSampler(len(self.items), cfg.rollout.prompts_per_step, cfg.train.seed, d.shuffle)
        self.rewards = RewardPool([d.reward, *d.reward_by_source.values()], workers=d.reward_workers,
                                  timeout_s=d.reward_timeout_s, log=log0)
        self.rewards.start()
        hf = bridge.hf_config.get_text_config()  # a vision-language checkpoint: its text model's
        # the expert count from megatron's config: HF names it per family (num_experts, n_routed_experts)
        self.engines = RolloutEngines(cfg, bridge.moe_layers, hf.num_hidden_layers,
                                      bridge.config.num_moe_experts or 0)
        self.cfg = cfg

    def rollout(self, step: int):
        items = [self.items[i] for i in self.sampler.next_batch()]
        rollouts = self.engines.generate([it.prompt_ids for it in items], step)
        return build_rl_batch(self.cfg, self.tokenizer, items, rollouts, self.rewards)

    def trainer_state(self) -> dict:
        """What a checkpoint keeps of the controller: the sampler position."""
        return {"sampler": self.sampler.state()}
