"""`skyrl-mega convert` streams: a ~320 MB model converts both ways at world size 1 with each
rank's peak resident memory (the ranks' max RSS, read by the kernel: getrusage of the waited-for
descendants of a fresh process) within half the model's size above what converting the
tiny model costs; the round trip through 32 MiB files is bit-exact.

The previous convert built the whole model and loaded every HF tensor before saving (and
gathered every tensor before writing HF): its peak exceeded the tiny baseline by about twice the
model's size, so this test failed on it."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from .conftest import REPO

pytestmark = pytest.mark.multiprocess
BIG = dict(hidden_size=512, intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=6,
           num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, mlp_only_layers=[])

_MEASURE = """
import json, resource, sys
from skyrl_mega import cli
rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "max_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _peak(*args):
    """Runs `skyrl-mega convert ARGS` from a fresh process: (exit code, the ranks' max RSS in bytes)."""
    p = subprocess.run([sys.executable, "-c", _MEASURE, "convert", *args], capture_output=True, text=True,
                       cwd=REPO, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stdout + p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, p.stderr
    return out["max_rss"]


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    from skyrl_mega.models.tiny import make_tiny

    return make_tiny("qwen3_moe", str(tmp_path_factory.mktemp("convert_big") / "hf"), **BIG)


@pytest.mark.slow
def test_convert_streams_both_ways_bit_exact(big_model, tiny_qwen3_moe, tmp_path):
    size = os.path.getsize(os.path.join(big_model, "model.safetensors"))
    assert size > 300e6
    baseline = _peak("hf-to-mcore", tiny_qwen3_moe, str(tmp_path / "tiny_mcore"))
    mcore, back = str(tmp_path / "mcore"), str(tmp_path / "hf")
    to_mcore = _peak("hf-to-mcore", big_model, mcore, "--shard-size", "32MiB")
    to_hf = _peak("mcore-to-hf", mcore, back, "--hf", big_model, "--shard-size", "32MiB")
    limit = baseline + 0.5 * size  # the previous convert: +2.4x (hf-to-mcore), +2.9x (mcore-to-hf)
    assert to_mcore < limit and to_hf < limit, (f"model {size / 2**20:.0f} MiB, tiny baseline "
                                                f"{baseline / 2**20:.0f} MiB, peaks {to_mcore / 2**20:.0f} / "
                                                f"{to_hf / 2**20:.0f} MiB")
    assert len(glob.glob(os.path.join(mcore, "__0_*.distcp"))) > 3  # one bounded file at a time
    files = glob.glob(os.path.join(back, "model-*-of-*.safetensors"))
    assert len(files) > 3
    original, converted = load_file(os.path.join(big_model, "model.safetensors")), {}
    for f in files:
        converted.update(load_file(f))
    assert sorted(converted) == sorted(original)
    assert all(torch.equal(converted[k], original[k]) for k in original)
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"]
    assert sorted(index) == sorted(original)
