"""Logprob fields of responses: the token text and real bytes of every token, completions'
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` and chat's
``logprobs.content``.

A token that holds only part of a UTF-8 character has no text of its own: its ``bytes`` are its
real bytes, and its token string is OpenAI's ``bytes:\\xe2\\x80`` form (so two such tokens never
collide as keys of a ``top_logprobs`` dict). Byte-level BPE tokenizers (GPT-2 / Qwen style) map
pieces to bytes through the byte alphabet; SentencePiece ones through ``<0xNN>`` pieces and
``\u2581`` for a space.
"""

from __future__ import annotations

import re
from typing import Any

from mambaradix.engine.detokenizer import DetokState, IncrementalDetokenizer

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the others for the
    code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


_ALPHABET = _byte_alphabet()


class TokenTable:
    """Bytes and display strings of token ids for one tokenizer, computed once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        self.byte_level = decoder is not None and "ByteLevel" in repr(decoder)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.added = {int(i): str(t) for i, t in added.items()}
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        got = self._bytes.get(token_id)
        if got is None:
            got = self._bytes[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level and all(c in _ALPHABET for c in piece):
            return bytes(_ALPHABET[c] for c in piece)
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token_str(self, token_id: int) -> str:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_offsets(
    tokenizer: Any, ids: list[int], skip_special_tokens: bool, base: int = 0
) -> list[int]:
    """Character offset of each token in the text the ids decode to (a token finishing a
    character another one started points where that character begins), plus ``base``."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    state = DetokState()
    out: list[int] = []
    seen: list[int] = []
    for t in ids:
        out.append(base + len(state.text))
        seen.append(t)
        detok.step(state, seen)
    return out


def _top_dict(table: TokenTable, top: Any, chosen: int | None, chosen_lp: float | None) -> dict:
    out: dict[str, float] = {}
    if top is not None:
        for tid, lp in zip(*top):
            out.setdefault(table.token_str(tid), lp)
    if chosen is not None and chosen_lp is not None:
        out.setdefault(table.token_str(chosen), chosen_lp)
    return out


def completion_logprobs(
    table: TokenTable,
    ids: list[int],
    lps: list[float | None],
    tops: list[Any] | None,
    offsets: list[int],
) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: a None logprob (the first prompt token) gets a None top
    entry; each top dict holds the best alternatives and the chosen token."""
    top_logprobs: list[dict | None] = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        if lp is None:
            top_logprobs.append(None)
        else:
            top_logprobs.append(_top_dict(table, tops[i] if tops else None, tid, lp))
    return {
        "tokens": [table.token_str(t) for t in ids],
        "token_logprobs": list(lps),
        "top_logprobs": top_logprobs,
        "text_offset": list(offsets),
    }


def chat_logprobs(
    table: TokenTable, ids: list[int], lps: list[float], tops: list[Any] | None
) -> dict[str, Any]:
    content = []
    for i, (tid, lp) in enumerate(zip(ids, lps)):
        top = tops[i] if tops else None
        alts = []
        if top is not None:
            alts = [
                {
                    "token": table.token_str(a),
                    "logprob": alp,
                    "bytes": list(table.token_bytes(a)),
                }
                for a, alp in zip(*top)
            ]
        content.append(
            {
                "token": table.token_str(tid),
                "logprob": lp,
                "bytes": list(table.token_bytes(tid)),
                "top_logprobs": alts,
            }
        )
    return {"content": content}
