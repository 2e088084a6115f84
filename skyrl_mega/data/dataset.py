"""Prompt datasets: jsonl or parquet rows -> tokenized prompts, and a resumable sampler.

In: a file whose rows hold `prompt` (a string, or chat messages [{role, content}]),
`ground_truth` (or `reward_model: {ground_truth}`, the HF/verl layout) and `data_source`.
Out: PromptItems with token ids, filtered by length (counts reported), and a PromptSampler
whose position (epoch, cursor) goes into checkpoints so a resumed run sees the same prompts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PromptItem:
    index: int
    prompt_ids: list[int]
    ground_truth: Any
    data_source: str
    meta: dict = field(default_factory=dict)


class DatasetError(ValueError):
    pass


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise DatasetError(f"dataset {path!r} does not exist")
    if path.endswith(".jsonl") or path.endswith(".json"):
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        return rows
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise DatasetError(f"dataset {path!r}: expected .jsonl or .parquet")


def _ground_truth(row: dict) -> Any:
    if "ground_truth" in row:
        return row["ground_truth"]
    rm = row.get("reward_model") or {}
    return rm.get("ground_truth")


def tokenize_prompt(tokenizer, prompt: Any, chat_template: bool) -> list[int]:
    if isinstance(prompt, list):  # chat messages
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    if chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tokenizer(prompt, add_special_tokens=False).input_ids)


def load_prompts(path: str, tokenizer, *, chat_template: bool = True, max_prompt_len: int | None = None,
                 default_source: str = "default") -> tuple[list[PromptItem], dict[str, int]]:
    """Returns (items, counts) where counts has total / kept / too_long / empty."""
    rows = read_rows(path)
    items, counts = [], {"total": len(rows), "kept": 0, "too_long": 0, "empty": 0}
    for i, row in enumerate(rows):
        if "prompt" not in row:
            raise DatasetError(f"{path}: row {i} has no 'prompt' field (keys: {sorted(row)})")
        ids = tokenize_prompt(tokenizer, row["prompt"], chat_template)
        if not ids:
            counts["empty"] += 1
            continue
        if max_prompt_len and len(ids) > max_prompt_len:
            counts["too_long"] += 1
            continue
        items.append(PromptItem(i, ids, _ground_truth(row), row.get("data_source", default_source),
                                {k: v for k, v in row.items() if k not in ("prompt",)}))
    counts["kept"] = len(items)
    if not items:
        raise DatasetError(f"{path}: no prompts left after filtering ({counts})")
    return items, counts


class PromptSampler:
    """Shuffled epochs, `batch_size` prompts per step; state() / load_state() for checkpoints."""

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > num_items:
            raise DatasetError(f"batch of {batch_size} prompts but the dataset has only {num_items}")
        self.num_items, self.batch_size, self.seed, self.shuffle = num_items, batch_size, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(self.num_items))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next_batch(self) -> list[int]:
        if self.cursor + self.batch_size > self.num_items:  # drop the ragged tail
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make_order()
        batch = self._order[self.cursor:self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return batch

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "num_items": self.num_items}

    def load_state(self, state: dict) -> None:
        if state["num_items"] != self.num_items or state["seed"] != self.seed:
            raise DatasetError(f"sampler state is for {state['num_items']} items / seed {state['seed']}, "
                               f"this dataset has {self.num_items} / seed {self.seed}")
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._make_order()
