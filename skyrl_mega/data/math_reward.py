"""The `math_verify` reward: math-verify's answer extraction and equivalence check.

In: the response text and the gold answer (e.g. "\\frac{1}{2}", "0.5", "(1,2]", or a text
with its answer in \\boxed{}). Out: 1.0 when the response's answer equals the gold answer
(math-verify: the last \\boxed{} or LaTeX / plain expression; fractions vs decimals, sqrt,
sets, intervals, equations compared symbolically), else 0.0. A gold answer math-verify cannot
parse raises (the sample scores 0 and is counted in reward/errors).

math-verify's own time limits are off: they use SIGALRM, which works only in a main thread;
the reward pool (reward_pool.py) limits every reward call instead.
"""

from __future__ import annotations

from typing import Any

import math_verify.grader
import math_verify.parser
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify warns once per process that its time limit is off: the pool's limit applies
math_verify.parser.TIMEOUT_WARNING_SHOWN = math_verify.grader.TIMEOUT_WARNING_SHOWN = True
EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]


def _parse(text: str) -> list:
    return parse(text, extraction_config=EXTRACTION, parsing_timeout=None)


def parse_gold(ground_truth: Any) -> list:
    """A bare gold answer is read as if boxed (so "1/2", "\\frac12" and "(1,2]" parse as math)."""
    text = str(ground_truth).strip()
    gold = [] if "\\boxed" in text or "$" in text else _parse(f"\\boxed{{{text}}}")
    gold = gold or _parse(text)
    if not gold:
        raise ValueError(f"math_verify: cannot parse the ground truth {text[:200]!r}")
    return gold


def math_verify_reward(response: str, ground_truth: Any, meta: dict) -> float:
    """1.0 when math-verify finds the response's answer equivalent to the ground truth."""
    if ground_truth is None:
        raise ValueError("math_verify: the sample has no ground truth")
    return float(verify(parse_gold(ground_truth), _parse(response), timeout_seconds=None))
