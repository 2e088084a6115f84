"""The controller: rank 0's side of the RL loop, and the collective steps it decides.

    controller.Controller       prompts + sampler, rollout engines, rewards -> RLBatch
    engines.RolloutEngines      vLLM servers + router + sampling; placement.py picks the
                                weight transport and sleep/wake
    rollout_batch               rollouts -> rewards -> advantages -> RLBatch
    batch_transfer              RLBatch rank 0 -> every rank as typed tensors
    steps                       resume, rollout/sync with retries, checkpoints (collective)
    metrics, report             metrics sinks and the end-of-run summary

Data flows one way: controller -> rollout -> algorithms -> megatron -> weight_sync.
"""
