"""torchrun worker: megatron's hybrid model (pattern M*-E) on the local spec and the CPU kernels.

    torchrun --nproc-per-node N tests/workers/hybrid_model_worker.py OUT.json   (N = TP size)

Builds the model from a NemotronH-shaped megatron config (squared-ReLU MLP and experts, sigmoid
router with expert bias, shared experts, no position embedding), then on rank 0 records: the
parameter names of each layer kind, the layer classes, whether the R3 router is in the MoE
layer; the logits of two sequences (12 and 8 tokens: SP at TP=2 splits them) packed in one row (THD) vs each run alone; and that a
backward pass reaches every parameter.
"""

import json
import sys

import torch

from skyrl_mega.megatron import parallel


def main():
    out = sys.argv[1]
    rank, tp = parallel.init_distributed()
    parallel.init_layout(tp=tp)
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig

    from skyrl_mega.compat.megatron_core import CPU_CONFIG
    from skyrl_mega.megatron.hybrid_model import build_hybrid_model
    from skyrl_mega.megatron.specs.common import R3TopKRouter

    cfg = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        ffn_hidden_size=96, normalization="RMSNorm", layernorm_epsilon=1e-5, add_bias_linear=False,
        gated_linear_unit=False, activation_func=lambda x: torch.relu(x).pow(2), params_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
        mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2, mamba_num_heads=4,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        **CPU_CONFIG)
    torch.manual_seed(3)
    model = build_hybrid_model(cfg, "M*-E", vocab_size=128, max_sequence_length=64, routing_replay=True)
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model.to(dev)  # on a GPU machine too (megatron-core 0.19 there): the stand-ins run on CUDA tensors
    names = [n for n, _ in model.named_parameters()]
    import megatron.core

    res = {"tp": tp, "megatron_core": megatron.core.__version__, "names": names, "layers": [type(m).__name__ for m in model.decoder.layers],
           "r3_router": isinstance(model.decoder.layers[3].mlp.router, R3TopKRouter)}

    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 128, (1, n), generator=g).to(dev) for n in (12, 8))
    model.eval()
    with torch.no_grad():
        alone = [model(x, torch.arange(x.shape[1], device=dev)[None], None) for x in (a, b)]
        cu = torch.tensor([0, 12, 20], dtype=torch.int32, device=dev)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12,
                              **({"total_tokens": 20} if "total_tokens" in PackedSeqParams.__dataclass_fields__ else {}))
        ids = torch.cat([a, b], 1)
        pos = torch.cat([torch.arange(12), torch.arange(8)])[None].to(dev)
        packed = model(ids, pos, None, packed_seq_params=psp)
    res["packed_vs_alone_max_abs"] = float((packed - torch.cat(alone, 1)).abs().max())
    res["logit_scale"] = float(packed.abs().max())
    res["unpacked_differs"] = float((model(ids, pos, None) - torch.cat(alone, 1)).abs().max())

    model.train()
    loss = model(ids, pos, None).float().logsumexp(-1).mean()
    loss.backward()
    res["no_grad"] = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
