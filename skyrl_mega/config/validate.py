"""The one config validator: run by `skyrl-mega validate` and `train` in the launching process,
before torchrun, any rank or any engine starts (and by each trainer rank, without the probe).

In: a SkyrlConfig, the world size, optionally the model's HF config (else read from
model.path). Out: None, or one ConfigError listing every problem, one line each, naming the
key, what is wrong and how to fix it (a single problem is a single line).

Checked here: the model checkpoint and layer spec, the parallel layout against the world size,
the model (experts vs EP, layers vs PP, heads vs TP, context parallel on attention-only models);
field_checks.py: every other field (ranges, choices, registered names and their options,
engine URLs). for_training adds what only a training run needs: its data, and, once everything
else is valid, its memory per GPU (memory.py: the estimated peak against parallel.gpu_memory_gib;
`convert` and the ranks skip it); probe_engines asks each rollout.external_urls engine for
/health (the CLI does; ranks skip it).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..errors import UserError
from .field_checks import SEQUENCE_LEVEL, at_least, choice, field_problems

MODEL_DTYPES = ("float32", "bfloat16")
FUSION_MODES = ("auto", "on", "off")  # megatron/kernels/fused.py MODES
# model families whose sequence mixers have no context-parallel split in the project's specs
CP_UNSUPPORTED = {"nemotron_h": "Mamba2", "qwen3_5_moe": "Gated DeltaNet", "qwen3_5_moe_text": "Gated DeltaNet"}


class ConfigError(UserError, ValueError):
    """A bad configuration; the message says which key and why."""


def read_hf_config(path: Optional[str]) -> Optional[dict[str, Any]]:
    if not path:
        return None
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        return None
    with open(cfg_file) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg


def num_experts(hf: dict[str, Any]) -> int:
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if hf.get(key):
            return int(hf[key])
    return 0


def uses_te(spec: str) -> bool:
    """The layer spec the model is built with (megatron/specs): TE for `te`, and for `auto`
    when transformer-engine imports."""
    from skyrl_mega.megatron.specs import te_available

    return spec == "te" or (spec == "auto" and te_available())


def spec_problems(spec: str) -> list[str]:
    from skyrl_mega.megatron.specs import spec_problem

    problem = spec_problem(spec)
    if problem is None and spec == "te" and not uses_te("auto"):
        problem = "model.spec=te but transformer-engine does not import here: install it, or use model.spec=local"
    return [problem] if problem else []


def model_problems(cfg) -> list[str]:
    m, out = cfg.model, []
    if not m.path:
        out.append("model.path is missing: set model.path=<HF checkpoint dir>")
    elif not os.path.isfile(os.path.join(m.path, "config.json")):
        why = "the directory does not exist" if not os.path.isdir(m.path) else "no config.json in it"
        out.append(f"model.path: no checkpoint at {m.path} ({why}): fix model.path, or make a tiny random "
                   "one with `skyrl-mega make-tiny FAMILY DIR`")
    return (out + choice("model.dtype", m.dtype, MODEL_DTYPES) + choice("model.fused_kernels", m.fused_kernels, FUSION_MODES)
            + spec_problems(m.spec))


def layout_problems(cfg, world: int) -> list[str]:
    """The parallel layout vs the world size, the layer spec and the RL step's data path."""
    p, a = cfg.parallel, cfg.algorithm
    out = at_least(cfg, 1, [f"parallel.{k}" for k in ("tp", "pp", "cp", "ep")])
    out += at_least(cfg, 1, ["parallel.etp", "parallel.world_size"], optional=True)
    out += at_least(cfg, 0, ["parallel.gpu_memory_gib"], strict=True, optional=True)
    if out:
        return out
    etp = p.etp if p.etp is not None else p.tp
    if world % (p.tp * p.pp * p.cp):
        out.append(f"world size {world} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {p.tp * p.pp * p.cp}")
    if world % (etp * p.ep * p.pp):
        out.append(f"world size {world} is not divisible by etp*ep*pp = {etp}*{p.ep}*{p.pp} = {etp * p.ep * p.pp}")
    dp = world // (p.tp * p.pp * p.cp) if world % (p.tp * p.pp * p.cp) == 0 else 0
    samples = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    if dp and isinstance(cfg.train.mini_batches, int) and cfg.train.mini_batches >= 1 \
            and samples // cfg.train.mini_batches < dp:
        out.append(f"train.mini_batches={cfg.train.mini_batches}: a mini-batch of {samples // cfg.train.mini_batches} "
                   f"samples leaves some of the {dp} data-parallel ranks without any: lower train.mini_batches "
                   "or raise rollout.prompts_per_step")
    if p.cp > 1:
        if not cfg.train.packing:
            out.append(f"parallel.cp={p.cp} needs train.packing=true (THD)")
        if a.policy_loss in SEQUENCE_LEVEL or (a.off_policy or "") in SEQUENCE_LEVEL:
            out.append(f"sequence-level losses / corrections {list(SEQUENCE_LEVEL)} are not supported with "
                       f"parallel.cp={p.cp}")
    return out


