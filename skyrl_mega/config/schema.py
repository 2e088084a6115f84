"""Typed config schema: Hydra's primary config `skyrl_mega` (stored in its ConfigStore by loader.py).

In: recipe YAML + command-line overrides, composed over it by Hydra. Out: a `SkyrlConfig`
dataclass tree. Unknown keys and wrong types are rejected by OmegaConf's structured merge;
every value is checked by validate.py. Every field here has a reader (no dead settings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Any, Dict, Optional


@dataclass
class ModelConfig:
    path: Optional[str] = None  # HF checkpoint directory (required; `skyrl-mega demo` makes a tiny one)
    dtype: str = "float32"  # float32 | bfloat16
    spec: str = "auto"  # auto | te | local | fast (auto: TE if it imports, else fast with CUDA, else local)
    fused_kernels: str = "auto"  # auto | on | off: the fast spec's fused norm / SwiGLU / RoPE (torch.compile; auto: on CUDA)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: Optional[int] = None  # expert tensor parallel; None = same as tp
    sequence_parallel: Optional[bool] = None  # None = on when tp > 1
    world_size: Optional[int] = None  # filled from the launcher when None
    # memory of one GPU (GiB): `validate` and `train` refuse a run whose estimated peak per GPU
    # is larger (config/memory.py; null: no check). 80: an H100 80GB; recipes for the H200 set 140
    gpu_memory_gib: Optional[float] = 80.0


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
    micro_batch_size: int = 1  # samples per micro-batch unless max_tokens_per_microbatch (packed) is set
    max_tokens_per_microbatch: Optional[int] = None  # dynamic batch size when set
    steps: int = 10
    packing: bool = True  # THD sequence packing (False: one padded row per sample)
    # packed rows padded to a multiple of this many tokens: few shapes for kernels that compile
    # per shape (fla's and mamba-ssm's Triton kernels on GPU); None = no extra padding
    pad_packed_to: Optional[int] = None
    recompute_granularity: Optional[str] = None  # None | full (activation recompute, uniform, 1 layer)
    # optimizer updates per rollout batch: the batch cut into this many mini-batches of whole
    # samples, in order (megatron/train_step.train_on_batch), each trained train.epochs times
    mini_batches: int = 1
    epochs: int = 1


@dataclass
class AlgorithmConfig:
    """RL loss of the Megatron train step (skyrl_mega.megatron.train_step)."""

    advantage: str = "grpo"  # grpo | grpo_no_std | rloo | reinforce_pp_baseline | maxrl
    advantage_kwargs: Dict[str, Any] = field(default_factory=dict)
    policy_loss: str = "ppo"  # ppo | gspo | cispo (algorithms.POLICY_LOSSES)
    policy_loss_kwargs: Dict[str, Any] = field(default_factory=dict)  # e.g. eps_low, eps_high
    reduction: str = "token_mean"  # token_mean | sequence_mean | seq_mean_token_sum_norm
    max_len_norm: Optional[int] = None  # the constant of seq_mean_token_sum_norm
    off_policy: Optional[str] = None  # None | tis | seq_tis | mis (rollout vs old logprobs)
    off_policy_kwargs: Dict[str, Any] = field(default_factory=dict)
    old_logprobs: str = "rollout"  # rollout (the engine's) | recompute (a forward before the update)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    use_reference: bool = False  # build a reference model (same HF path) for ref logprobs
    entropy_coef: float = 0.0
    temperature: float = 1.0  # logits / T, as at sampling
    routing_replay: bool = False  # R3: replay the engine's routed experts
    ref_routing_replay: bool = False  # the reference model replays them too


@dataclass
class RolloutConfig:
    """vLLM engines (skyrl_mega/controller/engines.py) and sampling."""

    num_servers: int = 1
    external_urls: List[str] = field(default_factory=list)  # disaggregated: servers started elsewhere
    use_router: bool = True  # vllm-router in front for the data plane
    prompts_per_step: int = 4
    n_samples_per_prompt: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0  # per-request seeds derive from (seed, step, prompt, sample): reproducible
    max_model_len: int = 512
    kv_cache_gib: int = 1
    dtype: str = "auto"  # engine dtype; auto = the checkpoint's
    startup_timeout_s: float = 300.0
    request_deadline_s: float = 300.0
    max_step_retries: int = 3  # a step whose rollout fails (e.g. a server died) is retried
    max_concurrency: int = 64
    sleep_level: int = 1  # colocated GPU placement: engines sleep during training (1 or 2; 0: never)
    # GPU engines (ignored on CPU): tensor parallel size per engine; memory as a fraction of the
    # GPU (None: a KV cache of kv_cache_gib, which suits a GPU the trainer shares); CUDA graphs
    # (enforce_eager None: graphs on GPU, eager on CPU); engine_gpus: CUDA_VISIBLE_DEVICES of each
    # engine (e.g. ["0,1", "2,3"]; empty: every engine sees the node's GPUs); extra_args: passed
    # to every vLLM server as they are
    engine_tp: int = 1
    gpu_memory_utilization: Optional[float] = None
    enforce_eager: Optional[bool] = None
    max_num_seqs: Optional[int] = None
    engine_gpus: List[str] = field(default_factory=list)
    extra_args: List[str] = field(default_factory=list)
    # trainer -> engine weights: auto (the placement's: cuda_ipc colocated / nccl disaggregated on
    # GPU, shm on CPU) | shm | nccl | cuda_ipc. nccl and cuda_ipc also run on CPU (gloo and
    # /dev/shm) through the same vLLM "skyrl_bucket" backend: that is how CPU boxes test them.
    weight_transport: str = "auto"
    # per-tensor checksums on both ends of a bucketed sync (nccl, cuda_ipc): never | first_last
    # (the sync of the initial weights and the last step's) | always; a mismatch fails the sync and the
    # engines keep the old version
    verify_sync: str = "first_last"
    # cuda_ipc (co-located): each one-worker engine's worker takes the sync's rounds on a listener
    # of its own (rollout/worker_channel.py, 127.0.0.1) instead of through vLLM's API server and
    # engine core (false: every round through POST /collective_rpc). On an H200 it took a 29.9 GB
    # sync from 56.5% to 61-62.5% of the device-to-device copy rate (BENCHMARKS.md)
    worker_channel: bool = True
    log_dir: Optional[str] = None  # default: <output_dir>/engine_logs


@dataclass
class DataConfig:
    # jsonl / parquet / a directory written by HF datasets' save_to_disk (`skyrl-mega data`
    # turns other layouts into one file); generated when synthetic is set
    train_path: Optional[str] = None
    synthetic: Optional[str] = None  # "digits": write the demo task to train_path if missing
    synthetic_size: int = 256
    chat_template: bool = True
    max_prompt_len: int = 256
    reward: str = "digits"  # default reward function (skyrl_mega/data/rewards.py)
    reward_by_source: Dict[str, str] = field(default_factory=dict)  # data_source -> reward name
    # rewards run in worker processes (data/reward_pool.py): a call past reward_timeout_s is
    # stopped and, like one that raises, scores 0 (counted in reward/timeouts, reward/errors)
    reward_timeout_s: float = 10.0
    reward_workers: int = 4
    shuffle: bool = True


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # default: <output_dir>/checkpoints
    every_n_steps: int = 0  # 0: only at the end
    keep_last: int = 2
    resume: str = "auto"  # auto (latest complete) | none | <path to a step_N directory>
    hf_export_every_n_steps: int = 0
    hf_export_at_end: bool = True


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # when tensorboard is installed
    wandb_project: Optional[str] = None
    plot: bool = True  # PNG of reward, response length, KL, logprob diff at the end
    progress_bar: bool = True


@dataclass
class SkyrlConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    output_dir: str = "runs/default"
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    placement: str = "colocated"  # colocated | disaggregated (engines vs trainer ranks)
