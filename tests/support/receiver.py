"""A receiver without vLLM: joins a weight transport and loads the buckets into a transformers model.

In: a transformers model (any HF causal LM whose parameters carry the checkpoint names; the
fused expert tensors of transformers 5 — `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I] — are filled from the per-expert checkpoint names). Out: the
model holding the trainer's weights, a committed weight version and a checksum digest.

It answers the same four calls as a vLLM engine (init_weight_transfer_engine /
start_weight_update / update_weights / finish_weight_update), in-process or, with `serve()`,
over the TCPStore channel of `ChannelClient` (channel_client.py). A test and benchmark
stand-in for an engine, run from the repository root:

    python -m tests.support.receiver --master-address H --master-port P --index 0 \
        --model DIR [--device cuda:1] [--dtype bfloat16]

Data paths: "broadcast" (gloo/NCCL group, protocol.py): buckets land in two rotating buffers
and are copied into the parameters (copy_plan.py: copies merged where source and destination
ranges are back to back; one layer's experts become one copy per EP rank); "ipc": the
trainer's buffers are opened through their typed IPC handles (ipc_handles.py; /dev/shm files
on CPU) and copied the same way.
A failed or aborted update keeps the previous version (`consistent` turns False until the
next good update); verification compares checksums of what landed in the parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import time
from typing import Any

import torch

from skyrl_mega.rollout.errors import WeightSyncError
from skyrl_mega.weight_sync import ipc_handles
from skyrl_mega.weight_sync.checksum import digest
from skyrl_mega.weight_sync.plan import TensorSlot, to_dtype
from skyrl_mega.weight_sync.protocol import Communicator, ReceiveSink, receive_sync

from skyrl_mega.weight_sync.copy_plan import CopyPlan

logger = logging.getLogger(__name__)

_FUSED = re.compile(r"^(.*)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ParamTargets:
    """HF checkpoint name -> (flat parameter, first element, numel) in a transformers model."""

    def __init__(self, model: torch.nn.Module):
        self.params = dict(model.named_parameters())
        self.params.update({k: v for k, v in model.named_buffers() if k not in self.params})
        for p in self.params.values():
            if not p.is_contiguous():
                raise ValueError("receiver parameters must be contiguous")
        self._flat: dict[str, torch.Tensor] = {}

    def flat(self, key: str) -> torch.Tensor:
        f = self._flat.get(key)
        if f is None:
            f = self._flat[key] = self.params[key].data.view(-1)
        return f

    def target(self, name: str, shape) -> tuple[str, int, int]:
        n = 1
        for s in shape:
            n *= int(s)
        if name in self.params:
            if self.params[name].numel() != n:
                raise WeightSyncError(f"{name}: receiver shape {tuple(self.params[name].shape)} != sent {tuple(shape)}")
            return name, 0, n
        m = _FUSED.match(name)
        if m:
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind in ("gate_proj", "up_proj") and f"{prefix}.experts.gate_up_proj" in self.params:
                key = f"{prefix}.experts.gate_up_proj"
                E, two_i, h = self.params[key].shape
                if n != two_i // 2 * h:
                    raise WeightSyncError(f"{name}: {tuple(shape)} does not fit {key} {(E, two_i, h)}")
                return key, e * two_i * h + (n if kind == "up_proj" else 0), n
            if kind == "down_proj" and f"{prefix}.experts.down_proj" in self.params:
                key = f"{prefix}.experts.down_proj"
                E, h, i = self.params[key].shape
                if n != h * i:
                    raise WeightSyncError(f"{name}: {tuple(shape)} does not fit {key} {(E, h, i)}")
                return key, e * h * i, n
        raise WeightSyncError(f"receiver model has no parameter for {name!r}")


class _BroadcastSink(ReceiveSink):
    def __init__(self, rx: "WeightReceiver"):
        self.rx = rx
        self.verify = False

    def buffer(self, index, nbytes):
        return self.rx._slot(index % 2, nbytes)

    def load(self, index, slots: list[TensorSlot], buf):
        cp = self.rx._copy_plan((self.plan_id, index), slots, "buf")
        cp.execute({"buf": buf})
        if not self.verify:
            return None
        out = torch.zeros(len(slots), 2, dtype=torch.int64, device=buf.device)
        first = slots[0].index if slots else 0
        cp.checksums(out, lambda i: i - first)
        return out


class WeightReceiver:
    """Loads synced weights into a transformers model (see module doc)."""

    def __init__(self, model: torch.nn.Module, device: torch.device | str | None = None):
        self.model = model
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.targets = ParamTargets(model)
        self.comm: Communicator | None = None
        self.mode = None
        self.version: Any = None  # the committed version
        self.pending: Any = None
        self.consistent = True
        self.last_error: str | None = None
        self.checksums: dict[int, tuple[str, list[int]]] = {}  # plan index -> (name, checksum) of the last sync
        self._slots: list[torch.Tensor | None] = [None, None]
        self._plans: dict = {}  # (plan_id, bucket) -> CopyPlan
        self._wire_plans: dict = {}  # plan_id -> ParsedPlan
        self._ipc_open: dict = {}  # IPC memory handle -> opened buffer (kept across syncs)
        self._ipc_layouts: dict = {}  # layout_id -> (CopyPlan, [(index, name)])
        self.timings: dict[str, float] = {}

    # -- the four calls ------------------------------------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict, store=None) -> dict:
        self.mode = init_info.get("mode", "broadcast")
        if self.comm is not None:  # the trainer re-formed the group: leave the old one
            self.comm.close()
            self.comm = None
        if self.mode == "broadcast":
            rank = int(init_info["rank_offset"]) + int(init_info.get("index", 0))
            self.comm = Communicator(init_info["comm_backend"], init_info["master_address"],
                                     int(init_info["master_port"]), rank, int(init_info["world_size"]),
                                     float(init_info.get("timeout_s", 600)), self.device, store=store,
                                     group=init_info.get("group", "skyrl_ws_pg"))
        elif self.mode != "ipc":
            raise ValueError(f"unknown transfer mode {self.mode!r}")
        return {"mode": self.mode, "rank": self.comm.rank if self.comm else None}

    def start_weight_update(self) -> dict:
        self.pending = None
        return {}

    def update_weights(self, update_info: dict) -> dict:
        t0 = time.perf_counter()
        self.pending = update_info["version"]
        if not update_info.get("verify") and update_info.get("round", 0) == 0:
            self.checksums = {}  # checksums describe the last verified sync only
        try:
            if self.mode == "broadcast":
                rep = receive_sync(self.comm, update_info, _BroadcastSink(self), self._wire_plans)
                names = rep.pop("names")
                cs = rep.pop("checksums")
                if cs is not None:
                    self.checksums = {i: (n, r) for i, (n, r) in enumerate(zip(names, cs.cpu().tolist()))}
            else:
                rep = self._ipc_round(update_info)
        except BaseException as e:
            self.consistent = False
            self.last_error = repr(e)
            self.pending = None
            raise
        if self.device.type == "cuda" and (self.mode != "ipc" or update_info.get("sync", True)):
            torch.cuda.synchronize(self.device)
        self.timings["update_s"] = time.perf_counter() - t0
        rep["seconds"] = round(time.perf_counter() - t0, 6)
        return rep

    def finish_weight_update(self, weight_version: Any = None) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # answered after every copy (as the vLLM backend)
        if weight_version is not None:
            if self.pending is None or str(self.pending) != str(weight_version):
                raise WeightSyncError(f"finish {weight_version}: no completed update of that version "
                                      f"(pending {self.pending})")
            self.version = weight_version
            self.consistent = True
            self.last_error = None
        self.pending = None
        return self.report()

    def report(self) -> dict:
        rows = [self.checksums[k][1] for k in sorted(self.checksums)]
        cs = digest(torch.tensor(rows, dtype=torch.int64)) if rows else None
        return {"version": self.version, "consistent": self.consistent, "checksum": cs,
                "num_tensors": len(self.checksums), "last_error": self.last_error}

    # -- helpers ---------------------------------------------------------------------------------------
    def _slot(self, i: int, nbytes: int) -> torch.Tensor:
        b = self._slots[i]
        if b is None or b.numel() < nbytes:
            self._slots[i] = None
            b = self._slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return b[:nbytes]

    def _copy_plan(self, key, slots: list[TensorSlot], src_key) -> CopyPlan:
        """The cached copies of one bucket of one plan (built once per plan)."""
        cp = self._plans.get(key)
        if cp is not None:
            return cp
        if any(k[0] != key[0] for k in self._plans):
            self._plans.clear()  # a new plan: drop the old one's copies
        plan = CopyPlan()
        for t in sorted(slots, key=lambda s: s.offset):
            pkey, start, n = self.targets.target(t.name, t.shape)
            plan.add(src_key, t.offset, to_dtype(t.dtype), self.targets.flat(pkey), start, n, t.index)
        self._plans[key] = plan
        return plan

    def _ipc_round(self, info: dict) -> dict:
        """One IPC round: open the trainer's buffers (cached per memory handle), copy, verify."""
        sources = {}
        for i, h in enumerate(info["handles"]):
            key = ipc_handles.handle_key(h)
            t = self._ipc_open.get(key)
            if t is None:
                t = self._ipc_open[key] = ipc_handles.decode(h, self.device)
            sources[i] = t
        lid = info.get("layout_id")
        if info.get("tensors") is not None:
            cp, slots = CopyPlan(), []
            for name, dt, shape, h, off, nbytes, index in info["tensors"]:
                pkey, start, n = self.targets.target(name, shape)
                cp.add(h, off, to_dtype(dt), self.targets.flat(pkey), start, n, index)
                slots.append((index, name))
            if lid is not None:
                if len(self._ipc_layouts) > 64:
                    self._ipc_layouts.clear()
                self._ipc_layouts[lid] = (cp, slots)
        elif lid in self._ipc_layouts:
            cp, slots = self._ipc_layouts[lid]
        else:
            raise WeightSyncError(f"unknown IPC layout {lid} (the trainer resends it next sync)")
        if len(self._ipc_open) > 4 * max(1, len(sources)) + 8:  # buffers the trainer no longer uses
            live = {ipc_handles.handle_key(h) for h in info["handles"]}
            self._ipc_open = {k: v for k, v in self._ipc_open.items() if k in live}
        ipc_handles.wait_event(info.get("event"), self.device)  # the trainer's writes are done
        cp.execute(sources)
        got = None
        if info.get("verify"):
            rows = {idx: i for i, (idx, _) in enumerate(slots)}
            got = torch.zeros(len(slots), 2, dtype=torch.int64, device=self.device)
            cp.checksums(got, lambda s: rows[s])
        bad = []
        if got is not None:
            exp = torch.tensor(info["checksums"], dtype=torch.int64)
            g = got.cpu()
            bad = [slots[i][1] for i in (exp != g).any(1).nonzero().flatten().tolist()]
            if info.get("round", 0) == 0:
                self.checksums = {}
            self.checksums.update({idx: (n, r) for (idx, n), r in zip(slots, g.tolist())})
        if bad:
            raise WeightSyncError(f"update {info['version']}: checksum mismatch for {len(bad)} tensor(s) "
                                  f"received over CUDA IPC, e.g. {bad[:3]}")
        return {"version": info["version"], "num_tensors": len(slots), "round": info.get("round", 0)}

    @torch.no_grad()
    def logits(self, input_ids) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, device=self.device)
        return self.model(ids).logits

    # -- serving over the channel -----------------------------------------------------------------------
    def serve(self, master_address: str, master_port: int, index: int, timeout_s: float = 600.0,
              out_dir: str | None = None) -> None:
        """Answers ChannelClient messages until "shutdown" (see channel_client.py for the message format)."""
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore(master_address, int(master_port), None, False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        seq = 0
        while True:
            key = f"skyrl_ws_ctl/{seq}"
            while True:  # idle between syncs for as long as training takes
                try:
                    store.wait([key], datetime.timedelta(seconds=60))
                    break
                except Exception as e:
                    if "timeout" not in str(e).lower() and "timed out" not in str(e).lower():
                        raise
            msg = json.loads(store.get(key))
            method, args = msg["method"], msg.get("args") or {}
            reply: dict = {"ok": True}
            try:
                if method == "shutdown":
                    store.set(f"skyrl_ws_ack/{seq}/{index}", json.dumps(reply))
                    return
                if method == "init_weight_transfer_engine":
                    info = dict(args["init_info"])
                    info["index"] = index
                    reply["result"] = self.init_weight_transfer_engine(info, store=store)
                elif method == "start_weight_update":
                    reply["result"] = self.start_weight_update()
                elif method == "update_weights":
                    reply["result"] = self.update_weights(args["update_info"])
                elif method == "finish_weight_update":
                    reply["result"] = self.finish_weight_update(args.get("weight_version"))
                elif method == "report":
                    reply["result"] = self.report()
                elif method.startswith("x_") and callable(getattr(self, method, None)):
                    reply["result"] = getattr(self, method)(**args)  # extensions (benchmarks)
                elif method == "save_logits":
                    path = os.path.join(out_dir or ".", args["file"])
                    from safetensors.torch import save_file

                    save_file({"logits": self.logits(args["input_ids"]).float().cpu().contiguous()}, path)
                    reply["result"] = {"path": path}
                else:
                    raise ValueError(f"unknown method {method!r}")
            except BaseException as e:  # answer, then keep serving
                logger.exception("receiver %d: %s failed", index, method)
                reply = {"ok": False, "error": repr(e)[:2000]}
            store.set(f"skyrl_ws_ack/{seq}/{index}", json.dumps(reply, default=str))
            seq += 1


def load_model(model_dir: str, dtype: str, device: str, random_init: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    dt = to_dtype(dtype)
    if random_init:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(device)
    return model.eval()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--master-address", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--model", required=True, help="HF model dir (config.json [+ weights])")
    ap.add_argument("--random-init", action="store_true", help="build from config.json only")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s receiver %(levelname)s %(message)s")
    if a.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(a.device))
    rx = WeightReceiver(load_model(a.model, a.dtype, a.device, a.random_init), a.device)
    rx.serve(a.master_address, a.master_port, a.index, a.timeout_s, a.out_dir)


if __name__ == "__main__":
    main()
