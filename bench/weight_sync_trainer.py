"""Weight-sync benchmark, the trainer ranks' side (run by bench/weight_sync_bench.py under torchrun).

In: the driver's arguments (`--role trainer --phase nccl|ipc ...`) and a receiver process
listening on `--port`. Out: OUT/<phase>.json with every measurement of the phase: ceiling,
end-to-end variants, export-only / protocol-only timings, verified and corrupted syncs, the
tensor-by-tensor baseline and the logits comparison (see weight_sync_bench.py's docstring).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from types import SimpleNamespace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import weight_sync_probes  # noqa: E402

GiB = 1 << 30

def fixed_ids(vocab: int, n: int = 2, seq: int = 32):
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, min(vocab, 30000), (n, seq), generator=g)


# -- trainer ranks ------------------------------------------------------------------------------------------
def run_trainer(a) -> None:
    import torch
    import torch.distributed as dist

    from bridges import bridge_for
    from skyrl_mega.megatron import forward, parallel
    from skyrl_mega.rollout.errors import WeightSyncError
    from skyrl_mega.weight_sync import CudaIpcTransport, NcclBroadcastTransport, sync_weights
    from skyrl_mega.weight_sync.export import get_exporter
    from tests.support.channel_client import ChannelClient
    from tests.support.faults import faulty  # the corrupted-bucket check

    rank, world = parallel.init_distributed()
    parallel.init_layout(ep=world)
    cuda = torch.cuda.is_available() and a.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    from skyrl_mega.compat.megatron_core import CPU_CONFIG

    # no apex / transformer-engine kernels on the lent machines: every fusion off
    no_fusions = {k: v for k, v in CPU_CONFIG.items() if k != "use_cpu_initialization"}
    bridge = bridge_for(a.model, dtype=dtype, spec="local", sequence_parallel=False, **no_fusions)
    t0 = time.perf_counter()
    models = bridge.build(load_weights=False, wrap_with_ddp=True, ddp_config=dict(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
        overlap_param_gather=False, average_in_collective=False))
    res: dict = {"phase": a.phase, "world": world, "build_s": time.perf_counter() - t0,
                 "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    bucket = int(a.bucket_mb) << 20
    out_json = os.path.join(a.out, f"{a.phase}.json")

    def save():
        if rank == 0:
            with open(out_json, "w") as f:
                json.dump(res, f, indent=1, default=str)

    def sync_all():
        if cuda:
            torch.cuda.synchronize()

    def logits():
        ids = fixed_ids(bridge.hf_config.vocab_size)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        mbs = [{"input_ids": ids[i: i + 1], "position_ids": pos[i: i + 1]} for i in range(ids.shape[0])]
        with torch.no_grad():
            got = forward.run_microbatches(models, mbs, lambda mb, out: out.detach().float().cpu(),
                                           forward_only=True, collect_non_loss_data=True)
        return torch.cat(got, 0) if got else None

    transport, client = None, None
    if rank == 0:
        client = ChannelClient(1, timeout_s=a.timeout)
        common = dict(receivers=[client], master_port=a.port, timeout_s=a.timeout, device=dev)
        if a.phase == "nccl":
            transport = faulty(NcclBroadcastTransport)(comm_backend="nccl" if cuda else "gloo", **common)
        else:
            transport = faulty(CudaIpcTransport)(zero_copy=cuda, **common)

    gloo = dist.new_group(backend="gloo") if world > 1 and dist.get_backend() != "gloo" else None

    def barrier():
        # a CPU barrier: an NCCL barrier would leave a spinning kernel on a GPU the receiver shares
        if world > 1:
            dist.barrier(group=gloo)

    gathers = ["auto", "nccl"] if a.phase == "nccl" and world > 1 else ["auto"]

    def timed_sync(version, gather="auto"):
        barrier()
        sync_all()
        t = time.perf_counter()
        m = sync_weights(bridge, models, transport, version=version, bucket_bytes=bucket, gather=gather)
        sync_all()
        dt = time.perf_counter() - t
        return dt, m

    import traceback

    res["errors"] = {}

    def section(name, fn):
        t = time.perf_counter()
        try:
            fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()[-2500:]
            print(f"[bench] {name} FAILED:\n{res['errors'][name]}", flush=True)
        print(f"[bench] rank {rank} {name} {time.perf_counter() - t:.2f}s", flush=True)
        save()

    ids = fixed_ids(bridge.hf_config.vocab_size).tolist()
    st: dict = {}

    def s_init():
        if rank == 0:  # rendezvous now, to see the receiver's logits before any sync
            transport.init()
            client.call("save_logits", {"input_ids": ids, "file": f"{a.phase}_rx_before.safetensors"})

    def s_warmup():
        for g in reversed(gathers):
            dt, _ = timed_sync(0, g)  # NCCL communicators, plans
        ex = get_exporter(bridge, models, bucket, "auto")
        st["plan"] = plan = ex.plan()
        res["auto_gather"] = "ipc (peer reads)" if ex.peers.active is not None else "nccl"
        res["warmup_s"] = dt
        res["plan"] = plan.summary()
        res["model_bytes"] = plan.total_bytes

    def s_ceiling():
        barrier()  # rank 1 waits here on the CPU, not in an NCCL kernel on the receiver's GPU
        nb = int(a.raw_gib * GiB)
        if a.phase == "nccl":
            if rank == 0:
                buf = torch.empty(nb, dtype=torch.uint8, device=dev)
                th = threading.Thread(target=client.call, args=("x_raw", {"nbytes": nb, "iters": a.iters + 1}))
                th.start()
                transport.comm.broadcast(buf, 0).wait()
                sync_all()
                t = time.perf_counter()
                for _ in range(a.iters):
                    transport.comm.broadcast(buf, 0).wait()
                sync_all()
                raw = (time.perf_counter() - t) / a.iters
                th.join()
                res["raw_broadcast"] = {"bytes": nb, "seconds": raw, "GBps": nb / raw / 1e9}
            barrier()
        else:
            src = torch.empty(nb, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            dst.copy_(src)
            sync_all()
            t = time.perf_counter()
            for _ in range(a.iters):
                dst.copy_(src)
            sync_all()
            d2d = (time.perf_counter() - t) / a.iters
            res["d2d_copy"] = {"bytes": nb, "seconds": d2d, "GBps": nb / d2d / 1e9,
                               "GBps_read_plus_write": 2 * nb / d2d / 1e9}

    def measure(label, gather="auto"):
        plan = st["plan"]
        times = []
        for v in range(1, a.iters + 1):
            dt, m = timed_sync(v, gather)
            times.append(dt)
            res["last_metrics"] = m
        best, med = min(times), sorted(times)[len(times) // 2]
        return {"label": label, "bytes": plan.total_bytes, "seconds": times,
                "receiver_last_update": client.last.get("update_weights") if rank == 0 else None,
                "best_GBps": plan.total_bytes / best / 1e9, "median_GBps": plan.total_bytes / med / 1e9,
                "metrics": res["last_metrics"]}

    def copy_mode(loop_min, graphs, strided):
        if rank == 0:
            client.call("x_copy_mode", {"loop_min_bytes": loop_min, "use_graphs": graphs, "strided": strided})

    def copies_label(loop_min, graphs, strided):
        return (f"{'strided chains + ' if strided else ''}{'memcpy >= 1 MiB' if loop_min < 1 << 40 else 'foreach'}"
                f"{', CUDA graph' if graphs else ''}")

    def set_slots(n):
        if rank == 0 and transport.num_slots != n:
            from skyrl_mega.weight_sync.slot_pool import SlotPool

            transport.pool.drain()
            transport.num_slots, transport.pool = n, SlotPool(dev, n=n)

    def set_copier(peer_copy, first):
        """How the leader reads the other ranks' experts (peer_gather.PeerExpertGather.copier)
        and which bucket kind the plan sends first."""
        ex = get_exporter(bridge, models, bucket, "auto")
        if ex.peers.active is not None and peer_copy != "-":
            ex.peers.active.copier = peer_copy.split("-")[0]
            ex.peer_rows_first = not peer_copy.endswith("-own-first")
        if rank == 0:
            transport.bucket_first = first

    MiB, NEVER = 1 << 20, 1 << 62

    def s_e2e():
        if a.phase == "nccl":
            # (gather, sender slots, receiver copies, leader's peer copies, first bucket kind)
            # variants, each measured here
            # (the library's defaults first; peer copies by the driver and dense buckets first
            # measured no better in runs C-I and are left out)
            # peer copies "torch-own-first": the leader's own row before the peer reads (the
            # order before run K)
            best = ("auto", 3, MiB, False, True, "torch", "experts")
            variants = [best, best[:5] + ("torch-own-first", "experts"), best[:3] + (True,) + best[4:],
                        ("auto", 2) + best[2:], ("nccl",) + best[1:5] + ("-", "experts")
                        ] if world > 1 else [("auto", 2, MiB, False, False, "-", "experts")]
            runs = []
            for g, slots, lm, gr, sd, cp, first in variants:
                set_slots(slots)
                copy_mode(lm, gr, sd)
                set_copier(cp, first)
                runs.append(measure(f"gather={g}, {slots} sender slots, receiver {copies_label(lm, gr, sd)}"
                                    + (f", peer copies {cp}" if cp != "-" else "")
                                    + f", {first} buckets first", g))
                runs[-1]["config"] = [g, slots, lm, gr, sd, cp, first]
            res["nccl_sweep"] = runs
            res["e2e_by_gather"] = {g: max((r for r in runs if r["config"][0] == g), key=lambda r: r["best_GBps"])
                                    for g in gathers}
            res["e2e"] = res["e2e_by_gather"]["auto"]
            _, slots, lm, gr, sd, cp, first = res["e2e"]["config"]
            set_slots(slots)
            copy_mode(lm, gr, sd)
            set_copier(cp, first)
            gil_variant()
            return
        # co-located: IPC round size x the engine's copy mode, each measured here
        runs = []
        variants = [(r, lm, gr, sd) for r in a.ipc_round_mb for lm, gr, sd in
                    ((MiB, True, False), (MiB, True, True), (NEVER, True, True), (MiB, False, True))]
        for round_mb, loop_min, graphs, strided in variants:
            if rank == 0:
                transport.round_bytes = round_mb << 20
            copy_mode(loop_min, graphs, strided)
            runs.append(measure(f"round {round_mb} MiB, copies {copies_label(loop_min, graphs, strided)}"))
            runs[-1]["config"] = [round_mb, loop_min, graphs, strided]
        res["ipc_sweep"] = runs
        res["e2e"] = max(runs, key=lambda r: r["best_GBps"])
        round_mb, loop_min, graphs, strided = res["e2e"]["config"]
        if rank == 0:  # keep the best setting for the rest of the run
            transport.round_bytes = round_mb << 20
        copy_mode(loop_min, graphs, strided)
        gil_variant()

    def gil_variant():
        """The best variant again with Python's own GIL switch interval (5 ms) during the sync
        instead of sync.GIL_SWITCH_S."""
        from skyrl_mega.weight_sync import sync as sync_mod

        kept, sync_mod.GIL_SWITCH_S = sync_mod.GIL_SWITCH_S, None
        try:
            res["e2e_gil_default"] = measure(res["e2e"]["label"] + ", GIL switch interval 5 ms (Python's default)")
        finally:
            sync_mod.GIL_SWITCH_S = kept

    def s_export_only():
        """The export without the transport: plan check + gather + pack into two rotating buffers."""
        from skyrl_mega.weight_sync.slot_pool import SlotPool

        ex = get_exporter(bridge, models, bucket, "auto")
        pool = SlotPool(dev, n=2)
        times = []
        for _ in range(a.iters):
            barrier()
            sync_all()
            t = time.perf_counter()
            ex.plan()
            for _b in ex.iter_buckets(acquire=lambda b, n: pool.acquire(n), layout="full"):
                pass
            sync_all()
            times.append(time.perf_counter() - t)
        plan = st["plan"]
        res["export_only"] = {"bytes": plan.total_bytes, "seconds": times,
                              "best_GBps": plan.total_bytes / min(times) / 1e9}
        pool.release()

    def s_wire():
        """The protocol without the export: pre-packed buckets (headers only) through the same
        transport and receiver (rank 0 alone; the other ranks wait)."""
        plan = st["plan"]
        times = []
        barrier()
        if rank == 0:
            for v in range(a.iters):
                sync_all()
                t = time.perf_counter()
                transport.start(200 + v, plan)
                for b in plan.buckets:
                    transport.send_bucket(b, transport.acquire(b, b.nbytes))
                transport.finish()
                sync_all()
                times.append(time.perf_counter() - t)
            res["wire_only"] = {"bytes": plan.total_bytes, "seconds": times,
                                "best_GBps": plan.total_bytes / min(times) / 1e9}
        barrier()

    def s_verify():
        plan = st["plan"]
        res["verify_by_gather"] = {}
        for g in gathers:
            if rank == 0:
                transport.verify = True
            try:
                dt, m = timed_sync(100, g)
            finally:
                if rank == 0:
                    transport.verify = False
            if rank == 0:
                rep = client.call("report")[0]
                res["verify_by_gather"][g] = {
                    "seconds": dt, "GBps": plan.total_bytes / dt / 1e9, "receiver": rep,
                    "sender_digest": transport.last_digest,
                    "match": rep["checksum"] == transport.last_digest and rep["version"] == 100}
        if rank == 0:
            res["verify"] = res["verify_by_gather"]["auto"]
            res["verify"]["same_digest_every_gather"] = len(
                {d["sender_digest"] for d in res["verify_by_gather"].values()}) == 1

    def s_corrupt():
        plan = st["plan"]
        target = None
        if rank == 0:
            transport.verify = True
            target = next(b.index for b in plan.buckets
                          if any(not (transport.layout == "ipc" and t.direct) for t in b.tensors))
            transport.corrupt_bucket = target
        try:
            sync_weights(bridge, models, transport, version=101, bucket_bytes=bucket)
            caught = None
        except WeightSyncError as e:
            caught = str(e)[:400]
        if rank == 0:
            transport.corrupt_bucket = None
            rep = client.call("report")[0]
            res["corrupt"] = {"bucket": target, "caught": caught is not None, "error": caught,
                              "receiver_after": {k: rep[k] for k in ("version", "consistent")}}
        try:
            timed_sync(102)
        finally:
            if rank == 0:
                transport.verify = False
        if rank == 0:
            rep = client.call("report")[0]
            res["verify_after_corrupt"] = {"match": rep["checksum"] == transport.last_digest,
                                           "version": rep["version"]}

    def s_fresh_weights():
        """New random weights written on the trainer's stream right before an unverified sync:
        an engine that read before those writes landed would disagree with the trainer's logits."""
        g = torch.Generator(device=dev).manual_seed(1000 + rank)
        with torch.no_grad():
            for m in models:
                for p in m.parameters():
                    p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
        names = [(t.name, list(t.shape)) for b in st["plan"].buckets for t in b.tensors]
        before = client.call("x_weights_digest", {"tensors": names})[0]["digest"] if rank == 0 else None
        timed_sync(103)
        # exact check: the receiver's weights now equal the trainer's fresh weights, tensor by tensor
        from skyrl_mega.weight_sync.checksum import digest, tensor_checksum
        from skyrl_mega.weight_sync.export import export_hf_state_dict

        sd = export_hf_state_dict(bridge, models, bucket, device=dev)
        if rank == 0:
            mine = digest(torch.stack([tensor_checksum(sd[n]) for n, _ in names]))
            got = client.call("x_weights_digest", {"tensors": names})[0]
            res["weights_after_sync"] = {"trainer_digest": mine, "receiver_digest": got["digest"],
                                         "tensors": got["tensors"], "equal": mine == got["digest"],
                                         "receiver_digest_before": before}
        del sd

    def s_rx_logits():
        if rank == 0:
            client.call("save_logits", {"input_ids": ids, "file": f"{a.phase}_rx_synced.safetensors"})
            client.call("x_fp32_logits", {"input_ids": ids, "file": f"{a.phase}_rx_synced_fp32.safetensors"})

    run = SimpleNamespace(a=a, rank=rank, world=world, cuda=cuda, bridge=bridge, models=models, bucket=bucket,
                          res=res, transport=transport, client=client, barrier=barrier, sync_all=sync_all,
                          timed_sync=timed_sync, set_slots=set_slots)

    try:
        section("init", s_init)
        section("warmup", s_warmup)
        section("ceiling", s_ceiling)
        section("e2e", s_e2e)
        if a.phase == "nccl":
            section("wire_only", s_wire)
            section("export_only", s_export_only)
        section("verify", s_verify)
        section("corrupt", s_corrupt)
        section("fresh_weights", s_fresh_weights)
        section("rx_logits", s_rx_logits)
        if a.phase == "nccl" and not a.skip_baseline:
            section("baseline", lambda: weight_sync_probes.tensor_by_tensor(run))
        section("trainer_logits", lambda: weight_sync_probes.logits_check(run, logits()))
        if a.profile:
            section("profile", lambda: weight_sync_probes.profile_sync(run))
    finally:
        if rank == 0 and transport is not None:
            transport.close()
        save()
        parallel.destroy()
