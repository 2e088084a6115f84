"""Routed experts stored fused (released Qwen3.5-MoE: `experts.gate_up_proj` [E, 2 x ffn, hidden],
gate rows first, `experts.down_proj` [E, hidden, ffn], no `.weight`) or one tensor per expert:
both read as the same per-expert tensors, every HF checkpoint written keeps its source's layout
bit for bit (convert and the trainer's save of the released layout: tests/test_convert.py
test_carried_tensors_come_back_unchanged), transformers gives the same logits from both, and
both train to the same weights."""

import glob
import os

import pytest
import torch
from safetensors.torch import load_file

from skyrl_mega import cli
from skyrl_mega.checkpoint.expert_layout import ExpertLayout, fused_shapes, read_part
from skyrl_mega.checkpoint.hf_reader import HFReader
from skyrl_mega.models.tiny import make_tiny

from .conftest import REPO


def _tensors(hf_dir: str) -> dict:
    out = {}
    for f in glob.glob(os.path.join(hf_dir, "*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same seeded weights in the released layout (multimodal, fused, with an MTP layer) and
    per expert."""
    d = tmp_path_factory.mktemp("layouts")
    fused = make_tiny("qwen3_5_moe", str(d / "fused"), multimodal=True, mtp=True)
    per = make_tiny("qwen3_5_moe", str(d / "per"), multimodal=True, mtp=True, expert_layout="per-expert")
    return fused, per


def test_parts_are_slices_and_fuse_back_exactly():
    """Expert e's gate / up / down are gate_up[e, :F], gate_up[e, F:], down[e]; fusing them
    again, in any arrival order, gives the same bytes."""
    E, F, H = 3, 4, 5
    gate_up, down = torch.randn(E, 2 * F, H), torch.randn(E, H, F)
    stored = {"m.layers.0.mlp.experts.gate_up_proj": gate_up, "m.layers.0.mlp.experts.down_proj": down,
              "m.norm.weight": torch.randn(H)}
    layout = ExpertLayout({n: list(t.shape) for n, t in stored.items()})
    assert layout.name == "fused" and len(layout.parts) == 3 * E
    view = layout.view(stored)
    assert "m.norm.weight" in view and "m.layers.0.mlp.experts.2.up_proj.weight" in view
    parts = {}
    for name in view:
        p = layout.parts.get(name)
        if p is None:
            parts[name] = stored[name]
        else:
            whole = stored[p.stored][p.expert]
            parts[name] = whole if p.rows is None else whole[p.rows]
    assert torch.equal(parts["m.layers.0.mlp.experts.1.gate_proj.weight"], gate_up[1, :F])
    assert torch.equal(parts["m.layers.0.mlp.experts.1.up_proj.weight"], gate_up[1, F:])
    assert torch.equal(parts["m.layers.0.mlp.experts.2.down_proj.weight"], down[2])
    again = dict(layout.fuse(reversed(list(parts.items()))))
    assert sorted(again) == sorted(stored) and all(torch.equal(again[k], stored[k]) for k in stored)
    assert fused_shapes({k: list(v.shape) for k, v in parts.items()}) == {
        k: list(v.shape) for k, v in stored.items() if "experts" in k}
    with pytest.raises(ValueError, match="incomplete"):
        list(layout.fuse(list(parts.items())[:-2]))
    assert ExpertLayout({"m.layers.0.mlp.experts.0.down_proj.weight": [H, F]}).name == "per-expert"


def test_released_layout_by_default(both):
    fused, per = both
    names = set(_tensors(fused))
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.language_model.layers.0.mlp.experts.down_proj" in names
    assert not any(".mlp.experts.0." in n for n in names if not n.startswith("mtp."))
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in names  # the MTP layer stays per expert
    assert HFReader(fused).layout.name == "fused" and HFReader(per).layout.name == "per-expert"


def test_both_layouts_read_as_the_same_tensors(both):
    fused, per = both
    a, b = HFReader(fused), HFReader(per)
    assert sorted(a.files) == sorted(b.files)
    names = sorted(b.files)
    assert all(torch.equal(x, y) for x, y in zip(a.read(names), b.read(names)))
    assert a.nbytes() == b.nbytes() and a.dtypes() == b.dtypes()
    with __import__("safetensors").safe_open(glob.glob(f"{fused}/*.safetensors")[0], "pt") as f:
        part = a.layout.parts["model.language_model.layers.1.mlp.experts.5.up_proj.weight"]
        assert torch.equal(read_part(f, part), f.get_tensor(part.stored)[5, part.rows])


def test_transformers_gives_the_same_logits_from_both(both):
    """transformers loads the fused layout natively (its own parameters are fused) and converts
    per-expert tensors on load: the same logits is the check that gate rows come first."""
    from transformers import AutoModelForImageTextToText

    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = []
    for path in both:
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(input_ids=ids).logits)
    assert torch.equal(logits[0], logits[1])


def test_make_tiny_refuses_fused_for_families_released_per_expert(tmp_path, capsys):
    assert cli.main(["make-tiny", "qwen3_moe", str(tmp_path / "q"), "--expert-layout", "fused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "only qwen3_5_moe releases fuse their experts" in err[0]


def test_validate_names_the_layout(both, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi", "answer": "1"}\n')
    for path, want in zip(both, ("routed experts fused (8 fused tensors)", "routed experts per-expert")):
        assert cli.main(["validate", "--recipe", "qwen3_5_moe/tiny_cpu", f"model.path={path}",
                         f"data.train_path={prompts}"]) == 0
        assert want in capsys.readouterr().out


@pytest.mark.multiprocess
def test_both_layouts_train_to_the_same_weights(both, tmp_path):
    """Three RL updates at EP=2 from each copy: the trained weights agree exactly (tolerance 0:
    the same numbers land in the same megatron tensors, fp32, same seeds), each save keeps its
    source's layout, and training moved the weights."""
    from skyrl_mega.launcher import run_torchrun

    worker = os.path.join(REPO, "tests/workers/expert_layout_train_worker.py")
    outs = []
    for src, name in zip(both, ("fused", "per")):
        out = str(tmp_path / name)
        run_torchrun(worker, 2, [src, out, "3", "parallel.ep=2"], timeout=600)
        outs.append(out)
    for src, out in zip(both, outs):
        assert sorted(_tensors(out)) == sorted(_tensors(src))  # the layout kept
    trained = [HFReader(o) for o in outs]
    names = sorted(trained[1].files)
    a, b = trained[0].read(names), trained[1].read(names)
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) == 0.0
    start = HFReader(both[1]).read(names)
    moved = [n for n, x, s in zip(names, b, start) if not torch.equal(x, s)]
    assert any(".mlp.experts.3.gate_proj" in n for n in moved) and len(moved) > len(names) // 2
