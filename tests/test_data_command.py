"""Datasets as users have them, and `skyrl-mega data`:

- a verl / SkyRL parquet (chat-message prompts, reward_model.ground_truth, data_source,
  extra_info), a jsonl file and a directory written by HF datasets' save_to_disk all load;
- `skyrl-mega data` reads them together, reports rows per file, empty prompts, duplicates, too
  long prompts (with a tokenizer), rows without ground truth, kept rows per data_source, and
  writes the standard layout (jsonl or parquet) that training reads back;
- a malformed row is one line naming file and row, exit code 2, and nothing is written.
"""

import json
import os

import pytest

from skyrl_mega.cli import main
from skyrl_mega.data.dataset import DatasetError, load_prompts, read_rows

MSGS = [{"role": "user", "content": "what is 2 + 3?"}]
VERL = [
    {"prompt": MSGS, "reward_model": {"ground_truth": "5", "style": "rule"}, "data_source": "gsm8k",
     "extra_info": {"index": 0, "split": "train"}},
    {"prompt": [{"role": "user", "content": "what is 1/2 as a decimal?"}],
     "reward_model": {"ground_truth": "0.5", "style": "rule"}, "data_source": "math", "extra_info": {"index": 1}},
    {"prompt": [{"role": "user", "content": "   "}], "reward_model": {"ground_truth": "0", "style": "rule"},
     "data_source": "math", "extra_info": {"index": 2}},  # empty
]
JSONL = [
    {"prompt": "repeat 7", "ground_truth": "7", "data_source": "digits"},
    {"prompt": MSGS, "ground_truth": "5", "data_source": "gsm8k"},  # the parquet's first prompt again
    {"prompt": "say something " * 40},  # long; no ground truth, no data_source
]
SAVED = [{"prompt": [{"role": "user", "content": f"count to {k}"}], "reward_model": {"ground_truth": str(k)},
          "data_source": "count", "extra_info": {"k": k}} for k in (1, 2)]


@pytest.fixture
def sources(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(VERL), tmp_path / "verl.parquet")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in JSONL))
    datasets.Dataset.from_list(SAVED).save_to_disk(str(tmp_path / "saved"))
    return [str(tmp_path / n) for n in ("verl.parquet", "rows.jsonl", "saved")]


def test_each_layout_loads(sources, tiny_qwen3_moe):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_moe)
    parquet, _, saved = sources
    items, counts = load_prompts(parquet, tok)
    assert counts == {"total": 3, "kept": 2, "too_long": 0, "empty": 1}
    assert [(i.ground_truth, i.data_source, i.meta["extra_info"]["index"]) for i in items] == [
        ("5", "gsm8k", 0), ("0.5", "math", 1)]
    items, _ = load_prompts(saved, tok)
    assert [(i.ground_truth, i.data_source) for i in items] == [("1", "count"), ("2", "count")]
    assert items[0].prompt_ids == list(tok.apply_chat_template(SAVED[0]["prompt"], add_generation_prompt=True,
                                                               tokenize=True, return_dict=False))
    assert [n for n, _ in read_rows(saved)] == [1, 2]


def test_data_command_reports_and_writes_the_standard_layout(sources, tmp_path, tiny_qwen3_moe, capsys):
    out = tmp_path / "out" / "train.jsonl"
    assert main(["data", *sources, "--out", str(out), "--tokenizer", tiny_qwen3_moe, "--max-prompt-len", "60"]) == 0
    report = capsys.readouterr().out.splitlines()
    assert report[:3] == [f"{sources[0]}: 3 rows", f"{sources[1]}: 3 rows", f"{sources[2]}: 2 rows"]
    assert report[3] == ("rows 8: kept 5, empty 1, duplicates 1, too long 1 (> 60 tokens), "
                         "without ground truth 0 (kept)")
    assert report[4] == "kept per data_source: count 2, digits 1, gsm8k 1, math 1"
    assert report[5].startswith("longest kept prompt: ") and report[6] == f"wrote 5 rows to {out}"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0] == {"prompt": MSGS, "ground_truth": "5", "data_source": "gsm8k",
                       "extra_info": {"index": 0, "split": "train"}}
    assert rows[2] == {"prompt": "repeat 7", "ground_truth": "7", "data_source": "digits", "extra_info": {}}
    assert [r["ground_truth"] for r in rows] == ["5", "0.5", "7", "1", "2"]
    assert os.listdir(out.parent) == ["train.jsonl"]  # no temporary file left

    from transformers import AutoTokenizer

    items, counts = load_prompts(str(out), AutoTokenizer.from_pretrained(tiny_qwen3_moe))
    assert counts["kept"] == 5 and items[3].data_source == "count"


