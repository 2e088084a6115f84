"""Weight-sync benchmark: Megatron MoE trainer -> receiver, NCCL broadcast and CUDA IPC, one run.

    python bench/weight_sync_bench.py --out runs/ws_bench                     # 2 GPUs (H200 x2)
    python bench/weight_sync_bench.py --device cpu --size tiny --out /tmp/wsb  # gloo dry run

Phase "nccl" (disaggregated): a Megatron trainer with EP=2 (torchrun, one rank per GPU) syncs
to a standalone receiver (transformers model, tests/support/receiver.py) on GPU1 through
NcclBroadcastTransport: rank 0 packs buckets on GPU0 and broadcasts them over NVLink to GPU1
while rank 1's experts are gathered toward rank 0 (the other direction of the link).
Reported in the same run: the raw NCCL broadcast of one 4 GiB buffer (the ceiling), the
end-to-end sync (plan check + export + EP gather + pack + broadcast + unpack into the
receiver's weights + commit), and a tensor-by-tensor baseline (mbridge's per-tensor export,
one collective per tensor, and one broadcast per tensor).
Phase "ipc" (co-located): a world-size-1 trainer and the receiver share GPU0;
CudaIpcTransport: the receiver copies straight out of the trainer's parameter buffer
(zero-copy), the q/k/v splits go through one staging buffer. Reported next to a plain
device-to-device copy of 4 GiB measured in the same run.
Correctness in both phases: a verified sync (per-tensor checksums on both ends), a
deliberately corrupted bucket that must fail, and receiver logits vs the trainer's own
(Megatron) logits after the sync (bf16; tolerance in weight_sync_probes.TOL).
This file: the driver, the receiver process and the report; the trainer ranks' phases are in
bench/weight_sync_trainer.py.
Writes OUT/results.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import faulthandler
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from skyrl_mega.ports import free_port  # noqa: E402

SIZES = {
    # ~14.7 GB bf16: 16 layers x 32 experts x (3 x 2048 x 2048), vocab 151936
    "big": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=2048,
                num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=32, num_experts_per_tok=4, mlp_only_layers=[], decoder_sparse_step=1,
                max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True,
                router_aux_loss_coef=0.0, rms_norm_eps=1e-6),
    # the big model's tensor counts with tiny tensors: measures the per-sync Python overhead on CPU
    "counts": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   num_experts=32, num_experts_per_tok=4, mlp_only_layers=[], decoder_sparse_step=1,
                   max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True,
                   router_aux_loss_coef=0.0, rms_norm_eps=1e-6),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], decoder_sparse_step=1,
                 max_position_embeddings=1024, tie_word_embeddings=False, norm_topk_prob=True,
                 router_aux_loss_coef=0.0, rms_norm_eps=1e-6),
}


def save_gpu_timeline(prof, out_dir: str, name: str) -> None:
    """torch.profiler result -> <name>_gpu_timeline.json: [kernel/copy name, device, stream, start us,
    duration us] of every GPU operation, times relative to the first one."""
    trace = os.path.join(out_dir, f"{name}_trace_full.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        ev = json.load(f).get("traceEvents", [])
    os.remove(trace)
    keep = [e for e in ev if e.get("ph") == "X" and (e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
                                                    or e.get("name", "").startswith(("sync_weights", "ncclDev")))]
    t0 = min(e["ts"] for e in keep) if keep else 0
    gpu = [[e["name"][:60], e.get("args", {}).get("device"), e.get("args", {}).get("stream"),
            round(e["ts"] - t0, 1), round(e.get("dur", 0), 1)] for e in keep]
    cpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    # the CPU side: when each CUDA call was made and how long it blocked (same clock)
    api = [[e["name"][:40], round(e["ts"] - t0, 1), round(e.get("dur", 0), 1)] for e in ev
           if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]
    with open(os.path.join(out_dir, f"{name}_gpu_timeline.json"), "w") as f:
        json.dump({"t0_us": t0, "gpu": gpu, "api": api,
                   "cpu_first_ts": round(min((e["ts"] for e in cpu), default=t0) - t0, 1)}, f)


# -- receiver process ---------------------------------------------------------------------------------
def run_receiver(a) -> None:
    import torch

    from tests.support.receiver import WeightReceiver, load_model

    class BenchReceiver(WeightReceiver):
        def x_raw(self, nbytes: int, iters: int) -> dict:
            buf = torch.empty(int(nbytes), dtype=torch.uint8, device=self.device)
            for _ in range(int(iters)):
                self.comm.broadcast(buf, 0).wait()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return {"iters": iters}

        def x_per_tensor(self, meta: list) -> dict:
            from skyrl_mega.weight_sync.plan import to_dtype

            for name, dt, shape in meta:
                t = torch.empty(shape, dtype=to_dtype(dt), device=self.device)
                self.comm.broadcast(t, 0).wait()
                key, start, n = self.targets.target(name, shape)
                self.targets.flat(key)[start: start + n].copy_(t.view(-1))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return {"tensors": len(meta)}

        def x_weights_digest(self, tensors: list) -> dict:
            """Digest of the model's current weights, per HF tensor (name, shape) in the given order."""
            from skyrl_mega.weight_sync.checksum import digest, tensor_checksum

            rows = []
            for name, shape in tensors:
                key, start, n = self.targets.target(name, shape)
                rows.append(tensor_checksum(self.targets.flat(key)[start: start + n]))
            return {"digest": digest(torch.stack(rows)), "tensors": len(rows)}

        def x_fp32_logits(self, input_ids, file: str) -> dict:
            """Logits of an fp32 copy of the model (the bf16 noise floor of this implementation)."""
            import copy

            from safetensors.torch import save_file

            m32 = copy.deepcopy(self.model).float()
            with torch.no_grad():
                lg = m32(torch.as_tensor(input_ids, device=self.device)).logits.float().cpu().contiguous()
            del m32
            torch.cuda.empty_cache() if self.device.type == "cuda" else None
            save_file({"logits": lg}, os.path.join(a.out, file))
            return {"file": file}

        _profile_name = None
        _prof = None

        def x_profile_next(self, name: str) -> dict:
            """Starts recording now (the profiler's start-up must not delay the sync); the GPU
            timeline and CUDA calls up to the next finish_weight_update go to
            <name>_gpu_timeline.json."""
            if self.device.type == "cuda":
                from torch.profiler import ProfilerActivity, profile

                self._profile_name = name
                self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self._prof.__enter__()
            return {"name": name}

        def finish_weight_update(self, weight_version=None) -> dict:
            rep = super().finish_weight_update(weight_version)
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                save_gpu_timeline(self._prof, a.out, self._profile_name)
                self._prof = self._profile_name = None
            return rep

        def x_copy_mode(self, loop_min_bytes: int, use_graphs: bool = False, strided: bool = False) -> dict:
            from skyrl_mega.weight_sync.copy_plan import CopyPlan

            CopyPlan.loop_min_bytes = int(loop_min_bytes)
            CopyPlan.use_graphs = bool(use_graphs)
            CopyPlan.strided = bool(strided)
            return {"loop_min_bytes": CopyPlan.loop_min_bytes, "use_graphs": CopyPlan.use_graphs,
                    "strided": CopyPlan.strided}

    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    model = load_model(a.model, a.dtype, a.device, random_init=True)
    rx = BenchReceiver(model, a.device)
    rx.serve("127.0.0.1", a.port, 0, timeout_s=a.timeout, out_dir=a.out)


# -- driver ---------------------------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (torchrun's worker ranks), from /proc."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


def run_phase(a, phase: str, env: dict, model_dir: str, deadline: float) -> dict:
    port = free_port()
    cuda = a.device == "cuda"
    nproc = 2 if phase == "nccl" else 1
    rx_dev = ("cuda:1" if phase == "nccl" else "cuda:0") if cuda else "cpu"
    common = ["--model", model_dir, "--out", a.out, "--port", str(port), "--dtype", a.dtype,
              "--timeout", str(a.timeout)]
    rx = subprocess.Popen([sys.executable, __file__, "--role", "receiver", "--device", rx_dev, *common],
                          stdout=open(os.path.join(a.out, f"{phase}_receiver.log"), "w"), stderr=subprocess.STDOUT,
                          env=env)
    tr_cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
              "--master-addr=127.0.0.1", f"--master-port={free_port()}", __file__, "--role", "trainer",
              "--phase", phase, "--device", a.device, "--iters", str(a.iters), "--raw-gib", str(a.raw_gib),
              "--bucket-mb", str(a.bucket_mb),
              "--ipc-round-mb", ",".join(map(str, a.ipc_round_mb)), *common] + (["--skip-baseline"] if a.skip_baseline else []) + (["--profile"] if a.profile else [])
    tr = subprocess.Popen(tr_cmd, stdout=open(os.path.join(a.out, f"{phase}_trainer.log"), "w"),
                          stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        tr.wait(timeout=max(10, deadline - time.time()))
    except subprocess.TimeoutExpired:
        # a hang: every process prints its Python stacks to its log first (faulthandler), then dies
        for pid in [rx.pid] + _children(tr.pid):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(3)
        os.killpg(tr.pid, 9)
    try:
        rx.wait(timeout=20)
    except subprocess.TimeoutExpired:
        rx.kill()
    path = os.path.join(a.out, f"{phase}.json")
    out = json.load(open(path)) if os.path.exists(path) else {"error": "no results"}
    out["trainer_rc"] = tr.returncode
    if tr.returncode != 0:
        out["trainer_log_tail"] = open(os.path.join(a.out, f"{phase}_trainer.log")).read()[-3000:]
    return out


def summarize(r: dict) -> str:
    n, i = r.get("nccl", {}), r.get("ipc", {})
    lines = ["| measurement | bytes | time | bandwidth |", "|---|---|---|---|"]

    def row(label, d, key="GBps", t="seconds"):
        if d:
            tt = d[t] if not isinstance(d[t], list) else min(d[t])
            lines.append(f"| {label} | {d['bytes'] / 1e9:.2f} GB | {tt * 1e3:.2f} ms | {d[key]:.1f} GB/s |")

    row("NCCL broadcast, one buffer (ceiling)", n.get("raw_broadcast"))
    row("NCCL end-to-end sync, EP=2 trainer -> receiver (best)", n.get("e2e"), "best_GBps")
    row("tensor-by-tensor baseline (mbridge export + per-tensor broadcast)", n.get("tensor_by_tensor"))
    row("D2D copy on one GPU (bytes copied / s)", i.get("d2d_copy"))
    row("CUDA IPC end-to-end sync, co-located (best)", i.get("e2e"), "best_GBps")
    if n.get("e2e") and n.get("raw_broadcast"):
        lines.append(f"\nNCCL end-to-end / ceiling: {n['e2e']['best_GBps'] / n['raw_broadcast']['GBps']:.1%} "
                     f"(median {n['e2e']['median_GBps'] / n['raw_broadcast']['GBps']:.1%})")
    if n.get("e2e") and n.get("tensor_by_tensor"):
        lines.append(f"NCCL end-to-end / tensor-by-tensor: {n['e2e']['best_GBps'] / n['tensor_by_tensor']['GBps']:.1f}x")
    if i.get("e2e") and i.get("d2d_copy"):
        lines.append(f"CUDA IPC end-to-end / D2D copy: {i['e2e']['best_GBps'] / i['d2d_copy']['GBps']:.1%} "
                     f"(median {i['e2e']['median_GBps'] / i['d2d_copy']['GBps']:.1%})")
    for d in n.get("nccl_sweep", []) + ([n["e2e_gil_default"]] if n.get("e2e_gil_default") else []):
        lines.append(f"NCCL {d['label']}: best {d['best_GBps']:.1f} GB/s, median {d['median_GBps']:.1f}")
    if n.get("export_only"):
        lines.append(f"NCCL phase, export alone (plan check + gather + pack, no transfer): best "
                     f"{n['export_only']['best_GBps']:.1f} GB/s")
    if n.get("wire_only"):
        lines.append(f"NCCL protocol without the export (pre-packed buckets): best {n['wire_only']['best_GBps']:.1f} GB/s")
    if n.get("auto_gather"):
        lines.append(f"gather=auto used: {n['auto_gather']}")
    for d in i.get("ipc_sweep", []) + ([i["e2e_gil_default"]] if i.get("e2e_gil_default") else []):
        lines.append(f"IPC {d['label']}: best {d['best_GBps']:.1f} GB/s, median {d['median_GBps']:.1f}")
    for ph, d in (("nccl", n), ("ipc", i)):
        if d.get("verify"):
            lines.append(f"{ph}: verified sync {d['verify']['GBps']:.1f} GB/s, checksums match: {d['verify']['match']}; "
                         f"same digest with every gather: {d['verify'].get('same_digest_every_gather')}; "
                         f"corrupted bucket caught: {d.get('corrupt', {}).get('caught')}; "
                         f"weights equal after an unverified sync of fresh weights: "
                         f"{d.get('weights_after_sync', {}).get('equal')}; "
                         f"logits after sync: {d.get('logits_after_sync')}")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="driver", choices=["driver", "trainer", "receiver"])
    ap.add_argument("--phase", default="nccl", choices=["nccl", "ipc"])
    ap.add_argument("--phases", default="nccl,ipc")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", default="big", choices=sorted(SIZES))
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", default="runs/weight_sync_bench")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--raw-gib", type=float, default=4.0)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--ipc-round-mb", type=lambda v: [int(x) for x in v.split(",")], default=[2048, 1 << 20],
                    help="IPC phase: round sizes to measure (MiB, comma-separated)")
    ap.add_argument("--timeout", type=float, default=180.0)
    ap.add_argument("--time-limit", type=float, default=280.0, help="driver: kill everything after this")
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also profile one sync (plan check + GPU timeline)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    if a.role in ("receiver", "trainer"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's "print your stacks"
    if a.role == "receiver":
        return run_receiver(a)
    if a.role == "trainer":
        from weight_sync_trainer import run_trainer  # bench/ is this script's directory

        return run_trainer(a)
    t_start = time.time()
    model_dir = a.model or os.path.join(a.out, f"model_{a.size}")
    if not a.model:
        from transformers import Qwen3MoeConfig

        Qwen3MoeConfig(**SIZES[a.size]).save_pretrained(model_dir)
    env = dict(os.environ)
    env.update(NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(p for p in (env.get("PYTHONPATH"), REPO) if p))
    results = {"date": time.strftime("%Y-%m-%d"), "size": a.size, "dtype": a.dtype, "bucket_mb": a.bucket_mb,
               "command": " ".join(sys.argv)}
    phases = a.phases.split(",")
    for k, ph in enumerate(phases):
        share = (a.time_limit - (time.time() - t_start)) / (len(phases) - k)
        results[ph] = run_phase(a, ph, env, model_dir, time.time() + share)
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    text = summarize(results)
    results["summary"] = text
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    print(text)
    print(f"total {time.time() - t_start:.0f}s; details in {os.path.join(a.out, 'results.json')}")


if __name__ == "__main__":
    main()
