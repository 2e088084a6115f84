"""Homes for the CPU / non-TE kernel stand-ins of the hybrid families (empty: nothing built yet).

In:  nothing today. Out: nothing today. When the Qwen3.5-MoE (gated delta net) and Nemotron 3
(Mamba2) families land, their layers call one entry point per kernel here, each a reference
PyTorch implementation that runs on CPU with the signature of the GPU library it stands in for,
so the `local` spec runs them and the `fast` spec (specs/__init__.py, not built yet) can swap
in fused versions:

  mamba_chunk_scan       Mamba2 chunked selective scan (mamba_ssm's mamba_chunk_scan_combined)
  causal_conv1d          causal depthwise conv1d, full sequence and one-step update
                         (causal_conv1d's causal_conv1d_fn / causal_conv1d_update)
  gated_delta_rule       gated delta rule, chunked and recurrent (fla's chunk_gated_delta_rule /
                         fused_recurrent_gated_delta_rule)
  l2norm                 L2 normalisation over the head dimension (fla's l2norm)
  gated_rmsnorm          RMSNorm with a SiLU gate (mamba_ssm's RMSNormGated)

Each will be tested against its GPU library's output where that library is installed, and
against a plain step-by-step recurrence on CPU.
"""
