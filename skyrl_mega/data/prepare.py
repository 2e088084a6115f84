"""`skyrl-mega data`: prompt datasets as users have them -> one file in the standard layout.

In: sources (jsonl, verl / SkyRL parquet, directories written by HF datasets' save_to_disk:
whatever dataset.read_rows reads), optionally a tokenizer and a prompt-length limit.
Out: OUT (.jsonl or .parquet) holding one row {prompt, ground_truth, data_source, extra_info}
per kept prompt (dataset.standard_row; `data.train_path` reads it as it is), written to a
temporary file and renamed (nothing partial is left on failure); and a Report: rows per file,
empty prompts, duplicates (the same prompt as an earlier row), too long prompts (with a
tokenizer and max_prompt_len), rows without a ground truth, kept rows per data_source.
Empty, duplicate and too long prompts are left out (duplicates kept with keep_duplicates);
rows without a ground truth are kept (a reward may not need one). A malformed row stops it
with a DatasetError naming the file and the row.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field

from .dataset import DatasetError, is_empty, read_rows, standard_row, tokenize_prompt

OUT_FORMATS = (".jsonl", ".parquet")


@dataclass
class Report:
    files: list[tuple[str, int]] = field(default_factory=list)  # (path, rows)
    rows: int = 0
    kept: int = 0
    empty: int = 0
    duplicates: int = 0
    too_long: int = 0
    no_ground_truth: int = 0
    by_source: Counter = field(default_factory=Counter)  # kept rows
    max_prompt_len: int | None = None
    longest: int | None = None  # tokens of the longest kept prompt (with a tokenizer)

    def lines(self) -> list[str]:
        too_long = f", too long {self.too_long} (> {self.max_prompt_len} tokens)" if self.max_prompt_len else ""
        out = [f"{path}: {n} rows" for path, n in self.files]
        out.append(f"rows {self.rows}: kept {self.kept}, empty {self.empty}, duplicates {self.duplicates}"
                   f"{too_long}, without ground truth {self.no_ground_truth} (kept)")
        out.append("kept per data_source: " + (", ".join(f"{s} {n}" for s, n in sorted(self.by_source.items()))
                                               or "none"))
        if self.longest is not None:
            out.append(f"longest kept prompt: {self.longest} tokens")
        return out


def read_standard(sources: list[str]) -> tuple[list[dict], list[tuple[str, int]]]:
    """Every row of every source in the standard layout, and the row count of each source."""
    rows, files = [], []
    for path in sources:
        read = read_rows(path)
        rows += [standard_row(path, n, row) for n, row in read]
        files.append((path, len(read)))
    return rows, files


def select(rows: list[dict], report: Report, tokenizer=None, chat_template: bool = True,
           keep_duplicates: bool = False) -> list[dict]:
    """The rows to write; counts what is left out (and why) in `report`."""
    kept, seen = [], set()
    for row in rows:
        if is_empty(row["prompt"]):
            report.empty += 1
            continue
        key = json.dumps(row["prompt"], sort_keys=True)
        if key in seen and not keep_duplicates:
            report.duplicates += 1
            continue
        seen.add(key)
        if tokenizer is not None:
            n = len(tokenize_prompt(tokenizer, row["prompt"], chat_template))
            if report.max_prompt_len and n > report.max_prompt_len:
                report.too_long += 1
                continue
            report.longest = max(report.longest or 0, n)
        report.no_ground_truth += row["ground_truth"] is None
        report.by_source[row["data_source"]] += 1
        kept.append(row)
    report.kept = len(kept)
    return kept


def write_rows(path: str, rows: list[dict]) -> None:
    """jsonl (rows as they are) or parquet (columns; an empty extra_info as null), atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        if path.endswith(".jsonl"):
            with open(tmp, "w") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
        else:
            _write_parquet(tmp, path, rows)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_parquet(tmp: str, path: str, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # parquet cannot hold an empty struct
        table = pa.Table.from_pylist([{**r, "extra_info": r["extra_info"] or None} for r in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        raise DatasetError(f"{path}: these rows do not fit parquet columns (mixed types, e.g. string and chat "
                           f"prompts: {e}); write .jsonl instead") from None
    pq.write_table(table, tmp)


def prepare(sources: list[str], out: str, tokenizer=None, max_prompt_len: int | None = None,
            chat_template: bool = True, keep_duplicates: bool = False) -> Report:
    """Reads `sources`, writes the kept rows to `out`; returns the report."""
    if not out.endswith(OUT_FORMATS):
        raise DatasetError(f"--out {out!r}: expected a .jsonl or .parquet file")
    if max_prompt_len is not None and tokenizer is None:
        raise DatasetError("--max-prompt-len counts tokens: give --tokenizer (an HF model or tokenizer directory)")
    rows, files = read_standard(sources)
    report = Report(files=files, rows=len(rows), max_prompt_len=max_prompt_len)
    kept = select(rows, report, tokenizer, chat_template, keep_duplicates)
    write_rows(out, kept)
    return report
