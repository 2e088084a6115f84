"""torchrun worker: build the model from an HF checkpoint and write it back with the trainer's
HF save (ModelBridge.save_hf), nothing trained in between.

Run: torchrun --nproc-per-node N tests/workers/save_hf_worker.py HF_DIR OUT_DIR overrides...
"""

import sys

from skyrl_mega.config import load_config
from skyrl_mega.megatron import parallel
from skyrl_mega.megatron.model import build_model


def main():
    hf_dir, out_dir, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    cfg = load_config(None, [f"model.path={hf_dir}", *overrides])
    parallel.init_distributed()
    parallel.init_model_parallel(cfg.parallel, seed=cfg.train.seed)
    bridge, models = build_model(cfg)
    bridge.save_hf(models, out_dir)
    parallel.destroy()


if __name__ == "__main__":
    main()
