"""torchrun worker: megatron-core's own MambaMixer on the CPU kernel stand-ins vs transformers.

    torchrun --nproc-per-node N tests/workers/mamba_mixer_worker.py OUT.json   (N = TP size)

transformers' NemotronH mixer is imported BEFORE the stand-ins exist, so it keeps its own torch
path (the independent reference). Then the stand-ins are registered, megatron's MambaMixer is
built at TP=N with the same weights (each rank its shard of in_proj's z | x | B | C | dt, of
conv1d, A_log, D, dt_bias, norm and out_proj) and compared, fp32: forward output, the input
gradient; and two sequences packed in one row (seq_idx from cu_seqlens) vs each alone.
Rank 0 writes the figures to OUT.json.
"""

import importlib.util
import json
import sys

import torch

assert importlib.util.find_spec("mamba_ssm") is None, "this check needs a machine without mamba_ssm"
from transformers import NemotronHConfig  # noqa: E402
from transformers.models.nemotron_h import modeling_nemotron_h as hf  # noqa: E402  (torch path frozen now)

from skyrl_mega.compat.mamba_ssm import apply_mamba_kernel_standins  # noqa: E402
from skyrl_mega.megatron import parallel  # noqa: E402

H, HEADS, HEAD_DIM, GROUPS, STATE, CONV = 48, 8, 8, 2, 16, 4


def hf_mixer():
    cfg = NemotronHConfig(hidden_size=H, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, n_groups=GROUPS,
                          ssm_state_size=STATE, conv_kernel=CONV, chunk_size=16, layer_norm_epsilon=1e-5,
                          time_step_min=0.0, num_hidden_layers=1, layers_block_type=["mamba"], use_bias=False,
                          use_conv_bias=True)
    torch.manual_seed(0)
    m = hf.NemotronHMamba2Mixer(cfg, layer_idx=0).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        m.A_log.copy_(torch.rand(HEADS).log())
        m.norm.weight.add_(1.0)
    return m


def shard_of(w, parts, rank, tp, dim=0):
    """Rank's shard of a tensor made of consecutive parts, each split over TP on `dim`."""
    chunks = torch.split(w, parts, dim=dim)
    return torch.cat([c.chunk(tp, dim=dim)[rank] for c in chunks], dim=dim)


def main():
    out_file = sys.argv[1]
    rank, tp = parallel.init_distributed()
    parallel.init_layout(tp=tp)
    assert apply_mamba_kernel_standins()
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    ref = hf_mixer()
    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, params_dtype=torch.float32,
                            use_cpu_initialization=True, mamba_state_dim=STATE, mamba_head_dim=HEAD_DIM,
                            mamba_num_groups=GROUPS, mamba_num_heads=HEADS, tensor_model_parallel_size=tp,
                            gradient_accumulation_fusion=False)
    mixer = MambaMixer(cfg, MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
                       d_model=H, d_conv=CONV, chunk_size=16, layer_number=1,
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    d_inner, gs = HEADS * HEAD_DIM, GROUPS * STATE
    with torch.no_grad():
        mixer.in_proj.weight.copy_(shard_of(ref.in_proj.weight, [d_inner, d_inner, gs, gs, HEADS], rank, tp))
        mixer.conv1d.weight.copy_(shard_of(ref.conv1d.weight, [d_inner, gs, gs], rank, tp))
        mixer.conv1d.bias.copy_(shard_of(ref.conv1d.bias, [d_inner, gs, gs], rank, tp))
        for name in ("A_log", "D", "dt_bias"):
            getattr(mixer, name).copy_(getattr(ref, name).chunk(tp)[rank])
        mixer.norm.weight.copy_(ref.norm.weight.chunk(tp)[rank])
        mixer.out_proj.weight.copy_(ref.out_proj.weight.chunk(tp, dim=1)[rank])

    torch.manual_seed(1)
    x = torch.randn(2, 40, H)  # (b, l, h): the same on every rank
    xr = x.clone().requires_grad_()
    want = ref(xr)
    want.pow(2).sum().backward()
    xm = x.transpose(0, 1).contiguous().requires_grad_()  # megatron: (l, b, h)
    got, _ = mixer(xm)
    got.pow(2).sum().backward()
    got = got.transpose(0, 1)
    res = {"tp": tp, "max_abs": float((got - want).abs().max()), "scale": float(want.abs().max()),
           "grad_max_abs": float((xm.grad.transpose(0, 1) - xr.grad).abs().max()),
           "grad_scale": float(xr.grad.abs().max())}

    # packed: two sequences in one row restart the state; each equals itself alone
    from megatron.core.packed_seq_params import PackedSeqParams

    a, b = x[0, :17], x[1, :23]
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=23, max_seqlen_kv=23)
    with torch.no_grad():
        packed, _ = mixer(torch.cat([a, b])[:, None], packed_seq_params=psp)
        alone = torch.cat([mixer(a[:, None])[0], mixer(b[:, None])[0]])
    res["packed_vs_alone_max_abs"] = float((packed - alone).abs().max())
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(res, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
