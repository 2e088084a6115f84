"""The demo's synthetic task, generated at run time.

Out: a jsonl file of prompts like "repeat the number 7" with ground truth "7" and
data_source "digits", scored by the `digits` reward (dense, in [0, 1]).
"""

from __future__ import annotations

import json
import os
import random

TEMPLATES = ["repeat the number {d}", "what number: {d} {d} {d}", "copy {d} and repeat it",
             "the answer is {d} {d}", "count {d} {d}"]


def write_digits_task(path: str, n: int = 256, digits: str = "7", seed: int = 0) -> str:
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for _ in range(n):
            d = rng.choice(digits)
            f.write(json.dumps({"prompt": rng.choice(TEMPLATES).format(d=d), "ground_truth": d,
                                "data_source": "digits"}) + "\n")
    os.replace(tmp, path)
    return path
