"""Prompt datasets (jsonl/parquet), length filtering, resumable sampler, reward functions."""

import json

import pytest

from skyrl_mega.data.dataset import DatasetError, PromptSampler, load_prompts
from skyrl_mega.data.rewards import extract_final_number, get_reward, register_reward
from skyrl_mega.data.synthetic import write_digits_task


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_moe):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_moe)


def test_jsonl_and_parquet_give_the_same_items(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "what is 2 and 3", "reward_model": {"ground_truth": "5"}, "data_source": "gsm8k"},
            {"prompt": [{"role": "user", "content": "count 7"}], "ground_truth": "7"}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist([{**r, "prompt": json.dumps(r["prompt"])} for r in rows[:1]]),
                   tmp_path / "d.parquet")
    items, counts = load_prompts(str(jl), tokenizer)
    assert counts == {"total": 2, "kept": 2, "too_long": 0, "empty": 0}
    assert items[0].ground_truth == "5" and items[0].data_source == "gsm8k"
    assert items[1].ground_truth == "7" and items[1].data_source == "default"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "count 7"}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert items[1].prompt_ids == list(chat)
    pitems, _ = load_prompts(str(tmp_path / "d.parquet"), tokenizer, chat_template=False)
    assert tokenizer.decode(pitems[0].prompt_ids) == json.dumps("what is 2 and 3")


def test_length_filter_counts_and_clear_errors(tmp_path, tokenizer):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": "a " * n, "ground_truth": "1"}) for n in (1, 5, 50)))
    items, counts = load_prompts(str(p), tokenizer, chat_template=False, max_prompt_len=10)
    assert counts["kept"] == 2 and counts["too_long"] == 1
    with pytest.raises(DatasetError, match="no prompts left"):
        load_prompts(str(p), tokenizer, chat_template=False, max_prompt_len=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{not json\n')
    with pytest.raises(DatasetError, match="bad.jsonl row 2: not valid JSON"):
        load_prompts(str(bad), tokenizer)
    nop = tmp_path / "nop.jsonl"
    nop.write_text('{"question": "x"}\n')
    with pytest.raises(DatasetError, match="nop.jsonl row 1: no 'prompt' field"):
        load_prompts(str(nop), tokenizer)
    with pytest.raises(DatasetError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer)


def test_sampler_epochs_and_resume():
    a = PromptSampler(10, 3, seed=7)
    seen = [a.next_batch() for _ in range(3)]
    assert sorted(sum(seen, [])) == sorted(set(sum(seen, [])))  # no repeats within an epoch
    state = a.state()
    rest = [a.next_batch() for _ in range(5)]
    assert a.epoch == 2
    b = PromptSampler(10, 3, seed=7)
    b.load_state(json.loads(json.dumps(state)))
    assert [b.next_batch() for _ in range(5)] == rest
    with pytest.raises(DatasetError, match="sampler state is for 10 items"):
        PromptSampler(11, 3, seed=7).load_state(state)


def test_rewards():
    gsm8k = get_reward("gsm8k")
    assert gsm8k("so the answer is 1,234.", "#### 1234", {}) == 1.0
    assert gsm8k("I think 12 then #### 13", "13", {}) == 1.0
    assert gsm8k("no number", "3", {}) == 0.0
    assert extract_final_number("x = -2.5") == "-2.5"
    digits = get_reward("digits")
    assert digits("7 7 77", "7", {}) == 1.0
    assert digits("7a", "7", {}) == 0.5
    assert digits("   ", "7", {}) == 0.0

    @register_reward("always_half_test")
    def half(response, truth, meta):
        return 0.5

    assert get_reward("always_half_test")("x", None, {}) == 0.5
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_synthetic_task_file(tmp_path, tokenizer):
    path = write_digits_task(str(tmp_path / "digits.jsonl"), n=20, digits="37", seed=1)
    items, counts = load_prompts(path, tokenizer)
    assert counts["kept"] == 20
    assert {i.ground_truth for i in items} <= {"3", "7"} and {i.data_source for i in items} == {"digits"}
