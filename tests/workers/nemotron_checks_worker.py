"""torchrun worker (world size 1): what the Nemotron 3 parity tests rest on, measured.

    torchrun --nproc-per-node 1 tests/workers/nemotron_checks_worker.py HF_DIR OUT.json

Max abs logit difference vs transformers of the Megatron model built by the bridge: as loaded;
with the routed scaling factor dropped (1.0, a bug peers' users hit); with the routers'
score-correction bias zeroed (a bias lost in export / sync). Each broken build must be far off,
else the parity tests would not see these bugs on this checkpoint. Also the fraction of
(token, MoE layer) top-k sets the zeroed bias changes.
"""

import json
import sys

import torch

from skyrl_mega.megatron import parallel


def main():
    hf_dir, out = sys.argv[1], sys.argv[2]
    parallel.init_distributed()
    parallel.init_layout(tp=1)
    from transformers import AutoModelForCausalLM

    from bridges import bridge_for

    ids = torch.randint(0, 500, (4, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(ids).logits

    def diff(model):
        with torch.no_grad():
            return float((model(ids, pos, None) - ref).abs().max())

    def topk_sets(model):
        """The routers' routing maps (megatron's TopKRouter returns (probs, routing_map)),
        stacked [moe_layers, tokens, experts]."""
        chosen, hooks = [], []
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if router is not None:
                hooks.append(router.register_forward_hook(lambda m, i, o: chosen.append(o[1].detach().clone())))
        with torch.no_grad():
            model(ids, pos, None)
        for h in hooks:
            h.remove()
        return torch.stack(chosen)

    res = {}
    bridge = bridge_for(hf_dir)
    (model,) = bridge.build()
    model.eval()
    res["as_loaded"] = diff(model)
    maps = topk_sets(model)
    for layer in model.decoder.layers:
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if router is not None:
            router.expert_bias.zero_()
    res["bias_zeroed"] = diff(model)
    res["bias_zeroed_routes_changed"] = float((topk_sets(model) != maps).any(-1).float().mean())
    (unscaled,) = bridge_for(hf_dir, moe_router_topk_scaling_factor=1.0).build()
    unscaled.eval()
    res["scaling_dropped"] = diff(unscaled)
    res["routed_scaling_factor"] = float(bridge.hf_config.routed_scaling_factor)
    with open(out, "w") as f:
        json.dump(res, f)
    parallel.destroy()


if __name__ == "__main__":
    main()
