"""Incremental detokenization with stop strings.

Text is emitted only once it is stable: a token run that decodes to an incomplete UTF-8
sequence (shown as U+FFFD) waits for the next token. Text that could be the start of a stop
string is held back until it cannot be.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # stable text decoded so far
    sent: int = 0  # characters of `text` already emitted


class IncrementalDetokenizer:
    def __init__(self, tokenizer: object, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def step(self, state: DetokState, ids: list[int]) -> None:
        """Fold newly appended ``ids`` (the whole output so far) into ``state.text``."""
        prefix = self._decode(ids[state.prefix_offset : state.read_offset])
        full = self._decode(ids[state.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            state.text += full[len(prefix) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(ids)

    def flush(self, state: DetokState, ids: list[int]) -> None:
        """At finish: whatever remains, even an incomplete character."""
        rest = self._decode(ids[state.prefix_offset :])
        prefix = self._decode(ids[state.prefix_offset : state.read_offset])
        if len(rest) > len(prefix):
            state.text += rest[len(prefix) :]
        state.prefix_offset = state.read_offset = len(ids)


def find_stop(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """First stop string occurring in ``text`` that ends at or after ``start``."""
    best: tuple[int, str] | None = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, start - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def holdback(text: str, stops: list[str]) -> int:
    """How many trailing characters could still become a stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return keep
