"""Weight-sync benchmark, trainer side: the probes and checks beside the timed syncs (weight_sync_trainer.py
runs them as sections of a phase).

    tensor_by_tensor(run)   the baseline: mbridge's export, one broadcast per tensor
    profile_sync(run)       where one sync's time goes (plan check profile, GPU timelines)
    logits_check(run, ref)  the receiver's logits against the trainer's, within TOL

`run`: the trainer's run (its arguments, rank, model, transport, receiver client, result dict and
helpers: barrier, sync_all, timed_sync, set_slots); results go into run.res.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from skyrl_mega.weight_sync.export import get_exporter

# bf16 logits of two implementations (Megatron local spec vs transformers) on identical weights.
# "noise_x": max |receiver - trainer| may be at most this multiple of the receiver's own bf16
# rounding noise on the same weights (max |transformers bf16 - transformers fp32|, measured in
# the run): top-k routing turns rounding differences into expert flips, so a fixed fraction of
# the logit range says little; the noise floor of one implementation does.
TOL = {"cosine_min": 0.999, "noise_x": 2.0}


def tensor_by_tensor(run) -> None:
    """The baseline: mbridge's export, one broadcast per tensor (nccl phase): res["tensor_by_tensor"]."""
    meta = [(n, str(t.dtype).split(".")[-1], list(t.shape)) for n, t in run.bridge.export_hf(run.models)]
    th = None
    if run.rank == 0:
        th = threading.Thread(target=run.client.call, args=("x_per_tensor", {"meta": meta}))
        th.start()
    run.barrier()
    run.sync_all()
    t = time.perf_counter()
    for n, tens in run.bridge.export_hf(run.models):
        if run.rank == 0:
            run.transport.comm.broadcast(tens.contiguous(), 0).wait()
    run.sync_all()
    if run.rank == 0:
        th.join()
    dt = time.perf_counter() - t
    nbytes = 0
    for _, d, shp in meta:
        k = 1
        for x in shp:
            k *= x
        nbytes += k * (2 if d == "bfloat16" else 4)
    run.res["tensor_by_tensor"] = {"tensors": len(meta), "bytes": nbytes, "seconds": dt, "GBps": nbytes / dt / 1e9}


def profile_sync(run) -> None:
    """Where one sync's time goes: cProfile of the plan check on every rank, and the GPU
    timeline (kernels, copies) of one end-to-end sync on rank 0 (torch.profiler)."""
    import cProfile
    import io
    import pstats

    ex = get_exporter(run.bridge, run.models, run.bucket, "auto")
    # the by-name tensor lookup that opens every sync, timed warm (back to back), after the
    # thread slept, and right after a CUDA synchronize (as in the timed syncs)
    idx, lk = ex.check.index, {}
    for label, before in (("warm", lambda: None), ("after_sleep", lambda: time.sleep(0.05)),
                          ("after_cuda_sync", run.sync_all)):
        ms = []
        for _ in range(10):
            before()
            t = time.perf_counter()
            idx.lookup()
            ms.append((time.perf_counter() - t) * 1e3)
        lk[label] = {"min": min(ms), "median": sorted(ms)[len(ms) // 2]}
    run.res.setdefault("lookup_ms", {})[str(run.rank)] = {"tensors": len(idx.keys), **lk}
    for _ in range(2):
        run.barrier()
        run.sync_all()
        t = time.perf_counter()
        ex.plan()
        run.res.setdefault("plan_check_ms", {}).setdefault(str(run.rank), []).append((time.perf_counter() - t) * 1e3)
    run.barrier()
    pr = cProfile.Profile()
    pr.enable()
    ex.plan()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("cumulative").print_stats(14)
    print(f"[bench] rank {run.rank} plan() profile:\n{text.getvalue()}", flush=True)
    run.res.setdefault("plan_profile", {})[str(run.rank)] = text.getvalue()[-3000:]
    if not run.cuda:
        return
    from torch.profiler import ProfilerActivity, profile

    if run.rank == 0:
        run.client.call("x_profile_next", {"name": f"{run.a.phase}_rx"})  # the receiver's side of the same sync
    run.barrier()
    run.sync_all()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run.timed_sync(150)
    if run.rank == 0:
        from weight_sync_bench import save_gpu_timeline

        save_gpu_timeline(prof, run.a.out, run.a.phase)
    if run.a.phase == "nccl" and run.world > 1:  # the sender's slot count, one timeline each
        for n in (2, 4):
            run.set_slots(n)
            run.timed_sync(160 + n)  # first use of the new slots
            run.barrier()
            run.sync_all()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run.timed_sync(170 + n)
            if run.rank == 0:
                save_gpu_timeline(prof, run.a.out, f"{run.a.phase}_slots{n}")


def _compare(run, label: str, rx_file: str, ref) -> None:
    """run.res[label]: the receiver's saved logits (rx_file) against `ref`."""
    from safetensors.torch import load_file

    got = load_file(os.path.join(run.a.out, rx_file))["logits"].float()
    r = ref.float().reshape(-1)
    g = got.reshape(-1)
    cos = torch.nn.functional.cosine_similarity(r, g, dim=0).item()
    mx = (r - g).abs().max().item()
    run.res[label] = {"max_abs": mx, "mean_abs": (r - g).abs().mean().item(), "ref_max": r.abs().max().item(),
                      "rel": mx / max(r.abs().max().item(), 1e-12), "cosine": cos,
                      "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def logits_check(run, ref) -> None:
    """The receiver's logits before and after the sync against the trainer's own (`ref`, every
    rank computed them), and the receiver's bf16 noise floor; the verdict against TOL."""
    if run.rank == 0:
        _compare(run, "logits_before_sync", f"{run.a.phase}_rx_before.safetensors", ref)
        _compare(run, "logits_after_sync", f"{run.a.phase}_rx_synced.safetensors", ref)
        from safetensors.torch import load_file

        rx16 = load_file(os.path.join(run.a.out, f"{run.a.phase}_rx_synced.safetensors"))["logits"].float()
        _compare(run, "rx_bf16_noise", f"{run.a.phase}_rx_synced_fp32.safetensors", rx16)
        lg = run.res["logits_after_sync"]
        lg["noise_floor_max_abs"] = run.res["rx_bf16_noise"]["max_abs"]
        lg["pass"] = (lg["cosine"] >= TOL["cosine_min"]
                      and lg["max_abs"] <= TOL["noise_x"] * max(lg["noise_floor_max_abs"], 1e-6))
        lg["tolerance"] = TOL
