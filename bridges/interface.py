"""The thin bridge interface and its registry.

In: an HF checkpoint directory (or config), dtype, which layer spec to use (model.spec, see
skyrl_mega/megatron/specs) and whether the MoE routers replay routes (R3).
Out: Megatron model chunks (list, one per virtual pipeline stage) with HF weights loaded,
and an iterator of (hf_name, tensor) for export, gathered over TP/EP/PP. Checkpoint tensors a
family declares carried (CARRIED_PREFIXES: MTP layers, a vision tower) are not built; every HF
checkpoint written from the model gets them unchanged from the source checkpoint. Either expert
layout reads (fused 3-D experts as released Qwen3.5-MoE checkpoints hold them, or one tensor per
expert: checkpoint/expert_layout.py); every HF checkpoint written keeps the source's layout.
"""

from __future__ import annotations

import importlib
from typing import Callable, Iterator

import torch

from skyrl_mega.compat.megatron_core import CPU_CONFIG
from skyrl_mega.compat.transformers import fix_hf_config
from skyrl_mega.megatron import specs

_REGISTRY: dict[str, str] = {
    # model_type -> "module:Class"
    "qwen3_moe": "bridges.qwen3_moe:Qwen3MoeBridge",
    "nemotron_h": "bridges.nemotron_h:NemotronHBridge",
    "qwen3_5_moe_text": "bridges.qwen3_5_moe:Qwen3_5MoeBridge",
    "qwen3_5_moe": "bridges.qwen3_5_moe:Qwen3_5MoeBridge",
}


def supported_model_types() -> list[str]:
    """The HF model_types that have a bridge."""
    return sorted(_REGISTRY)


def register_bridge(model_type: str, target: str) -> None:
    """Registers 'module:Class' as the bridge for an HF model_type."""
    _REGISTRY[model_type] = target


def config_problems(hf_path: str) -> list[str]:
    """What the family's bridge would refuse in this HF checkpoint's config (its module's
    `unsupported(config)`, one reason each), read before any rank starts; [] when none."""
    import json
    import os

    from transformers import AutoConfig

    with open(os.path.join(hf_path, "config.json")) as f:
        target = _REGISTRY.get(json.load(f).get("model_type"))
    check = getattr(importlib.import_module(target.split(":")[0]), "unsupported", None) if target else None
    if check is None:  # no bridge (reported where the model type is checked) or nothing to check
        return []
    hf = fix_hf_config(AutoConfig.from_pretrained(hf_path))
    return list(check(fix_hf_config(hf.get_text_config())))


