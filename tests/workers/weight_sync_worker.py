"""torchrun worker for the weight-sync tests (one torchrun per layout).

Run: torchrun --nproc-per-node N tests/workers/weight_sync_worker.py OUT_DIR MODE [key=value ...] -- overrides
MODE "receiver": the trainer syncs to a standalone transformers receiver (gloo) that rank 0
    starts; writes export.safetensors (bucketed export), mbridge.safetensors (mbridge's
    per-tensor export), plan.json, the receiver's logits per version, results.json. Then the
    same failure cases through the co-located CUDA IPC protocol (over /dev/shm on CPU) to a
    second receiver; then through SharedMemoryTransport to a fake engine that loads its files.
MODE "vllm": the trainer syncs to the vLLM server(s) given by urls=... and a standalone
    receiver in the same transfer group; writes trainer and receiver logits, results.json.
"""

import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # tests.support

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from skyrl_mega.config import load_config, validate_config  # noqa: E402
from skyrl_mega.megatron import forward, parallel  # noqa: E402
from skyrl_mega.megatron.model import build_bridge, build_model  # noqa: E402
from skyrl_mega.rollout.errors import WeightSyncError  # noqa: E402
from skyrl_mega.weight_sync import (CudaIpcTransport, NcclBroadcastTransport, export_hf_state_dict,  # noqa: E402
                                   get_exporter, sync_weights)
from tests.support.channel_client import ChannelClient  # noqa: E402
from tests.support.faults import faulty  # noqa: E402

BUCKET = 96 << 10  # small buckets: the tiny model spans many of them


def fixed_ids():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 500, (2, 12), generator=g)


def trainer_logits(models):
    from megatron.core import parallel_state as mpu

    ids = fixed_ids()
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    mbs = [{"input_ids": ids[i: i + 1], "position_ids": pos[i: i + 1]} for i in range(ids.shape[0])]
    with torch.no_grad():
        got = forward.run_microbatches(models, mbs, lambda mb, out: forward.gather_vocab_parallel(out).detach().cpu(),
                                       forward_only=True, collect_non_loss_data=True)
    if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_data_parallel_rank() == 0:
        return torch.cat(got, 0)
    return None


def save_trainer_logits(models, out_dir, name):
    lg = trainer_logits(models)
    if lg is not None:
        save_file({"logits": lg.contiguous()}, os.path.join(out_dir, name))
    dist.barrier()


def start_receiver(port, model_dir, out_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.receiver", "--master-port", str(port),
         "--model", model_dir, "--out-dir", out_dir, "--timeout-s", "120"],
        stdout=open(os.path.join(out_dir, "receiver.log"), "w"), stderr=subprocess.STDOUT, cwd=REPO)


def stop(transport, rx_proc):
    transport.close()
    try:
        rx_proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rx_proc.kill()


def transpose_first_router_on_stage_1(models):
    """The first MoE router of pipeline stage 1 takes the transposed shape (same bytes): a
    change that rank 0 (stage 0) cannot see locally."""
    from megatron.core import parallel_state as mpu

    if mpu.get_pipeline_model_parallel_rank() != 1:
        return
    for m in models:  # (each model chunk's first)
        for name, p in m.named_parameters():
            if name.endswith("mlp.router.weight"):
                p.data = p.data.view(p.shape[1], p.shape[0])
                break


class FileLoadingControl:
    """The control plane of one engine that loads what SharedMemoryTransport wrote (no vLLM)."""

    urls = ["engine"]

    def __init__(self):
        self.calls, self.loaded, self.files = [], {}, 0

    def pause(self, mode, timeout_s=None):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def collective_rpc(self, method, kwargs, timeout_s=None):
        from safetensors.torch import load_file

        m = json.loads(kwargs["manifest"])
        self.calls.append(method)
        for f in m["files"]:
            self.loaded.update(load_file(f))
        self.files = len(m["files"])
        return {"engine": [{"version": m["version"], "num_tensors": len(self.loaded)}]}

    def set_weight_version(self, v):
        self.calls.append(f"version {v}")

    def reset_prefix_cache(self, reset_running_requests=False):
        return {"engine": True}


def expect_failure(fn, results, key):
    try:
        fn()
    except WeightSyncError as e:
        results[key] = str(e)[:600]
        return
    results[key] = None


