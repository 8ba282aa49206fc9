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
        self._decode_ids = _fast_decode(tokenizer, skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids)

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


def _fast_decode(tokenizer: object, skip_special_tokens: bool):
    """``tokenizer.decode`` as a function of the ids. For a ``transformers`` fast tokenizer
    that does not clean up spaces this is its Rust tokenizer's ``decode``, which is what
    ``transformers`` calls after ~4 us of Python of its own: two decodes per token per request
    ran on the engine thread, beside the forward."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


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
