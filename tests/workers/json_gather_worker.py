"""torchrun worker: collectives.all_gather_json over gloo, world group and a subgroup.

Run: torchrun --nproc-per-node 2 tests/workers/json_gather_worker.py OUT_DIR
Each rank gathers an object of its own (different sizes, nesting, unicode) and writes what it
got to OUT_DIR/rank<r>.json.
"""

import json
import os
import sys

import torch.distributed as dist

from skyrl_mega.weight_sync.collectives import all_gather_json


def mine(rank: int):
    if rank == 0:
        return {"rank": 0, "names": ["model.layers.0.mlp.experts.0.up_proj.weight"] * 40, "shape": [4, 8],
                "flag": True, "none": None, "text": "\u00e9\u2192"}
    return [rank, [1.5, -2], {"k": "v"}]


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = all_gather_json(mine(rank))
    sub = all_gather_json({"sub": rank}, group=dist.new_group([0, 1], backend="gloo"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "sub": sub}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
