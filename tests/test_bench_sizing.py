"""The weight-sync benchmark sizes itself to the GPU it runs on: the largest qwen3_moe shape whose
memory (trainer weights + gradients, engine weights + the reload's copy, KV cache) fits the free
memory, or one line saying what the smallest needs."""

import importlib.util
import os

from skyrl_mega.models.tiny import parameter_count

from .conftest import REPO

GiB = 2**30


def _bench():
    spec = importlib.util.spec_from_file_location("vllm_weight_sync", os.path.join(REPO, "bench/vllm_weight_sync.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_picks_the_largest_shape_that_fits():
    bench = _bench()
    params = {s: parameter_count("qwen3_moe", s) for s in bench.SYNC_SIZES}
    assert 14.5e9 < params["15b"] < 15.5e9 and 9.5e9 < params["8b"] < 10.3e9  # the shapes' documented sizes
    count = params.__getitem__
    # an 80 GB H100 (about 78 GiB free): 8b measured out of memory there, so 2b
    assert bench.pick_size(78 * GiB, count)[0] == "2b"
    # a 141 GB H200 (about 139 GiB free): the 29.9 GB 15b ran there
    size, why = bench.pick_size(139 * GiB, count)
    assert size == "15b" and "needs" in why
    assert bench.pick_size(bench.need_bytes(params["8b"]), count)[0] == "8b"  # exactly enough
    assert bench.pick_size(bench.need_bytes(params["8b"]) - 1, count)[0] == "2b"
    size, why = bench.pick_size(8 * GiB, count)
    assert size is None and "smallest shape (2b" in why and "8.0 GiB free" in why and "\n" not in why
