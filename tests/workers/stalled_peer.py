"""A transfer-group peer that receives the first bucket, then stops receiving but stays alive
(like a vLLM worker left behind when its API server was killed mid-sync), then exits.

Run: python tests/workers/stalled_peer.py ADDRESS PORT RANK WORLD GROUP FIRST_NBYTES LINGER_S
"""

import sys
import time

import torch

from skyrl_mega.weight_sync.protocol import Communicator


def main():
    addr, port, rank, world, group, first, linger = sys.argv[1:8]
    comm = Communicator("gloo", addr, int(port), int(rank), int(world), 60.0, "cpu", group=group)
    comm.broadcast(torch.empty(int(first), dtype=torch.uint8), 0).wait()
    time.sleep(float(linger))


if __name__ == "__main__":
    main()
