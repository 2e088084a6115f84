"""A small byte-level BPE tokenizer trained locally.

In: nothing (a fixed synthetic corpus). Out: a transformers PreTrainedTokenizerFast
with chat special tokens, saved beside a tiny model so vLLM and transformers load it.
"""

from __future__ import annotations

import random

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ["the", "answer", "is", "add", "sum", "of", "and", "what", "count", "repeat",
             "copy", "letter", "number", "question", "user", "assistant", "system", "a", "b"]
    lines = []
    for _ in range(n_lines):
        parts = [rng.choice(words) for _ in range(rng.randint(2, 8))]
        parts += [str(rng.randint(0, 999)) for _ in range(rng.randint(0, 4))]
        rng.shuffle(parts)
        lines.append(" ".join(parts) + rng.choice([".", "?", "!", ":", ""]))
    return lines


def train_tokenizer(vocab_size: int = 512):
    """Returns a PreTrainedTokenizerFast trained on the synthetic corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast
