"""transformers as the reference: per-token logprobs and the top-k experts the HF router picks."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch


class HFReference:
    def __init__(self, model_dir: str, weights_dtype: torch.dtype = torch.float32):
        """weights_dtype: the weights rounded to it (as an engine serving that dtype holds them);
        the reference computes in float32 either way."""
        from transformers import AutoConfig

        self.weights_dtype = weights_dtype
        self.config = AutoConfig.from_pretrained(model_dir)
        self.top_k = self.config.num_experts_per_tok
        self.load(model_dir)

    def load(self, model_dir: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.weights_dtype).float().eval()
        self.gates = {i: g for i, g in enumerate(map(_moe_gate, self._layers())) if g is not None}
        self.moe_layers = sorted(self.gates)

    def _layers(self):
        base = getattr(self.model, "model", None) or self.model.backbone  # NemotronH: backbone.*
        return base.layers

    @torch.no_grad()
    def score(self, prompt: list[int], response: list[int]):
        """(logprobs of the response tokens [R], routes [P+R, len(moe_layers), top_k] int64)."""
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for i in self.moe_layers:
            def hook(mod, inp, out, i=i):
                if isinstance(out, tuple) and len(out) == 3:  # (logits, weights, indices)
                    captured[i] = out[2]
                else:
                    logits = out[0] if isinstance(out, tuple) else out
                    captured[i] = torch.topk(torch.softmax(logits.float(), -1), self.top_k, -1).indices
            hooks.append(self.gates[i].register_forward_hook(hook))
        try:
            ids = torch.tensor([prompt + response])
            logits = self.model(ids).logits[0].float()
        finally:
            for h in hooks:
                h.remove()
        lp = torch.log_softmax(logits, -1)
        p = len(prompt)
        resp_lp = lp[p - 1 : p - 1 + len(response)].gather(1, torch.tensor(response)[:, None])[:, 0]
        routes = torch.stack([captured[i].reshape(len(prompt) + len(response), -1) for i in self.moe_layers], 1)
        return resp_lp.numpy(), routes.numpy()


def _moe_gate(layer):
    """The router of an MoE layer (Qwen3-MoE: mlp.gate; NemotronH: mixer.gate), else None."""
    for block in (getattr(layer, "mlp", None), getattr(layer, "mixer", None)):
        if block is not None and hasattr(block, "gate") and hasattr(block, "experts"):
            return block.gate
    return None


def perturbed_checkpoint(src_dir: str, dst_dir: str, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Writes src + noise as an HF checkpoint at dst_dir; returns the new HF-named tensors."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst_dir, exist_ok=True)
    for f in os.listdir(src_dir):
        if f != "model.safetensors":
            shutil.copy(os.path.join(src_dir, f), dst_dir)
    sd = load_file(os.path.join(src_dir, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    new = {k: (v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype)).contiguous() for k, v in sd.items()}
    save_file(new, os.path.join(dst_dir, "model.safetensors"), metadata={"format": "pt"})
    return new


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))