def model_layout_problems(cfg, hf: dict[str, Any]) -> list[str]:
    """The layout against the model's shape (HF config)."""
    p, out = cfg.parallel, []
    if min(p.tp, p.pp, p.ep) < 1:
        return out
    experts = num_experts(hf)
    if experts and experts % p.ep:
        out.append(f"{experts} experts are not divisible by parallel.ep={p.ep}")
    if not experts and p.ep > 1:
        out.append(f"parallel.ep={p.ep} but the model has no experts")
    sp = p.sequence_parallel if p.sequence_parallel is not None else p.tp > 1
    if experts and p.tp > 1 and not sp:
        out.append(f"parallel.tp={p.tp} with a MoE model needs sequence parallel: "
                   "set parallel.sequence_parallel=true (or leave it unset)")
    layers = hf.get("num_hidden_layers", 0)
    if layers and layers % p.pp:
        out.append(f"{layers} layers are not divisible by parallel.pp={p.pp}")
    if p.cp > 1 and hf.get("model_type") in CP_UNSUPPORTED:
        out.append(f"parallel.cp={p.cp}: context parallel is built for attention-only models (Qwen3-MoE); "
                   f"{hf['model_type']} has {CP_UNSUPPORTED[hf['model_type']]} layers, which have no CP "
                   "split here: set parallel.cp=1 (and spread long sequences with tp / pp)")
    heads, kv = hf.get("num_attention_heads", 0), hf.get("num_key_value_heads", 0)
    if heads and heads % p.tp:
        out.append(f"{heads} attention heads are not divisible by parallel.tp={p.tp}")
    if kv and kv % p.tp:
        out.append(f"{kv} key/value heads are not divisible by parallel.tp={p.tp}")
    return out


def memory_problems(cfg, world: int, hf: dict[str, Any]) -> list[str]:
    """The run's estimated peak per GPU against parallel.gpu_memory_gib (config/memory.py)."""
    from .memory import estimate

    est = estimate(hf, cfg, world)
    problem = est.problem() if est is not None else None
    return [problem] if problem else []


def family_problems(path: str) -> list[str]:
    """What the model family's bridge cannot build from this checkpoint's config."""
    from bridges.interface import config_problems

    return [f"model.path: {path}/config.json: {p}" for p in config_problems(path)]


def dist_backend_problems() -> list[str]:
    """SKYRL_DIST_BACKEND (the ranks' collectives with CUDA; megatron/parallel.dist_backend)."""
    want = os.environ.get("SKYRL_DIST_BACKEND", "").strip().lower()
    if want in ("", "nccl", "gloo"):
        return []
    return [f"SKYRL_DIST_BACKEND={want!r}: use nccl or gloo (or leave it unset)"]


def validate_config(cfg, world_size: Optional[int] = None, hf: Optional[dict] = None, *,
                    for_training: bool = False, probe_engines: bool = False) -> None:
    """Raises ConfigError listing every problem; returns None when the config is usable."""
    world = world_size or cfg.parallel.world_size or 1
    problems = model_problems(cfg) + layout_problems(cfg, world) + dist_backend_problems()
    hf = hf if hf is not None else read_hf_config(cfg.model.path)
    if hf is not None:
        problems += model_layout_problems(cfg, hf) + family_problems(cfg.model.path)
    problems += field_problems(cfg, for_training=for_training, probe_engines=probe_engines)
    if for_training and hf is not None and not problems:  # the estimate reads most fields: valid ones
        problems += memory_problems(cfg, world, hf)
    if len(problems) == 1:
        raise ConfigError(f"invalid config: {problems[0]}")
    if problems:
        raise ConfigError(f"invalid config ({len(problems)} problems):\n  - " + "\n  - ".join(problems))
