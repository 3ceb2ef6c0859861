"""Position rules as host arrays: the bool mask over positions, and the bitmap words the
graph ops read (bit j of word w is position 32*w + j)."""
from __future__ import annotations

import numpy as np

from graphtap.spec.entries import Span


def position_mask(rule, prompt_len: int, max_len: int, size: int | None = None) -> np.ndarray:
    """A position rule as a bool array over positions 0..size-1 (default max_len)."""
    mask = np.zeros(size or max_len, dtype=bool)
    if rule == "all":
        mask[:max_len] = True
    elif rule == "prompt":
        mask[:prompt_len] = True
    elif rule == "generated":
        mask[prompt_len:max_len] = True
    elif rule == "last_prompt":
        mask[max(prompt_len - 1, 0)] = True
    elif isinstance(rule, Span):
        mask[rule.start:rule.end] = True
    elif isinstance(rule, dict):
        mask[rule["start"]:rule["end"]] = True
    else:
        mask[np.asarray(rule, dtype=np.int64)] = True
    return mask


def position_bitmap(rule, prompt_len: int, max_len: int, words: int) -> np.ndarray:
    return mask_bitmap(position_mask(rule, prompt_len, max_len), words)


def mask_bitmap(mask: np.ndarray, words: int) -> np.ndarray:
    """A bool mask over positions (at most 32 x words of them) as bitmap words."""
    # bytes of 8 positions, least significant bit first, read as little-endian words
    packed = np.packbits(mask, bitorder="little")
    out = np.zeros(words * 4, np.uint8)
    out[:len(packed)] = packed
    return out.view("<i4").astype(np.int32)


def bitmap_words(max_len: int) -> int:
    return (max_len + 31) // 32
