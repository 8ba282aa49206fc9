"""``--reasoning-parser``: split a chat reply's ``<think>...</think>`` into ``reasoning_content``.

Parsers (SGLang's names): ``qwen3``: the reply is in reasoning if it opens with ``<think>`` or
if the prompt left a think block open (a template that ends the generation prompt with
``<think>``); ``deepseek-r1`` and ``qwen3-thinking``: the reply starts in reasoning (those
templates open the block themselves, or the model skips the tag) unless the request set
``enable_thinking`` / ``thinking`` false in ``chat_template_kwargs``. Reasoning ends at
``</think>``; the content after it starts at its first non-space character.

One ``ReasoningSplitter`` per choice works for streams and whole replies alike: ``feed`` takes
text as it comes and returns the (reasoning, content) text that is certain, holding back what
could still be the start of a tag; ``flush`` returns the rest.
"""

from __future__ import annotations

from typing import Any

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek-r1", "qwen3-thinking")
_FORCED = {"deepseek-r1", "qwen3-thinking"}


def starts_in_reasoning(parser: str, prompt: str, template_kwargs: dict[str, Any]) -> bool:
    """Whether the reply begins inside a think block."""
    thinking_off = any(template_kwargs.get(k) is False for k in ("enable_thinking", "thinking"))
    if thinking_off:
        return False
    if parser in _FORCED:
        return True
    return prompt.rfind(START) > prompt.rfind(END)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool) -> None:
        self.mode = "reasoning" if in_reasoning else "start"
        self.buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        reasoning, content = [], []
        while True:
            if self.mode == "start":  # the reply's beginning may open a think block
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf, self.mode = head[len(START) :], "reasoning"
                    continue
                if START.startswith(head):  # still undecided (nothing, or part of the tag)
                    break
                self.mode = "content"
            elif self.mode == "reasoning":
                i = self.buf.find(END)
                if i >= 0:
                    reasoning.append(self.buf[:i])
                    self.buf, self.mode = self.buf[i + len(END) :], "after"
                    continue
                keep = _partial_suffix(self.buf, END)
                reasoning.append(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
            elif self.mode == "after":  # content starts at its first non-space character
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.mode = "content"
            else:
                content.append(self.buf)
                self.buf = ""
                break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return rest, ""
        if self.mode == "after":
            return "", rest.lstrip()
        return "", rest
