"""Nemotron 3 (NemotronH: Mamba2 + attention + MoE): HF <-> Megatron names, declarative, on
mbridge's LLMBridge machinery (its loading, TP scatter, and PP / EP / TP gathering on export).

In:  an HF NemotronH config (`hybrid_override_pattern` M / * / - / E, one symbol a layer).
Out: megatron's hybrid model on the local hybrid spec (megatron/hybrid_model.py) and the name map:
  M  layers.N.norm.weight                    <- backbone.layers.N.norm.weight
     layers.N.mixer.{in_proj.weight, conv1d.weight|conv1d_weight, conv1d.bias|conv1d_bias,
                     A_log, D, dt_bias, norm.weight, out_proj.weight}
                                             <- backbone.layers.N.mixer.<the HF name>
  *  input_layernorm / linear_qkv / linear_proj <- norm / q,k,v_proj / o_proj
  -  pre_mlp_layernorm / mlp.linear_fc1 / fc2  <- norm / mixer.up_proj / mixer.down_proj
  E  pre_mlp_layernorm, mlp.router.weight / .expert_bias <- norm, mixer.gate.weight /
     .e_score_correction_bias; experts' fc1 / fc2 <- mixer.experts.E.up_proj / down_proj (no
     gate: squared ReLU); shared experts likewise
Tensor parallelism splits `in_proj` ([z | x | B | C | dt]) and `conv1d` ([x | B | C]) part by part
(each rank holds its slice of every part), the per-head and per-channel vectors in order.
What megatron cannot express is refused by `unsupported()` with the reason (one line each).
Multi-token-prediction layers (`num_nextn_predict_layers`, tensors `mtp.*`) are carried, not
built: RL trains the main model, and every HF checkpoint written from it (convert, the trainer's
HF saves) holds the source checkpoint's MTP tensors unchanged (ModelBridge.carried); vLLM serves
the model without them unless speculative decoding is asked for.
"""

from __future__ import annotations

import re

from mbridge.core.llm_bridge import LLMBridge

from skyrl_mega.compat.mbridge import LocalSpecMixin

from .checkpoint_io import ReadsEitherExpertLayout
from .tp_parts import FusedPartsTP

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.linear_fc([12])\.weight(\d+)$")
HF = "backbone.layers.{n}."
# megatron name (after decoder.layers.N.) -> HF names (after backbone.layers.N.)
LAYER_NAMES = {
    # Mamba2 (M); megatron-core 0.19 keeps conv1d as two raw parameters
    "norm.weight": ["norm.weight"],
    "mixer.in_proj.weight": ["mixer.in_proj.weight"],
    "mixer.conv1d.weight": ["mixer.conv1d.weight"],
    "mixer.conv1d.bias": ["mixer.conv1d.bias"],
    "mixer.conv1d_weight": ["mixer.conv1d.weight"],
    "mixer.conv1d_bias": ["mixer.conv1d.bias"],
    "mixer.A_log": ["mixer.A_log"],
    "mixer.D": ["mixer.D"],
    "mixer.dt_bias": ["mixer.dt_bias"],
    "mixer.norm.weight": ["mixer.norm.weight"],
    "mixer.out_proj.weight": ["mixer.out_proj.weight"],
    # attention (*): LocalSpecMixin names the local input norm by its TE-fused name
    "self_attention.linear_qkv.layer_norm_weight": ["norm.weight"],
    "self_attention.linear_qkv.weight": ["mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.v_proj.weight"],
    "self_attention.linear_proj.weight": ["mixer.o_proj.weight"],
    # dense MLP (-) and MoE (E)
    "pre_mlp_layernorm.weight": ["norm.weight"],
    "mlp.linear_fc1.weight": ["mixer.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mixer.down_proj.weight"],
    "mlp.router.weight": ["mixer.gate.weight"],
    "mlp.router.expert_bias": ["mixer.gate.e_score_correction_bias"],
    "mlp.shared_experts.linear_fc1.weight": ["mixer.shared_experts.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mixer.shared_experts.down_proj.weight"],
}
EXPERT_NAMES = {"1": "mixer.experts.{e}.up_proj.weight", "2": "mixer.experts.{e}.down_proj.weight"}
# the Mamba mixer's per-channel / per-head tensors: TP-split along dim 0 in order
_MIXER_VECTORS = ("mixer.A_log", "mixer.D", "mixer.dt_bias", "mixer.norm.weight")
MIXER_NORM_EPS = 1e-5  # megatron-core builds the mixer's gated RMSNorm with this eps (0.16 and 0.19)


