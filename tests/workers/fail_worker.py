"""torchrun worker: fails on purpose, to test how errors leave the ranks (skyrl_mega/errors.py).

Run: torchrun --nproc-per-node N tests/workers/fail_worker.py {user|crash} RANKS
`user`: the ranks in RANKS (comma list) raise a UserError naming their rank, the others wait
in a barrier (the failing rank's peers are gone when it exits). `crash`: they raise a RuntimeError.
"""

import sys

import torch.distributed as dist

from skyrl_mega.errors import UserError, run_rank


def main(argv):
    mode, ranks = argv[0], {int(r) for r in argv[1].split(",")}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    if rank in ranks:
        if mode == "user":
            raise UserError(f"rank {rank}: the input is wrong: fix it")
        raise RuntimeError(f"rank {rank} crashed")
    dist.barrier()  # never completes: a peer raised


if __name__ == "__main__":
    sys.exit(run_rank(main, sys.argv[1:]))
