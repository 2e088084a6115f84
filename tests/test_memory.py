"""The run's memory per GPU (skyrl_mega/config/memory.py): its parameter count is transformers'
model's; `skyrl-mega validate` prints its table, and the large recipes' headers are that table;
a layout that cannot fit is refused in one line naming its largest item."""

import json
import os
import shutil

import pytest
import torch

from skyrl_mega import cli
from skyrl_mega.config import memory
from skyrl_mega.config.loader import resolve_recipe
from skyrl_mega.config.validate import read_hf_config
from skyrl_mega.models.tiny import make_tiny, nemotron_released_config

RECIPES = {  # recipe -> the make-tiny shapes of its model
    "nemotron3/nano_30b_a3b": ("nemotron3", "30b_a3b"),
    "qwen3_5_moe/35b_a3b": ("qwen3_5_moe", "35b_a3b"),
    "qwen3_5_moe/397b_a17b": ("qwen3_5_moe", "397b_a17b"),
}
# NVIDIA-Nemotron-3-Nano-30B-A3B's released config.json names its layers so
NANO_RELEASED_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _nemotron_released_form(src: str, dst: str) -> str:
    """The checkpoint with config.json as released: `hybrid_override_pattern`, not transformers
    5's `layers_block_type` list."""
    shutil.copytree(src, dst)
    nemotron_released_config(dst)
    with open(os.path.join(dst, "config.json")) as f:
        assert json.load(f)["hybrid_override_pattern"] == NANO_RELEASED_PATTERN
    return dst


def _qwen3_5_multimodal_form(src: str, dst: str) -> str:
    """The checkpoint's config as Qwen3.5's released multimodal config nests it (text_config)."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        text = json.load(f)
    with open(path, "w") as f:
        json.dump({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                   "text_config": text, "vision_config": {"depth": 1}}, f, indent=2)
    return dst


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Config-only checkpoints (make-tiny --config-only) of the large recipes' models, and the
    Nemotron one in its released config form; plus a prompts file."""
    root = tmp_path_factory.mktemp("shapes")
    out = {size: make_tiny(family, str(root / size), size=size, weights=False, dtype="bfloat16")
           for family, size in RECIPES.values()}
    out["30b_a3b_released"] = _nemotron_released_form(out["30b_a3b"], str(root / "30b_a3b_released"))
    out["35b_a3b_multimodal"] = _qwen3_5_multimodal_form(out["35b_a3b"], str(root / "35b_a3b_multimodal"))
    (root / "p.jsonl").write_text('{"prompt": "hi", "answer": "1"}\n')
    out["prompts"] = str(root / "p.jsonl")
    return out


def _validate(capsys, recipe, model, prompts, *overrides):
    rc = cli.main(["validate", "--recipe", recipe, f"model.path={model}", f"data.train_path={prompts}", *overrides])
    out, err = capsys.readouterr()
    return rc, out, err


def _table(text: str, prefix: str = "") -> list[str]:
    """The memory table's lines in `text` (from "memory per GPU" to "peak"), `prefix` removed."""
    lines = [ln[len(prefix):].rstrip() for ln in text.splitlines() if ln.startswith(prefix)]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("memory per GPU"))
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("  peak"))
    return lines[start:end + 1]


@pytest.mark.parametrize("model", ["tiny_qwen3_moe", "tiny_qwen3_5_moe", "tiny_nemotron3", "30b_a3b",
                                   "30b_a3b_released", "35b_a3b", "35b_a3b_multimodal", "397b_a17b"])