def layer_pattern(hf_config) -> str:
    """The megatron layer pattern (M / * / - / E) of an HF NemotronH config."""
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if not pattern:
        kinds = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*",
                 "mlp": "-", "moe": "E"}
        pattern = "".join(kinds[k] for k in hf_config.layers_block_type)
    return pattern


def unsupported(hf) -> list[str]:
    """What of this HF config the megatron build would get wrong; each entry says why."""
    problems = []
    if getattr(hf, "moe_latent_size", None) is not None:
        problems.append(f"moe_latent_size={hf.moe_latent_size}: latent MoE projections are not mapped yet")
    for key in ("attention_bias", "mlp_bias", "mamba_proj_bias"):
        if getattr(hf, key, False):
            problems.append(f"{key}=True: megatron's NemotronH build has no such bias")
    if not getattr(hf, "use_conv_bias", True):
        problems.append("use_conv_bias=False: megatron's Mamba mixer always has a conv1d bias")
    if getattr(hf, "mamba_hidden_act", "silu") != "silu":
        problems.append(f"mamba_hidden_act={hf.mamba_hidden_act!r}: megatron's Mamba mixer uses silu")
    if getattr(hf, "mlp_hidden_act", "relu2") != "relu2":
        problems.append(f"mlp_hidden_act={hf.mlp_hidden_act!r}: only relu2 (squared ReLU) is mapped")
    if getattr(hf, "conv_kernel", 4) != 4:
        problems.append(f"conv_kernel={hf.conv_kernel}: megatron's Mamba mixer builds a width-4 conv")
    if "E" in layer_pattern(hf):
        if not getattr(hf, "norm_topk_prob", True) and hf.num_experts_per_tok > 1:
            problems.append("norm_topk_prob=False: megatron's sigmoid router always normalises the top-k")
        groups = getattr(hf, "n_group", 1) or 1
        if groups > 1 and hf.num_experts_per_tok // (getattr(hf, "topk_group", 1) or 1) != 2:
            problems.append(f"n_group={groups}: HF scores a group by its top 2 experts, megatron by its top "
                            "num_experts_per_tok // topk_group; they agree only when that is 2")
    if "M" in layer_pattern(hf) and abs(hf.layer_norm_epsilon - MIXER_NORM_EPS) > 1e-12:
        problems.append(f"layer_norm_epsilon={hf.layer_norm_epsilon}: megatron's Mamba mixer norm uses {MIXER_NORM_EPS}")
    return problems


