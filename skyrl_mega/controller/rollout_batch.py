"""Rollouts -> rewards -> advantages -> RLBatch, on the controller.

In: the step's PromptItems and their PromptSamples from the engines, a tokenizer, the config,
the controller's RewardPool (rewards run there, each call with a time limit).
Out: an RLBatch (one entry per sample; prompt+response tokens, response mask, engine
logprobs, scalar advantages, MoE routes) and rollout metrics (reward, reward calls that failed
or timed out and scored 0, lengths, truncation).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from ..algorithms import compute_advantages
from ..data.reward_pool import RewardCall, RewardPool
from ..megatron.train_step import RLBatch


def score(cfg, tokenizer, items, rollouts, pool: RewardPool) -> tuple[torch.Tensor, list[str], dict]:
    """Rewards of every sample (0 where the call failed or timed out: counted in the metrics)."""
    calls, texts = [], []
    for item, ro in zip(items, rollouts):
        name = cfg.data.reward_by_source.get(item.data_source, cfg.data.reward)
        for s in ro.samples:
            text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
            calls.append(RewardCall(name, text, item.ground_truth, item.meta))
            texts.append(text)
    res = pool.score(calls)
    metrics = {"reward/errors": float(res.errors), "reward/timeouts": float(res.timeouts)}
    return torch.tensor(res.rewards, dtype=torch.float32), texts, metrics


def build_rl_batch(cfg, tokenizer, items, rollouts, pool: RewardPool) -> tuple[RLBatch, dict, list[str]]:
    rewards, texts, reward_metrics = score(cfg, tokenizer, items, rollouts, pool)
    n = cfg.rollout.n_samples_per_prompt
    groups = torch.arange(len(items)).repeat_interleave(n)
    adv = compute_advantages(cfg.algorithm.advantage, rewards, torch.ones(len(rewards), 1), groups,
                             **dict(cfg.algorithm.advantage_kwargs))[:, 0]
    ids, masks, logps, routes, resp_lens, truncated = [], [], [], [], [], 0
    for ro in rollouts:
        p = len(ro.prompt_ids)
        for s in ro.samples:
            r = len(s.token_ids)
            ids.append(torch.tensor(ro.prompt_ids + s.token_ids, dtype=torch.long))
            mask = torch.zeros(p + r)
            mask[p:] = 1
            masks.append(mask)
            lp = torch.zeros(p + r)
            lp[p:] = torch.tensor(s.logprobs, dtype=torch.float32)
            logps.append(lp)
            routes.append(None if s.routed_experts is None else torch.from_numpy(s.routed_experts.astype(np.int64)))
            resp_lens.append(r)
            truncated += s.finish_reason == "length"
    batch = RLBatch(input_ids=ids, response_mask=masks, advantages=list(adv.view(-1, 1).unbind(0)),
                    rollout_logprobs=logps,
                    routed_experts=routes if cfg.algorithm.routing_replay else None)
    by_source = defaultdict(list)
    k = 0
    for item in items:
        by_source[item.data_source] += rewards[k:k + n].tolist()
        k += n
    metrics = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std().item() if len(rewards) > 1 else 0.0,
               "response_length/mean": float(np.mean(resp_lens)), "response_length/max": float(max(resp_lens)),
               "response/truncated_frac": truncated / len(resp_lens), "rollout/samples": float(len(resp_lens))}
    metrics.update({f"reward/{src}": float(np.mean(v)) for src, v in by_source.items()})
    metrics.update(reward_metrics)
    return batch, metrics, texts