def test_data_command_parquet_out_without_tokenizer(sources, tmp_path, capsys):
    import pyarrow.parquet as pq

    out = tmp_path / "train.parquet"
    assert main(["data", sources[0], sources[2], "--out", str(out), "--keep-duplicates"]) == 0
    assert "rows 5: kept 4, empty 1, duplicates 0, without ground truth 0 (kept)" in capsys.readouterr().out
    rows = pq.read_table(out).to_pylist()
    assert [r["data_source"] for r in rows] == ["gsm8k", "math", "count", "count"]
    assert rows[0]["prompt"] == MSGS and rows[2]["ground_truth"] == "1"
    # mixed prompt kinds (string and chat) do not fit parquet columns: one line, nothing written
    assert main(["data", sources[1], "--out", str(tmp_path / "mixed.parquet")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("skyrl-mega data: ") and "write .jsonl instead" in err and err.count("\n") == 1
    assert not (tmp_path / "mixed.parquet").exists() and not list(tmp_path.glob("mixed.parquet.tmp*"))


@pytest.mark.parametrize("line,what", [
    ('{"prompt": 5}', "row 2: 'prompt' must be a string or chat messages"),
    ('{"prompt": [{"role": "user"}]}', "row 2: prompt message 0 must be {role: str, content: str}"),
    ('{"question": "x"}', "row 2: no 'prompt' field (keys: ['question'])"),
    ('["x"]', "row 2: expected an object with a 'prompt', got list"),
    ('{"prompt": "x", "data_source": 3}', "row 2: 'data_source' must be a string"),
    ('{"prompt": "x", "reward_model": "5"}', "row 2: 'reward_model' must be an object"),
    ('{"prompt": "x", "extra_info": [1]}', "row 2: 'extra_info' must be an object"),
    ('{"prompt": "x",', "row 2: not valid JSON"),
])
def test_a_malformed_row_is_one_line_naming_file_and_row(tmp_path, capsys, line, what):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine", "ground_truth": "1"}\n' + line + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["data", str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"skyrl-mega data: {bad} {what}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # nothing written


def test_malformed_parquet_row_and_unreadable_inputs(tmp_path, capsys):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": None}]), tmp_path / "p.parquet")
    assert main(["data", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert f"{tmp_path / 'p.parquet'} row 2: 'prompt' must be a string" in capsys.readouterr().err
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SAVED)}).save_to_disk(str(tmp_path / "dd"))
    for args, what in (([str(tmp_path / "dd")], "holds the splits ['train'] of a DatasetDict"),
                       ([str(tmp_path)], "not one written by datasets' save_to_disk"),
                       ([str(tmp_path / "nope.jsonl")], "does not exist"),
                       ([str(tmp_path / "p.parquet"), "--max-prompt-len", "5"], "give --tokenizer")):
        assert main(["data", *args, "--out", str(tmp_path / "o.jsonl")]) == 2
        assert what in capsys.readouterr().err
    assert main(["data", str(tmp_path / "p.parquet"), "--out", str(tmp_path / "o.csv")]) == 2
    assert "expected a .jsonl or .parquet file" in capsys.readouterr().err
    with pytest.raises(DatasetError):
        read_rows(str(tmp_path / "dd"))
