"""Typed config schema (Hydra structured configs).

In: recipe YAML + command-line overrides. Out: a validated `SkyrlConfig` dataclass tree.
Unknown keys are rejected by OmegaConf's structured merge; semantic checks live in validate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF checkpoint directory (required)
    family: str = "qwen3_moe"  # used by make-tiny when `make_tiny_if_missing`
    make_tiny_if_missing: bool = False
    dtype: str = "float32"  # float32 | bfloat16
    spec: str = "auto"  # auto | te | local (auto: TE when transformer-engine is importable)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None = same as tp
    sequence_parallel: Optional[bool] = None  # None = on when tp > 1
    world_size: Optional[int] = None  # filled from the launcher when None


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"  # constant | cosine
    use_distributed_optimizer: bool = True


@dataclass
class TrainConfig:
    seed: int = 1234
    micro_batch_size: int = 1
    global_batch_size: int = 8
    max_tokens_per_microbatch: Optional[int] = None  # dynamic batch size when set
    steps: int = 10


@dataclass
class SkyrlConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/default"