def main():
    out_dir, mode = sys.argv[1], sys.argv[2]
    args = sys.argv[3:]
    kv = dict(a.split("=", 1) for a in args[: args.index("--")]) if "--" in args else {}
    overrides = args[args.index("--") + 1:] if "--" in args else args
    cfg = load_config(None, overrides)
    validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world = parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    extra = {"moe_token_dispatcher_type": kv["dispatcher"]} if "dispatcher" in kv else {}
    bridge, models = build_model(cfg, bridge=build_bridge(cfg, **extra))
    results = {"world": world}

    if mode == "receiver":
        # 1) bucketed export vs mbridge's per-tensor export, and the plan
        t0 = time.perf_counter()
        sd = export_hf_state_dict(bridge, models, BUCKET)
        results["export_s"] = time.perf_counter() - t0
        ref = {n: t.detach().cpu().clone().contiguous() for n, t in bridge.export_hf(models)}
        experts_first = [b.kind for b in get_exporter(bridge, models, BUCKET).plan().buckets]
        plan = get_exporter(bridge, models, BUCKET, "nccl").plan(first="dense")  # an exporter of its own
        if rank == 0:
            save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(out_dir, "export.safetensors"))
            save_file(ref, os.path.join(out_dir, "mbridge.safetensors"))
            with open(os.path.join(out_dir, "plan.json"), "w") as f:
                json.dump({"summary": plan.summary(), "wire": plan.wire(), "bucket_bytes": BUCKET,
                           "stages": [b.stage for b in plan.buckets], "first": plan.first,
                           "experts_first_kinds": experts_first}, f)
        # 2) a standalone receiver (transformers, original weights) on gloo
        transport, rx_proc, client = None, None, None
        if rank == 0:
            from skyrl_mega.ports import free_port

            port = free_port()
            rx_proc = start_receiver(port, kv["receiver_model"], out_dir)
            client = ChannelClient(1, timeout_s=120)
            transport = faulty(NcclBroadcastTransport)(receivers=[client], comm_backend="gloo", master_port=port,
                                                       verify=True, timeout_s=120)
        try:
            m = sync_weights(bridge, models, transport, version=1, bucket_bytes=BUCKET)
            results["sync1"] = {k: v for k, v in m.items()}
            if rank == 0:
                client.call("save_logits", {"input_ids": fixed_ids().tolist(), "file": "receiver_v1.safetensors"})
                results["report_v1"] = client.call("report")[0]
                results["sender_digest_v1"] = transport.last_digest
            def failing_sync(hook, bucket, version, name):
                """A sync with a fault (tests/support/faults.py) set on `bucket`; records the error and
            the receiver's report."""
                if rank == 0:
                    setattr(transport, hook, bucket)
                expect_failure(lambda: sync_weights(bridge, models, transport, version=version,
                                                    bucket_bytes=BUCKET), results, f"{name}_error")
                if rank == 0:
                    setattr(transport, hook, None)
                    results[f"report_after_{name}"] = client.call("report")[0]

            # 3) a corrupted bucket: verification catches it, the receiver keeps version 1
            failing_sync("corrupt_bucket", 2, 2, "corrupt")
            # 4) a sync that dies half-way: the receiver keeps version 1
            failing_sync("fail_at_bucket", 3, 3, "abort")
            # 5) new parameter tensors (same names/shapes): the next sync sends the new values
            with torch.no_grad():
                for m_ in models:
                    for p in m_.parameters():
                        p.data = p.data.clone() * 1.01
            m = sync_weights(bridge, models, transport, version=4, bucket_bytes=BUCKET)
            results["sync4"] = m
            if rank == 0:
                client.call("save_logits", {"input_ids": fixed_ids().tolist(), "file": "receiver_v4.safetensors"})
                results["report_v4"] = client.call("report")[0]
                results["sender_digest_v4"] = transport.last_digest
            # 6) a parameter changes shape (same bytes) on the second pipeline stage only: the
            #    export notices, the sync aborts before its commit and runs again on a new plan
            transpose_first_router_on_stage_1(models)
            m = sync_weights(bridge, models, transport, version=5, bucket_bytes=BUCKET)
            results["sync5"] = m
            if rank == 0:
                results["report_v5"] = client.call("report")[0]
                results["sender_digest_v5"] = transport.last_digest
                results["router_shapes_v5"] = {t.name: list(t.shape) for b in transport._plan.buckets
                                               for t in b.tensors if t.name.endswith("mlp.gate.weight")}
        finally:
            if rank == 0:
                stop(transport, rx_proc)
        # 7) the co-located protocol (CudaIpcTransport: rounds, a staging buffer in /dev/shm on
        #    CPU) through the same cases: verified sync, a sync dying half-way, a stale plan
        #    found after the last bucket (its last round already posted), then a clean sync
        ipc, rx_proc, client = None, None, None
        if rank == 0:
            from skyrl_mega.ports import free_port

            port = free_port()
            rx_proc = start_receiver(port, kv["receiver_model"], out_dir)
            client = ChannelClient(1, timeout_s=120)
            ipc = faulty(CudaIpcTransport)(receivers=[client], master_port=port, verify=True, timeout_s=120,
                                           round_bytes=4 * BUCKET)  # several rounds
        try:
            m = sync_weights(bridge, models, ipc, version=11, bucket_bytes=BUCKET)
            if rank == 0:
                results["ipc_sync11"] = m
                results["ipc_report_v11"] = client.call("report")[0]
                results["ipc_digest_v11"] = ipc.last_digest
                ipc.fail_at_bucket = len(ipc._plan.buckets) - 2
            expect_failure(lambda: sync_weights(bridge, models, ipc, version=12, bucket_bytes=BUCKET),
                           results, "ipc_abort_error")
            if rank == 0:
                ipc.fail_at_bucket = None
                results["ipc_report_after_abort"] = client.call("report")[0]
            transpose_first_router_on_stage_1(models)  # step 6's router back to its shape
            m = sync_weights(bridge, models, ipc, version=13, bucket_bytes=BUCKET)
            if rank == 0:
                results["ipc_sync13"] = m
                results["ipc_report_v13"] = client.call("report")[0]
                results["ipc_digest_v13"] = ipc.last_digest
        finally:
            if rank == 0:
                stop(ipc, rx_proc)
        # 8) the CPU shared-memory transport through the same sync_weights: the files its
        #    engines would load hold exactly what mbridge's per-tensor export gives
        shm, ctl = None, None
        if rank == 0:
            from skyrl_mega.weight_sync import SharedMemoryTransport

            os.makedirs(os.path.join(out_dir, "shm"), exist_ok=True)
            ctl = FileLoadingControl()
            shm = SharedMemoryTransport(ctl, shm_root=os.path.join(out_dir, "shm"), pause_mode="wait")
        m = sync_weights(bridge, models, shm, version=21, bucket_bytes=BUCKET)
        ref = {n: t.detach().cpu().clone() for n, t in bridge.export_hf(models)}
        if rank == 0:
            results["shm_sync"] = {
                "buckets": m["weight_sync/buckets"], "files": ctl.files, "calls": ctl.calls,
                "report": shm.last_report, "left": os.listdir(os.path.join(out_dir, "shm")),
                "tensors": len(ref), "names_equal": sorted(ctl.loaded) == sorted(ref),
                "unequal": [n for n in ref if n not in ctl.loaded or not torch.equal(ctl.loaded[n], ref[n])]}
    elif mode == "vllm":
        from skyrl_mega.rollout.control import EngineControl

        urls = kv["urls"].split(",")
        transport, ctl, client, rx_proc = None, None, None, None
        if rank == 0:
            from skyrl_mega.ports import free_port

            port = free_port()
            rx_proc = start_receiver(port, kv["receiver_model"], out_dir)
            ctl = EngineControl(urls, timeout_s=120)
            client = ChannelClient(1, timeout_s=120)
            # one transfer group: trainer rank 0, the vLLM worker(s) and a standalone receiver
            transport = faulty(NcclBroadcastTransport)(ctl, receivers=[client], comm_backend="gloo",
                                                       master_port=port, verify=True, timeout_s=120)
            results["version_before"] = ctl.weight_versions()
        try:
            # a sync that dies half-way first: engines paused, old version everywhere
            if rank == 0:
                transport.fail_at_bucket = 4
            expect_failure(lambda: sync_weights(bridge, models, transport, version=7, bucket_bytes=BUCKET),
                           results, "abort_error")
            if rank == 0:
                transport.fail_at_bucket = None
                results["after_abort"] = {"versions": ctl.weight_versions(), "paused": ctl.is_paused(),
                                          "receiver": client.call("report")[0]}
            m = sync_weights(bridge, models, transport, version=8, bucket_bytes=BUCKET)
            results["sync"] = m
            save_trainer_logits(models, out_dir, "trainer_v8.safetensors")
            if rank == 0:
                results["after_sync"] = {"versions": ctl.weight_versions(), "paused": ctl.is_paused()}
                client.call("save_logits", {"input_ids": fixed_ids().tolist(), "file": "receiver_v8.safetensors"})
                results["receiver_v8"] = client.call("report")[0]
                results["sender_digest"] = transport.last_digest
                # colocated as in training: asleep, weights woken; the sleep holds scheduling, so
                # the sync sends no pause / prefix-cache reset / resume and waking resumes it
                ctl.sleep(1)
                ctl.wake_up(tags=["weights"])
                results["held_before"] = ctl.held_by_sleep
            sync_weights(bridge, models, transport, version=9, bucket_bytes=BUCKET)
            if rank == 0:
                results["held_sync"] = {"timings": sorted(transport.timings), "paused": ctl.is_paused(),
                                        "versions": ctl.weight_versions()}
                ctl.wake_up(tags=["kv_cache"])
                results["after_wake"] = {"paused": ctl.is_paused(), "versions": ctl.weight_versions()}
        finally:
            if rank == 0:
                stop(transport, rx_proc)
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, default=str, indent=1)
    parallel.destroy()


if __name__ == "__main__":
    main()
