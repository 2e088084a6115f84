"""The hybrid families' kernels measured against each other: megatron (the bridge's model) on the
kernels this process has (GPU: fla / mamba-ssm Triton; CPU: the project's plain-PyTorch
stand-ins) vs transformers fp32, and vs the stand-ins' fp32 logits saved by a CPU run.

    python bench/hybrid_kernels.py --model HF_DIR --out OUT.json [--dtype bfloat16] [--reference CPU.safetensors]
    python bench/hybrid_kernels.py --model HF_DIR --save-logits CPU.safetensors      # on CPU: the reference

One process, world size 1. A fixed batch (4 x 48 tokens, seeded) and the same sequences cut to
other lengths and packed in one THD row. Out (JSON, and a line on stdout): the kernels in use
(compat.applied), max / mean |logit diff| vs transformers fp32 on the same device, vs the saved
stand-in logits, packed vs unpacked, and the train step's tokens/s (forward + backward of the
LM loss over the packed row repeated to --train-tokens, median of 5 after 2 warm-ups).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LENGTHS = (48, 31, 17, 40)


def batch(vocab: int = 500, seed: int = 0):
    return torch.randint(1, vocab, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(seed))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    ap.add_argument("--reference", help="stand-in logits saved by a CPU run (--save-logits)")
    ap.add_argument("--save-logits")
    ap.add_argument("--train-tokens", type=int, default=8192)
    ap.add_argument("--new-shapes", type=int, default=0,
                    help="then N more fwd+bwd, each on a packed row a token shorter than the last: "
                         "the first-call cost of a new packed length (Triton specialisation / autotune)")
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from bridges import bridge_for
    from skyrl_mega import compat
    from skyrl_mega.megatron.packing import thd_packed_seq_params
    from skyrl_mega.megatron import parallel

    parallel.init_layout(tp=1)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    bridge = bridge_for(args.model, dtype=dtype)
    (model,) = bridge.build()
    model.eval()
    ids = batch().to(dev)
    pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
    with torch.no_grad():
        got = model(ids, pos, None).float()
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "dtype": args.dtype,
           "megatron_core": compat.installed_version("megatron-core")}
    if args.save_logits:
        save_file({"logits": got.cpu().contiguous()}, args.save_logits)

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        ref = hf(ids).logits.float()
    d = (got - ref).abs()
    res.update(vs_transformers_fp32_max=float(d.max()), vs_transformers_fp32_mean=float(d.mean()),
               max_abs_logit=float(ref.abs().max()))
    if args.reference:
        cpu = load_file(args.reference)["logits"].to(dev)
        d = (got - cpu).abs()
        res.update(vs_standins_fp32_max=float(d.max()), vs_standins_fp32_mean=float(d.mean()))

    row = torch.cat([ids[i, :n] for i, n in enumerate(LENGTHS)]).unsqueeze(0)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    packed = thd_packed_seq_params(cu, cu, max(LENGTHS))  # what the train step hands megatron
    ppos = torch.cat([torch.arange(n, device=dev) for n in LENGTHS]).unsqueeze(0)
    try:
        with torch.no_grad():
            pk = model(row, ppos, None, packed_seq_params=packed)[0].float().split(list(LENGTHS))
        res["packed_vs_unpacked_max"] = max(float((p - got[i, :n]).abs().max())
                                            for i, (p, n) in enumerate(zip(pk, LENGTHS)))
    except AssertionError as e:  # megatron refuses packing on a kernel path it lacks: recorded
        res["packed_error"] = str(e)
    res["kernels"] = compat.applied()

    if dev.type == "cuda" and args.train_tokens and "packed_error" not in res:
        reps = max(1, args.train_tokens // row.shape[1])
        n = reps * len(LENGTHS)
        lens = list(LENGTHS) * reps
        trow = row.repeat(1, reps)
        tcu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        tpk = thd_packed_seq_params(tcu, tcu, max(lens))
        tpos = ppos.repeat(1, reps)
        labels = torch.roll(trow, -1, 1)
        model.train()
        times = []
        for i in range(7):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(trow, tpos, None, labels=labels, packed_seq_params=tpk).float().mean()
            loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        step = statistics.median(times[2:])
        fresh = []
        for k in range(1, args.new_shapes + 1):
            lens_k = lens[:-1] + [lens[-1] - k]
            cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model(trow[:, :-k], tpos[:, :-k], None, labels=labels[:, :-k],
                        packed_seq_params=thd_packed_seq_params(cu_k, cu_k, max(lens_k)))
            out.float().mean().backward()
            torch.cuda.synchronize()
            fresh.append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        if fresh:
            res["new_shape_step_s"] = fresh
        res.update(train_tokens=int(trow.shape[1]), train_sequences=n, train_step_s=step,
                   train_tokens_per_s=trow.shape[1] / step, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
