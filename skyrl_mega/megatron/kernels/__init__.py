"""Kernel entry points: plain-PyTorch stand-ins for the hybrid families' GPU kernels, and the
fast spec's wrappers of torch's fused kernels; one module per kernel family.

In:  the arguments of the GPU library entry point each stands in for (same names, layouts and
     defaults). Out: the same results, computed on any device (float32 math; float64 stays
     float64), with autograd for the backward.

Built (Nemotron 3 / Mamba2), served under mamba_ssm's and causal_conv1d's module names by
skyrl_mega/compat/mamba_ssm.py where those packages are absent, so megatron's own MambaMixer runs:
  ssd.py            mamba_chunk_scan_combined, mamba_split_conv1d_scan_combined, selective_state_update
  conv1d.py         causal_conv1d_fn, causal_conv1d_update, causal_conv1d_varlen_states
  gated_rmsnorm.py  gated_rmsnorm (rmsnorm_fn) and its module RMSNorm (layernorm_gated.RMSNorm)
Tested against float64 step-by-step references and transformers' torch path
(tests/test_kernels_mamba.py).

Built (Qwen3.5-MoE / Gated DeltaNet), served under fla's module names (fla.modules.l2norm,
fla.ops.gated_delta_rule) by skyrl_mega/compat/fla.py where flash-linear-attention is absent, so
megatron's own GatedDeltaNet runs:
  gated_delta_rule.py  chunk_gated_delta_rule (chunked), fused_recurrent_gated_delta_rule (token by
                       token), l2norm; fla 0.5.2's API: GVA, packed sequences (cu_seqlens), initial /
                       final states
Tested against a float64 step-by-step reference and transformers' torch path
(tests/test_kernels_gdn.py).

Wrappers of torch's own fused kernels for the fast layer spec (specs/fast.py), each with the check
of where it runs (the callers keep the local math elsewhere):
  grouped_mm.py        grouped GEMM for the MoE experts (torch grouped_mm / _grouped_mm)
  varlen_attention.py  causal varlen flash attention over a packed row (torch.nn.attention.varlen;
                       CUDA, fp16 / bf16; its signature differences across torch releases)
  fused.py             RMSNorm, SwiGLU x routing prob and RoPE as one torch.compile kernel each
                       (on CUDA by default; the eager formula elsewhere)
Tested in tests/test_fast_spec.py (CPU) and tests/test_fast_spec_gpu.py (CUDA).
"""