class NemotronHBridge(ReadsEitherExpertLayout, LocalSpecMixin, FusedPartsTP, LLMBridge):
    TP_VECTORS = _MIXER_VECTORS
    CARRIED_PREFIXES = ("mtp.",)
    _CONFIG_MAPPING = {
        "num_layers": "num_hidden_layers",
        "hidden_size": "hidden_size",
        "num_attention_heads": "num_attention_heads",
        "num_query_groups": "num_key_value_heads",
        "ffn_hidden_size": "intermediate_size",
        "attention_dropout": "attention_dropout",
        "hidden_dropout": ("hidden_dropout", 0.0),
        "layernorm_epsilon": "layer_norm_epsilon",
        "kv_channels": ("head_dim", None),
    }
    _DIRECT_MAPPING = {
        "embedding.word_embeddings.weight": "backbone.embeddings.weight",
        "decoder.final_norm.weight": "backbone.norm_f.weight",
        "output_layer.weight": "lm_head.weight",
    }

    def _build_config(self):
        from megatron.core.activations import squared_relu

        hf = self.hf_config
        problems = unsupported(hf)
        if problems:
            raise ValueError(f"NemotronH config not supported: {'; '.join(problems)}")
        self.pattern = layer_pattern(hf)
        moe = {}
        if "E" in self.pattern:
            groups = getattr(hf, "n_group", 1) or 1
            moe = dict(
                num_moe_experts=hf.n_routed_experts,
                moe_router_topk=hf.num_experts_per_tok,
                moe_ffn_hidden_size=hf.moe_intermediate_size,
                moe_shared_expert_intermediate_size=hf.moe_shared_expert_intermediate_size * hf.n_shared_experts
                if hf.n_shared_experts else None,
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=0.0,  # RL keeps the score-correction bias as loaded
                moe_router_topk_scaling_factor=hf.routed_scaling_factor,
                moe_router_num_groups=groups if groups > 1 else None,
                moe_router_group_topk=hf.topk_group if groups > 1 else None,
                moe_router_dtype="fp32",  # HF routes in fp32 (gate weight and bias kept fp32)
                moe_router_load_balancing_type="none",
                moe_aux_loss_coeff=0.0,
            )
        return self._build_base_config(
            activation_func=squared_relu,
            gated_linear_unit=False,
            add_bias_linear=False,
            mamba_state_dim=hf.ssm_state_size,
            mamba_head_dim=hf.mamba_head_dim,
            mamba_num_groups=hf.n_groups,
            mamba_num_heads=hf.mamba_num_heads,
            use_mamba_mem_eff_path=True,  # the fused path: the only one megatron runs packed sequences on
            **moe,
        )

    @property
    def moe_layer_numbers(self) -> list[int]:
        return [i for i, s in enumerate(self.pattern) if s == "E"]

    def _model_provider(self, post_model_creation_callbacks):
        from skyrl_mega.megatron.hybrid_model import build_hybrid_model

        tied = bool(getattr(self.hf_config, "tie_word_embeddings", False))

        def provider(pre_process, post_process, vp_stage=None):
            self.vocab_size = self.padded_vocab_size = self.hf_config.vocab_size
            model = build_hybrid_model(
                self.config, self.pattern, vocab_size=self.hf_config.vocab_size,
                max_sequence_length=self.hf_config.max_position_embeddings, pre_process=pre_process,
                post_process=post_process, routing_replay=self.routing_replay,
                share_embeddings_and_output_weights=tied, vp_stage=vp_stage,
                fast=self.layer_spec_choice == "fast")
            for callback in post_model_creation_callbacks:
                callback(model, pre_process=pre_process, post_process=post_process, config=self.config,
                         hf_config=self.hf_config)
            return model

        return provider

    # ---------------------------------------------------------------- names
    def _weight_name_mapping_mcore_to_hf(self, name: str) -> list[str]:
        if name in self._DIRECT_MAPPING:
            return [self._DIRECT_MAPPING[name]]
        m = _LAYER.match(name)
        if m:
            n, rest = m.groups()
            e = _EXPERT.match(rest)
            if e:
                return [HF.format(n=n) + EXPERT_NAMES[e.group(1)].format(e=e.group(2))]
            if rest in LAYER_NAMES:
                return [HF.format(n=n) + h for h in LAYER_NAMES[rest]]
        raise NotImplementedError(f"NemotronH bridge: no HF name for megatron parameter {name}")

    # ---------------------------------------------------------------- TP layout of the mixer
    def _tp_parts(self, name: str) -> list[int] | None:
        """Global sizes of the parts of in_proj ([z, x, B, C, dt]) or conv1d ([x, B, C])."""
        c = self.config
        d_inner, bc = c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_groups * c.mamba_state_dim
        if "mixer.in_proj.weight" in name:
            return [d_inner, d_inner, bc, bc, c.mamba_num_heads]
        if "mixer.conv1d" in name:
            return [d_inner, bc, bc]
        return None