class ModelBridge:
    """Build / load / export a Megatron model for one HF checkpoint."""

    def __init__(self, hf_path: str, dtype: torch.dtype = torch.float32, spec: str = "auto",
                 routing_replay: bool = False, **config_overrides):
        """`spec`: the model.spec choice (specs.resolve_spec). `routing_replay` (or megatron's
        `moe_enable_routing_replay=True` among the overrides, which means the same): build R3
        routers. megatron's own flag then stays off in its config: it would register every router
        in megatron's process-global RouterReplay list; the R3 router keeps its state per model."""
        from transformers import AutoConfig

        self.hf_path = hf_path
        self.hf_config = fix_hf_config(AutoConfig.from_pretrained(hf_path))
        model_type = self.hf_config.model_type
        if model_type not in _REGISTRY:
            raise ValueError(f"no bridge for model_type {model_type!r}; registered: {sorted(_REGISTRY)}")
        module, cls = _REGISTRY[model_type].split(":")
        bridge_cls = getattr(importlib.import_module(module), cls)
        self.spec = specs.resolve_spec(spec, family=model_type)
        self.use_te = self.spec == "te"
        self.routing_replay = bool(config_overrides.pop("moe_enable_routing_replay", False) or routing_replay)
        self.impl = bridge_cls(self.hf_config, dtype=dtype)
        self.impl.layer_spec_choice = self.spec
        self.impl.family = model_type
        self.impl.routing_replay = self.routing_replay
        overrides = {} if self.use_te or torch.cuda.is_available() else dict(CPU_CONFIG)
        if not self.use_te:
            overrides.update(specs.LOCAL_CONFIG)
        else:
            overrides.update(specs.TE_CONFIG)
        overrides.update(config_overrides)
        self.impl.set_extra_args(**overrides)
        self.dtype = dtype

    @property
    def config(self):
        """The megatron TransformerConfig."""
        return self.impl.config

    @property
    def moe_layers(self) -> list[int]:
        """Global (0-based) numbers of the MoE layers."""
        if hasattr(self.impl, "moe_layer_numbers"):  # hybrid families: read off the layer pattern
            return list(self.impl.moe_layer_numbers)
        freq = self.config.moe_layer_freq
        n = self.config.num_layers
        if isinstance(freq, int):
            return [i for i in range(n) if i % freq == 0] if self.config.num_moe_experts else []
        return [i for i, f in enumerate(freq) if f]

    def build(self, load_weights: bool = True, wrap_with_ddp: bool = False, ddp_config: dict | None = None,
              post_model_creation_callbacks: list[Callable] = ()) -> list[torch.nn.Module]:
        """Model chunks for this rank (one per virtual pipeline stage), weights loaded from HF."""
        from skyrl_mega.megatron.model import instantiate_chunks

        provider = self.impl._model_provider(list(post_model_creation_callbacks))
        models = instantiate_chunks(provider, self.config, wrap_with_ddp=wrap_with_ddp, ddp_config=ddp_config)
        if load_weights:
            self.load_hf(models, self.hf_path)
        return models

    def build_meta(self) -> list[torch.nn.Module]:
        """This rank's model chunks on the meta device: names, shapes, dtypes and megatron's
        sharded-tensor metadata, no parameter memory (a few small buffers stay on the CPU)."""
        from skyrl_mega.megatron.model import instantiate_chunks

        with torch.device("meta"):
            return instantiate_chunks(self.impl._model_provider([]), self.config, wrap_with_ddp=False)

    def hf_sources(self, model: torch.nn.Module) -> dict[str, tuple[str, list[str]]]:
        """A chunk's state dict entries (no _extra_state) -> (megatron global name, the HF names
        it is made of), by mbridge's mapping (EP: global expert numbers)."""
        impl = self.impl
        return {local: (name, impl._weight_name_mapping_mcore_to_hf(name))
                for local, name in impl._weight_name_mapping_mcore_local_to_global(model).items()
                if "_extra_state" not in local}

    def local_from_hf(self, local: str, name: str, hf_tensors: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """One entry's tensor on this rank (its TP / expert-TP slice) from its whole HF tensors, as
        mbridge's load_weights makes it, without the scatter: every rank cuts its own slice.
        `local` / `name`: the entry's local and global names; `like`: the entry (shape, dtype)."""
        impl, mpu = self.impl, self.impl.mpu
        whole = impl._weight_to_mcore_format(local, hf_tensors)
        expert = ".mlp.experts.linear_fc" in name
        size, rank = (mpu.etp_size, mpu.etp_rank) if expert else (mpu.tp_size, mpu.tp_rank)
        out = list(impl._weight_split_across_tp(local, whole, like, size))[rank]
        out = out.to(dtype=like.dtype).contiguous()
        if out.untyped_storage().nbytes() != out.nbytes:  # a slice: its own copy, so `whole` is freed
            out = out.clone()
        if out.shape != like.shape:
            raise ValueError(f"{local}: HF tensors {[tuple(t.shape) for t in hf_tensors]} make {tuple(out.shape)} "
                             f"on this rank, the model holds {tuple(like.shape)}")
        return out

    def hf_from_whole(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The HF tensors of one whole (unsharded) megatron tensor, by its global name."""
        names, tensors = self.impl._weight_to_hf_format(name, tensor)
        return list(zip(names, tensors))

    def carried(self, names) -> list[str]:
        """Of an HF checkpoint's tensor names, those the model does not build but keeps (the
        family's CARRIED_PREFIXES): HF checkpoints written from the model copy them unchanged."""
        prefixes = tuple(getattr(self.impl, "CARRIED_PREFIXES", ()))
        return sorted(n for n in names if prefixes and n.startswith(prefixes))

    def carried_tensors(self, max_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
        """The source checkpoint's carried tensors, read at most about max_bytes at a time."""
        from skyrl_mega.checkpoint.hf_reader import HFReader, tensor_nbytes

        sizes = tensor_nbytes(self.hf_path)
        reader, group, size = HFReader(self.hf_path), [], 0
        for name in self.carried(sizes) + [None]:
            if group and (name is None or size + sizes[name] > max_bytes):
                yield from zip(group, reader.read(group))
                group, size = [], 0
            if name is not None:
                group.append(name)
                size += sizes[name]

    def source_layout(self):
        """The source checkpoint's ExpertLayout (checkpoint/expert_layout.py): "fused" or
        "per-expert"; the HF checkpoints written from the model keep it."""
        from skyrl_mega.checkpoint.hf_reader import expert_layout

        return expert_layout(self.hf_path)

    def write_config(self, out_dir: str) -> None:
        """The source checkpoint's config.json, copied as it is (the form the release wrote it
        in, e.g. Nemotron 3's `hybrid_override_pattern`, and every field transformers would drop
        or rewrite); a config without a file is saved by transformers."""
        import os
        import shutil

        src = os.path.join(self.hf_path, "config.json")
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, "config.json"))
        else:
            self.hf_config.save_pretrained(out_dir)

    def load_hf(self, models: list[torch.nn.Module], path: str) -> None:
        self.impl.load_weights(models, path)

    def export_hf(self, models: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every rank must iterate (collectives inside); all ranks see every tensor."""
        return self.impl.export_weights(models)

    def save_hf(self, models: list[torch.nn.Module], path: str, shard_bytes: int = 2 << 30) -> None:
        """Collective. Rank 0 writes HF safetensors shards + index + config (atomically: a
        temporary directory renamed at the end) in the source checkpoint's expert layout; the
        carried tensors come from the source."""
        import itertools
        import json
        import os
        import shutil

        import torch.distributed as dist
        from safetensors.torch import save_file

        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        tmp = path.rstrip("/") + ".partial"
        shard, size, files, index = {}, 0, [], {}

        def flush():
            nonlocal shard, size
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(tmp, name), metadata={"format": "pt"})
            files.append(name)
            index.update({k: name for k in shard})
            shard, size = {}, 0

        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        stream = itertools.chain(self.export_hf(models), self.carried_tensors(shard_bytes) if rank0 else ())
        if rank0:  # the source checkpoint's expert layout (fused experts fused again)
            stream = self.source_layout().fuse(stream)
        for name, tensor in stream:
            if not rank0:
                continue
            shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
            size += shard[name].numel() * shard[name].element_size()
            if size >= shard_bytes:
                flush()
        if rank0:
            if shard:
                flush()
            total = sum(os.path.getsize(os.path.join(tmp, f)) for f in files)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
            self.write_config(tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
        if dist.is_initialized():
            dist.barrier()


def bridge_for(hf_path: str, dtype: torch.dtype = torch.float32, spec: str = "auto",
               routing_replay: bool = False, **overrides) -> ModelBridge:
    return ModelBridge(hf_path, dtype=dtype, spec=spec, routing_replay=routing_replay, **overrides)
