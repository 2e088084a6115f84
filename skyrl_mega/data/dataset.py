"""Prompt datasets: rows of the layouts users have -> tokenized prompts, and a resumable sampler.

In: a jsonl file, a parquet file (verl / SkyRL: `prompt` as chat messages,
`reward_model: {ground_truth}`, `data_source`, `extra_info`) or a directory written by HF
`datasets` (`save_to_disk`; read with pyarrow). A row holds `prompt` (a string, or chat
messages [{role, content}]), `ground_truth` (or `reward_model.ground_truth`), and optionally
`data_source` and `extra_info`. `standard_row` checks one and gives it in the standard layout
{prompt, ground_truth, data_source, extra_info} (what `skyrl-mega data` writes); a malformed
row is a DatasetError naming the file and the row (1-based; in jsonl, the line).
Out: PromptItems with token ids, filtered by length (counts reported), and a PromptSampler
whose position (epoch, cursor) goes into checkpoints so a resumed run sees the same prompts.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError

STANDARD_FIELDS = ("prompt", "ground_truth", "data_source", "extra_info")


@dataclass
class PromptItem:
    index: int
    prompt_ids: list[int]
    ground_truth: Any
    data_source: str
    meta: dict = field(default_factory=dict)


class DatasetError(UserError, ValueError):
    """A dataset the user can fix; the message names the file (and the row)."""


def read_rows(path: str) -> list[tuple[int, Any]]:
    """(row number, row) of every row: a .jsonl / .json (one object per line) or .parquet file,
    or a `datasets` save_to_disk directory."""
    if not os.path.exists(path):
        raise DatasetError(f"dataset {path!r} does not exist")
    if os.path.isdir(path):
        return list(enumerate(_read_saved_dataset(path), 1))
    if path.endswith(".jsonl") or path.endswith(".json"):
        return _read_jsonl(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    raise DatasetError(f"dataset {path!r}: expected .jsonl, .parquet or a directory written by datasets' save_to_disk")


def _read_jsonl(path: str) -> list[tuple[int, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path} row {n}: not valid JSON ({e.msg})") from None
    return rows


def _read_saved_dataset(path: str) -> list[dict]:
    """A `Dataset.save_to_disk` directory: state.json lists its Arrow stream files."""
    splits = os.path.join(path, "dataset_dict.json")
    if os.path.exists(splits):  # a DatasetDict: one directory per split
        names = json.load(open(splits)).get("splits", [])
        raise DatasetError(f"{path} holds the splits {names} of a DatasetDict: give one split's directory, "
                           f"e.g. {os.path.join(path, names[0] if names else 'train')}")
    state = os.path.join(path, "state.json")
    if not os.path.exists(state):
        raise DatasetError(f"{path} is a directory but not one written by datasets' save_to_disk (no state.json)")
    import pyarrow as pa

    tables = []
    for entry in json.load(open(state))["_data_files"]:
        with pa.memory_map(os.path.join(path, entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    return pa.concat_tables(tables).to_pylist() if tables else []


def _ground_truth(where: str, row: dict) -> Any:
    if "ground_truth" in row:
        return row["ground_truth"]
    rm = row.get("reward_model")
    if rm is None:
        return None
    if not isinstance(rm, dict):
        raise DatasetError(f"{where}: 'reward_model' must be an object with 'ground_truth', got {_short(rm)}")
    return rm.get("ground_truth")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_prompt(where: str, prompt: Any) -> None:
    """A string, or chat messages: a list of {role: str, content: str or content parts}."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list):
        for k, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                    not isinstance(m.get("content"), (str, list)):
                raise DatasetError(f"{where}: prompt message {k} must be {{role: str, content: str}}, got {_short(m)}")
        return
    raise DatasetError(f"{where}: 'prompt' must be a string or chat messages [{{role, content}}], "
                       f"got {type(prompt).__name__} {_short(prompt)}")


def standard_row(path: str, n: int, row: Any, default_source: str = "default") -> dict:
    """Row `n` of `path` in the standard layout {prompt, ground_truth, data_source, extra_info}."""
    where = f"{path} row {n}"
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with a 'prompt', got {type(row).__name__}")
    if "prompt" not in row:
        raise DatasetError(f"{where}: no 'prompt' field (keys: {sorted(row)})")
    _check_prompt(where, row["prompt"])
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DatasetError(f"{where}: 'data_source' must be a string, got {_short(source)}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DatasetError(f"{where}: 'extra_info' must be an object, got {_short(extra)}")
    return {"prompt": row["prompt"], "ground_truth": _ground_truth(where, row),
            "data_source": source or default_source, "extra_info": extra or {}}


def is_empty(prompt: Any) -> bool:
    """No text: an empty or blank string, or messages whose contents are all empty."""
    if isinstance(prompt, str):
        return not prompt.strip()
    return not any(m["content"].strip() if isinstance(m["content"], str) else m["content"] for m in prompt)


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
    for i, (n, row) in enumerate(rows):
        std = standard_row(path, n, row, default_source)
        ids = [] if is_empty(std["prompt"]) else tokenize_prompt(tokenizer, std["prompt"], chat_template)
        if not ids:
            counts["empty"] += 1
            continue
        if max_prompt_len and len(ids) > max_prompt_len:
            counts["too_long"] += 1
            continue
        items.append(PromptItem(i, ids, std["ground_truth"], std["data_source"],
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
