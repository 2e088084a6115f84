"""torchrun worker (world size 1): Qwen3.5-MoE specifics, measured on a tiny checkpoint.

    torchrun --nproc-per-node 1 tests/workers/qwen3_5_checks_worker.py HF_DIR MULTIMODAL_DIR OUT.json

- packing: sequences packed in one THD row vs each alone (max abs logit difference), and the
  same row given as one unpacked sequence (what a GDN layer without a state reset would see:
  the later sequences must be far off); which compat shims the packed forward used
- the multimodal checkpoint (model.language_model.* tensors, text_config): logits vs the text
  checkpoint's and its export (names and values) vs its own tensors
- the zero-centred norms: logits with megatron's zero-centred gamma switched off (a bridge that
  loses it) must be far off
"""

import json
import sys

import torch

from skyrl_mega.checkpoint.hf_reader import HFReader

from skyrl_mega.megatron import parallel

LENGTHS = (9, 14, 5, 12)


def main():
    hf_dir, mm_dir, out = sys.argv[1:4]
    parallel.init_distributed()
    parallel.init_layout(tp=1)
    from megatron.core.packed_seq_params import PackedSeqParams
    from transformers import AutoModelForCausalLM

    from bridges import bridge_for
    from skyrl_mega import compat

    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 500, (n,), generator=g) for n in LENGTHS]
    res = {}
    bridge = bridge_for(hf_dir)
    (model,) = bridge.build()
    model.eval()

    def logits(ids, packed=None):
        pos = (torch.cat([torch.arange(len(s)) for s in seqs]) if packed is not None
               else torch.arange(ids.shape[-1])).unsqueeze(0)
        with torch.no_grad():
            return model(ids.unsqueeze(0), pos, None, packed_seq_params=packed)[0]

    alone = [logits(s) for s in seqs]
    row = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                             cu_seqlens_kv_padded=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    got = logits(row, packed).split(LENGTHS)
    res["packed_vs_alone"] = max(float((a - b).abs().max()) for a, b in zip(got, alone))
    # one unpacked row: attention and the GDN state run across the boundaries
    merged = logits(row).split(LENGTHS)
    res["unreset_vs_alone_later_seqs"] = min(float((a - b).abs().max()) for a, b in zip(merged[1:], alone[1:]))
    res["applied"] = compat.applied()

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        res["as_loaded_vs_transformers"] = float((alone[1] - hf(seqs[1].unsqueeze(0)).logits[0]).abs().max())

    mm = bridge_for(mm_dir)
    (mm_model,) = mm.build()
    mm_model.eval()
    with torch.no_grad():
        mm_logits = mm_model(seqs[1].unsqueeze(0), torch.arange(LENGTHS[1]).unsqueeze(0), None)[0]
    res["multimodal_vs_text_logits"] = float((mm_logits - alone[1]).abs().max())
    exported = dict(mm.export_hf([mm_model]))
    # the checkpoint as the bridges read it (fused experts as their per-expert slices: the export,
    # which feeds the weight sync, is per expert); the vision tower and MTP layers are not built
    reader = HFReader(mm_dir)
    names = [k for k in reader.files if k not in mm.carried([k])]
    original = dict(zip(names, reader.read(names)))
    res["multimodal_export_names_equal"] = sorted(exported) == sorted(original)
    res["multimodal_export_bit_exact"] = all(torch.equal(exported[k], original[k]) for k in original if k in exported)

    (uncentred,) = bridge_for(hf_dir, layernorm_zero_centered_gamma=False).build()
    uncentred.eval()
    with torch.no_grad():
        res["zero_centred_dropped"] = float((uncentred(seqs[1].unsqueeze(0), torch.arange(LENGTHS[1]).unsqueeze(0),
                                                       None)[0] - alone[1]).abs().max())
    with open(out, "w") as f:
        json.dump(res, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
