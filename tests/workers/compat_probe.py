"""torchrun worker: checks each megatron-core CPU shim on real gloo ranks; rank 0 writes JSON.

First, before any shim: that megatron / torch fail here without each one (needed_*). Then the
shims' behaviour after `apply_cpu_shims()`.

Run: torchrun --nproc-per-node 2 tests/workers/compat_probe.py OUT.json
"""

import json
import sys

import torch
import torch.distributed as dist


def _raises(fn) -> bool:
    try:
        fn()
    except Exception:
        return True
    return False


def needs_before_shims(results):
    """Each CPU shim's failure without it, on the installed megatron-core and torch."""
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    results["needed_cuda_stubs"] = _raises(torch.cuda.current_device)
    results["needed_cuda_to_cpu_mode"] = _raises(lambda: torch.zeros(1, device="cuda"))
    results["needed_rng_tracker"] = _raises(lambda: mrandom.CudaRNGStatesTracker().add("probe", 7))
    results["needed_te_general_gemm"] = not hasattr(moe_utils, "te_general_gemm")
    # gloo with tensor split sizes, as megatron's EP dispatcher hands them on CPU
    out = torch.empty(2 * dist.get_world_size())
    splits = torch.full((dist.get_world_size(),), 2)
    results["needed_gloo_all_to_all"] = _raises(
        lambda: dist.all_to_all_single(out, torch.ones_like(out), splits, splits))
    results["needed_gloo_uneven_all_gather"] = _raises(lambda: dist.all_gather(
        [torch.empty(1 + r, 3) for r in range(dist.get_world_size())], torch.ones(1 + dist.get_rank(), 3)))


def main():
    from skyrl_mega import compat
    from skyrl_mega.compat import megatron_core

    results = {}
    assert not torch.cuda.is_available()
    dist.init_process_group("gloo")
    results["applied_before"] = compat.applied()
    needs_before_shims(results)
    applied = megatron_core.apply_cpu_shims()
    results["applied"] = list(applied)
    results["idempotent"] = megatron_core.apply_cpu_shims() == applied and len(set(applied)) == len(applied)
    results["recorded"] = compat.applied()
    results["guard_says_needed"] = [n for n in megatron_core.CPU_SHIMS if megatron_core.SHIMS_BY_NAME[n].needed_here()]

    # cuda_stubs
    results["current_device_is_cpu"] = torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    s = torch.cuda.Stream()
    e = torch.cuda.Event()
    e.record(s)
    torch.cuda.synchronize()
    results["stream_event_ok"] = e.query() is True

    # cuda_to_cpu_mode
    results["cuda_factory_on_cpu"] = torch.zeros(3, device="cuda").device.type == "cpu"
    t = torch.ones(2)
    results["dot_cuda_identity"] = t.cuda() is t
    results["float_type_reported_cuda"] = t.type() == "torch.cuda.FloatTensor"
    results["to_cuda_stays_cpu"] = t.to("cuda").device.type == "cpu"

    # te_general_gemm
    from megatron.core.transformer.moe import moe_utils

    results["te_general_gemm_none"] = moe_utils.te_general_gemm is None

    # gloo_all_to_all: tensor split sizes, uneven
    rank, world = dist.get_rank(), dist.get_world_size()
    send_counts = torch.tensor([1 + rank, 2 + rank])  # to rank 0, to rank 1
    inp = torch.cat([torch.full((int(c),), float(10 * rank + dst)) for dst, c in enumerate(send_counts)])
    recv_counts = torch.tensor([1 + src if rank == 0 else 2 + src for src in range(world)])  # from each src
    out = torch.empty(int(recv_counts.sum()))
    dist.all_to_all_single(out, inp, recv_counts, send_counts)
    expected = torch.cat([torch.full((int(c),), float(10 * src + rank)) for src, c in enumerate(recv_counts)])
    results["gloo_all_to_all_tensor_splits"] = bool(torch.equal(out, expected))

    # gloo_uneven_all_gather: rank r holds 1 + r rows of value r (megatron's path with split sizes)
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

    mine = torch.full((1 + rank, 3), float(rank))
    got = _gather_along_first_dim(mine, dist.group.WORLD, output_split_sizes=[1 + r for r in range(world)])
    want = torch.cat([torch.full((1 + r, 3), float(r)) for r in range(world)])
    even = [torch.empty(2) for _ in range(world)]
    dist.all_gather(even, torch.full((2,), float(rank)))
    results["gloo_uneven_all_gather_rows"] = bool(torch.equal(got, want)) and all(
        torch.equal(t, torch.full((2,), float(r))) for r, t in enumerate(even))

    # rng_tracker through megatron's own seeding
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    mpu.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outer_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    results["fork_restores_outer_state"] = bool(torch.equal(outer_before, torch.get_rng_state()))
    with tracker.fork():
        b = torch.rand(4)
    results["fork_stream_advances"] = not torch.equal(a, b)
    expected_a = torch.Generator().manual_seed(123 + 2718 + rank)
    results["fork_uses_tp_rank_seed"] = bool(torch.equal(a, torch.rand(4, generator=expected_a)))
    gathered = [torch.empty(4) for _ in range(world)]
    dist.all_gather(gathered, a)
    results["tp_ranks_differ"] = not torch.equal(gathered[0], gathered[1])
    states = tracker.get_states()
    tracker.set_states({k: v.clone() for k, v in states.items()})
    with tracker.fork():
        c = torch.rand(4)
    tracker.set_states(states)
    with tracker.fork():
        d = torch.rand(4)
    results["states_round_trip"] = bool(torch.equal(c, d))
    mpu.destroy_model_parallel()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