def test_parameter_count_is_transformers_models(model, shapes, request):
    """Total and routed-expert parameters, exact, against the model transformers builds from the
    same config.json on the meta device (MTP layers and vision towers are built by neither)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = request.getfixturevalue(model) if model.startswith("tiny") else shapes[model]
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(getattr(config, "text_config", config))
    shape = memory.model_shape(read_hf_config(path))
    assert shape.total == sum(p.numel() for p in hf.parameters())
    assert shape.experts == sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n) > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_large_recipe_is_accepted_and_its_header_is_the_table(recipe, shapes, capsys):
    """`validate` accepts each large recipe on its model's shapes and prints the table; the
    recipe's header holds exactly that table (regenerate it from this output when it changes)."""
    rc, out, err = _validate(capsys, recipe, shapes[RECIPES[recipe][1]], shapes["prompts"])
    assert rc == 0, err
    assert "config OK for world size" in out
    table = _table(out)
    with open(resolve_recipe(recipe)) as f:
        header = _table(f.read(), prefix="# ")
    assert header == table, "recipe header != `skyrl-mega validate` output; paste:\n" + "\n".join(
        f"# {ln}".rstrip() for ln in table)


@pytest.mark.parametrize("recipe, form, transformers_form", [
    ("nemotron3/nano_30b_a3b", "30b_a3b_released", "30b_a3b"),
    ("qwen3_5_moe/35b_a3b", "35b_a3b_multimodal", "35b_a3b"),
])
def test_released_config_forms_give_the_same_table(recipe, form, transformers_form, shapes, capsys):
    rc, out, err = _validate(capsys, recipe, shapes[form], shapes["prompts"])
    assert rc == 0, err
    assert _table(out) == _table(_validate(capsys, recipe, shapes[transformers_form], shapes["prompts"])[1])


@pytest.mark.parametrize("recipe, overrides, largest", [
    ("qwen3_5_moe/35b_a3b", ["parallel.ep=1", "parallel.world_size=1"], "optimizer state"),
    ("qwen3_5_moe/35b_a3b", ["parallel.ep=4", "parallel.world_size=4"], "optimizer state"),  # the header says so
    ("qwen3_5_moe/35b_a3b", ["train.max_tokens_per_microbatch=8192"], "activations"),  # the header says so
    ("nemotron3/nano_30b_a3b", ["parallel.ep=4", "parallel.world_size=4"], "optimizer state"),  # the header says so
    ("nemotron3/nano_30b_a3b", ["parallel.gpu_memory_gib=40"], "optimizer state"),
    ("qwen3_5_moe/397b_a17b", ["parallel.gpu_memory_gib=80"], "engine weights"),  # the header says so
    ("qwen3_5_moe/397b_a17b", ["placement=colocated"], "engine weights"),  # the header says so
])
def test_a_layout_that_cannot_fit_is_refused_in_one_line(recipe, overrides, largest, shapes, capsys):
    rc, out, err = _validate(capsys, recipe, shapes[RECIPES[recipe][1]], shapes["prompts"], *overrides)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, err
    assert "parallel.gpu_memory_gib=" in err and f"the largest item is {largest}, " in err, err
    assert "Traceback" not in err and "memory per GPU" not in out


def test_train_refuses_it_before_torchrun(shapes, capsys):
    rc = cli.main(["train", "--recipe", "qwen3_5_moe/35b_a3b", f"model.path={shapes['35b_a3b']}",
                   f"data.train_path={shapes['prompts']}", "parallel.ep=1", "parallel.world_size=1",
                   "--entry", "no_such_module_would_fail_if_launched"])
    out, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "the largest item is optimizer state, " in err and "no_such_module" not in err + out


def test_tiny_cpu_recipe_fits_and_shows_its_table(tiny_qwen3_moe, capsys):
    rc = cli.main(["validate", "--recipe", cli.DEFAULT_RECIPE, f"model.path={tiny_qwen3_moe}"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    peak = _table(out)[-1].split()
    assert peak[0] == "peak" and float(peak[1]) < 2.0  # GiB: the tiny model and its 1 GiB KV cache


def test_activations_of_a_plain_gpt_layer_are_the_papers():
    """Korthikanti et al. (2022) count 34 h bytes per token for a GPT layer in 16-bit (flash
    attention, no s^2 scores); 2 h of them are dropout masks, which these layers lack: 32 h."""
    h = 1024
    mha = {"num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": h // 16}
    layer = memory._attention(h, mha, gated=False, qk_norm=False) + memory._mlp(h, 4 * h, gated=False)
    assert 2 * layer.act == 32 * h
