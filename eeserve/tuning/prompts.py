"""Offline prompt sets, built from text every Python install has (``pydoc_data.topics``).

Contract: ``prompt_texts(n, seed, split)`` returns ``n`` reproducible prompts: an instruction
followed by a passage of the Python reference documentation. ``split`` selects disjoint halves of
the topics ("tune", "calib", "bench", "heldout" map to different topic subsets) so that tuning,
calibration and held-out evaluation never share passages. ``fixed_length_ids`` cuts tokenized
prompts to exactly ``length`` tokens, for side-by-side speed runs without padding.
"""

from __future__ import annotations

import random
import re

_SPLITS = {"tune": 0, "calib": 1, "bench": 2, "heldout": 3}
_INSTRUCTIONS = (
    "Summarize the following passage in plain words:",
    "Explain what this documentation says, with an example:",
    "Continue the following text:",
    "Answer briefly: what is the main idea of this passage?",
)


def _passages() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out: list[tuple[str, str]] = []
    for name in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[name]):
            text = " ".join(para.split())
            if 200 <= len(text) <= 1500 and not set(text) <= set("*=-~ "):
                out.append((name, text))
    return out


def prompt_texts(n: int, seed: int = 0, split: str = "bench", max_chars: int = 1200) -> list[str]:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {sorted(_SPLITS)}, got {split!r}")
    part = _SPLITS[split]
    pool = [t for name, t in _passages() if sum(map(ord, name)) % len(_SPLITS) == part]
    rng = random.Random(seed)
    rng.shuffle(pool)
    if not pool:
        raise RuntimeError("no passages found in pydoc_data.topics")
    return [
        f"{_INSTRUCTIONS[i % len(_INSTRUCTIONS)]}\n\n{pool[i % len(pool)][:max_chars]}"
        for i in range(n)
    ]


def fixed_length_ids(tokenizer: object, texts: list[str], length: int) -> list[list[int]]:
    """Token ids of each text cut to exactly ``length`` (texts too short are repeated)."""
    out: list[list[int]] = []
    for text in texts:
        ids = list(tokenizer(text).input_ids)  # type: ignore[operator]
        while len(ids) < length:
            ids = ids + ids
        out.append(ids[:length])
    return out
