"""torchrun worker (world size 1): the IPC layout's cached direct tensors over several syncs.

Builds the model from an HF checkpoint and walks the bucket plan as the co-located CUDA IPC
transport does (layout "ipc"), without a transport: each walk's tensors (direct ones read from
the parameters, packed ones from the buffer) are saved, with what the walk saw. Walks:
  first    the plan's first walk (direct tensors looked up, cached)
  again    unchanged parameters: the same cached lists, no tensor looked up (raw refused)
  moved    one expert's parameter replaced by a copy at another address: the walk must end stale
  rebuilt  after invalidate(): a new plan, new cached lists, the moved expert read from its new place

Run: torchrun --nproc-per-node 1 tests/workers/direct_refs_worker.py HF_DIR OUT_DIR
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

from skyrl_mega.config import load_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron.model import build_model
from skyrl_mega.weight_sync import plan_check
from skyrl_mega.weight_sync.export import get_exporter
from skyrl_mega.weight_sync.plan import bucket_tensors


def main():
    hf_dir, out_dir = sys.argv[1], sys.argv[2]
    cfg = load_config(None, [f"model.path={hf_dir}"])
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    bridge, models = build_model(cfg)
    ex = get_exporter(bridge, models, 1 << 16)
    report = {}

    def walk(label):
        bufs = []
        out, refs = {}, []
        for b, buf, direct in ex.iter_buckets(acquire=lambda b, n: bufs.append(torch.zeros(n, dtype=torch.uint8))
                                              or bufs[-1], layout="ipc", plan=ex.plan("experts")):
            refs.append((b.kind, id(direct), getattr(direct, "key", None), len(direct)))
            for name, t in bucket_tensors(b, buf, direct, layout="ipc"):
                out[name] = t.detach().clone().contiguous()
        report[label] = {"stale": ex.stale_seen, "refs": refs, "rebuilds": ex.rebuilds}
        save_file(out, os.path.join(out_dir, f"{label}.safetensors"))
        return refs

    walk("first")
    real = plan_check.CheckedParams.raw

    def refused(self, key):
        raise AssertionError("a cached walk looked its direct tensors up again")

    plan_check.CheckedParams.raw = refused
    walk("again")
    plan_check.CheckedParams.raw = real
    # one expert's weights move (same values, same shape, new storage): only its address tells
    m = models[0].module if hasattr(models[0], "module") else models[0]
    name, p = next((n, p) for n, p in m.named_parameters() if ".experts." in n)
    report["moved_param"] = name
    with torch.no_grad():
        p.data = p.data.clone() + 1.0
    walk("moved")
    ex.invalidate()
    walk("rebuilt")
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(report, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
