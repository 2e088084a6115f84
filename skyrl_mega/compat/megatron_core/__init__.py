"""megatron-core shims: the registry (`SHIMS`) and CPU_CONFIG here, the code by job beside it.

    cpu.py        `apply_cpu_shims()`: megatron-core on CPU with gloo
    optimizer.py  grad norm, fused AdamW and torch-Adam state around dist-ckpt (no apex / TE)
    gloo_cuda.py  `apply_gloo_cuda_shims()`: ranks on gloo with CUDA (SKYRL_DIST_BACKEND=gloo)

In:  nothing at import (no side effects). `apply_cpu_shims()` once per process before a model is
     built; `apply_optimizer_shims()` before an optimizer is built, `use_fused_torch_adam` after;
     `ensure_optimizer_state(optimizer)` / `restore_adam_steps(optimizer)` around a dist-ckpt
     optimizer load.
Out: megatron-core runs forward / backward / optimizer / dist-ckpt on CPU with gloo, and a
     resumed torch Adam continues with the uninterrupted run's bias correction. Each shim is
     applied only where its guard holds (`SHIMS`: version range read from megatron-core's source,
     plus its run-time condition) and recorded in `skyrl_mega.compat.applied()`.

Version ranges were set from megatron-core 0.16.1 (installed here, identical to tag core_v0.16.1)
and 0.19 (branch core_r0.19.0, what the GPU machines run); "needed >=0.16.1" means the code that
makes it necessary is unchanged in 0.19.
"""

from __future__ import annotations

from ..guard import Shim

_READ = "0.16.1, 0.19 (core_r0.19.0)"
_TEST = "tests/test_compat.py::"
_NO_CUDA = "torch.cuda.is_available() is False"
_TORCH_ADAM = "megatron's distributed optimizer uses torch Adam (distrib_optimizer.HAVE_APEX_OR_TE is False)"

SHIMS = (
    Shim("megatron_core", "cuda_stubs", "megatron-core", ">=0.16.1", _READ,
         "torch.cuda.current_device (the CPU device) / synchronize / Stream / Event / memory / RNG "
         "state that megatron calls unconditionally", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "te_general_gemm", "megatron-core", ">=0.16.1,<0.17", _READ,
         "moe_utils references te_general_gemm without defining it when transformer-engine is "
         "absent (0.17 sets it to None itself)", _TEST + "test_patch_behaviour",
         _NO_CUDA + " and moe_utils has no te_general_gemm"),
    Shim("megatron_core", "gloo_all_to_all", "megatron-core", ">=0.16.1", _READ,
         "the EP token dispatcher passes CPU tensors as all_to_all_single split sizes; gloo "
         "takes only python lists", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "gloo_uneven_all_gather", "megatron-core", ">=0.16.1", _READ,
         "with expert tensor parallelism the alltoall dispatcher all-gathers each TP rank's token "
         "count (output_split_sizes: uneven sizes); gloo's all_gather takes equal sizes only",
         _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "rng_tracker", "megatron-core", ">=0.16.1", _READ,
         "CudaRNGStatesTracker keeps CUDA generator states; on CPU it keeps CPU generator states "
         "(also for dist-ckpt's saved 'cuda' RNG states)", _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "cuda_to_cpu_mode", "megatron-core", ">=0.16.1", _READ,
         "device='cuda' / integer devices / .cuda() in megatron map to CPU, and CPU float tensors "
         "report 'torch.cuda.FloatTensor' for the optimizer's type asserts",
         _TEST + "test_patch_behaviour", _NO_CUDA),
    Shim("megatron_core", "optimizer_state", "megatron-core", ">=0.16.1", _READ,
         "a fresh torch Adam has no state; DistributedOptimizer.sharded_state_dict(is_loading) "
         "asserts one 'step' across its states", "tests/test_compat.py::test_optimizer_state_shims",
         _TORCH_ADAM),
    Shim("megatron_core", "adam_steps", "megatron-core", ">=0.16.1", _READ,
         "after a dist-ckpt load torch Adam's per-parameter 'step' is not the checkpoint's; it is "
         "reset from the param group's step", "tests/test_compat.py::test_optimizer_state_shims",
         _TORCH_ADAM),
    Shim("megatron_core", "foreach_grad_norm", "megatron-core", ">=0.16.1", _READ,
         "without apex / TE, clip_grads falls back to utils.local_multi_tensor_l2_norm, which builds "
         "a host tensor from every gradient's norm (one device sync per parameter tensor, ~1000 a "
         "step on a 64-expert model) and scales gradients one kernel per tensor; clip_grads' "
         "l2_norm_impl / multi_tensor_scale_impl become torch._foreach versions (no sync)",
         _TEST + "test_foreach_grad_norm_equals_megatron_local_norm",
         "clip_grads uses megatron's local fallbacks (no apex / TE)"),
    Shim("megatron_core", "fused_torch_adam", "megatron-core", ">=0.16.1", _READ,
         "without apex / TE, get_megatron_optimizer builds torch AdamW with its default multi-tensor "
         "(foreach) implementation: several passes over parameters, gradients and both moments a "
         "step; the param groups are switched to torch's fused kernel (one pass, same update)",
         _TEST + "test_fused_torch_adam_equals_float64_adam", _TORCH_ADAM),
    Shim("megatron_core", "gloo_cuda_grad_sync", "megatron-core", ">=0.16.1", _READ,
         "DDP's grad sync issues its all-reduces inside torch's _coalescing_manager, which ends in "
         "allreduce_coalesced: gloo has none for CUDA tensors; param_and_grad_buffer's manager issues "
         "each op as it is called instead (synchronous grad sync only)",
         _TEST + "test_gloo_cuda_grad_sync_issues_each_op", "SKYRL_DIST_BACKEND=gloo with CUDA"),
    Shim("megatron_core", "packed_gdn", "megatron-core", ">=0.16.1,<0.18", "0.16.1, 0.19.2",
         "GatedDeltaNet.forward raises NotImplementedError for packed (THD) sequences before 0.18; "
         "the spec builds megatron/gated_delta_net.PackedGatedDeltaNet, a subclass whose forward "
         "takes them", "tests/test_qwen3_5.py::test_packed_equals_unpacked_with_state_reset",
         "a packed (THD) micro-batch reaches a Gated DeltaNet layer"),
)
SHIMS_BY_NAME = {s.name: s for s in SHIMS}
# the CPU shims, in the order apply_cpu_shims applies them
CPU_SHIMS = ("cuda_stubs", "te_general_gemm", "gloo_all_to_all", "gloo_uneven_all_gather", "rng_tracker",
             "cuda_to_cpu_mode")

# megatron-core config for CPU: no fused kernels (they need CUDA, apex or TE) and CPU init
CPU_CONFIG = dict(
    use_cpu_initialization=True,
    gradient_accumulation_fusion=False,
    masked_softmax_fusion=False,
    bias_activation_fusion=False,
    bias_dropout_fusion=False,
    apply_rope_fusion=False,
    persist_layer_norm=False,
    moe_permute_fusion=False,
    moe_router_fusion=False,
    moe_grouped_gemm=False,
    attention_backend="local",
)


# the shims' code, by job (imported after the registry above, which they read)
from .cpu import apply_cpu_shims  # noqa: E402,F401
from .gloo_cuda import apply_gloo_cuda_shims, one_op_at_a_time  # noqa: E402,F401
from .optimizer import (apply_optimizer_shims, ensure_optimizer_state, foreach_l2_norm,  # noqa: E402,F401
                        foreach_scale, restore_adam_steps, use_fused_torch_adam)
