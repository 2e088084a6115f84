"""Weight sync from Megatron to the rollout engines (bucketing + transports)."""
