"""Does the prefix cache survive the chat template? The next turn's ``cached_tokens`` against
the ideal: the previous turn's tokens (prompt + completion) that the re-rendered prompt repeats
unchanged.

Scenarios (tiny random-weight model behind the HTTP server; replies forced with SGLang's
``regex`` or a named ``tool_choice`` so that they have a known shape):

- tool loop, for each template of ``--template-dir`` (tests/server/tool_templates): turn 1 a
  forced call, turn 2 the call sent back with the tool's result, turn 3 the answer and a new
  question;
- ``<think>`` chat (``--reasoning-parser qwen3``): a reply ``<think>..</think>`` + answer, sent
  back as ``reasoning_content`` + ``content``, with a template that renders past reasoning
  (KEEP) and one that drops it as Qwen3's published template does for earlier turns (DROP).

    python bench/bench_chat_cache.py
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai

from mambaradix.config import ServerConfig
from mambaradix.engine.engine import Engine
from mambaradix.server.launch import ServerThread

ROOT = Path(__file__).resolve().parents[1]
_CHATML = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content %}{KEEP}{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
THINK_TEMPLATES = {
    "KEEP": _CHATML.replace("{KEEP}", "<think>\n{{ m.reasoning_content }}\n</think>\n\n"),
    "DROP": _CHATML.replace("{KEEP}", ""),
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


SYSTEM = {"role": "system", "content": " ".join(f"Rule {i}: answer briefly." for i in range(60))}


def _escape(text: str) -> str:
    """A regex matching ``text`` (only the metacharacters escaped: xgrammar warns on others)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _turn(client, messages, **kw):
    r = client.chat.completions.create(
        model="m", messages=messages, temperature=0, extra_body={"return_token_ids": True}, **kw
    )
    return r, _seen(r)


def _seen(r) -> tuple[int, list[int]]:
    """(prompt length, prompt + completion ids) of a response."""
    c = r.choices[0]
    prompt = c.model_extra["prompt_token_ids"]
    return len(prompt), prompt + c.model_extra["token_ids"]


def _row(name: str, prev: tuple[int, list[int]], nxt, tok) -> None:
    """One line: the previous turn's tokens, the ideal, what a model writing its reply in the
    tokenizer's own split would share (the random model's split is arbitrary), the hit."""
    prompt_len, seen = prev
    new = nxt.choices[0].model_extra["prompt_token_ids"]
    ideal = _shared(seen, new)
    canonical = _shared(tok.encode(tok.decode(seen), add_special_tokens=False), new)
    cached = nxt.usage.prompt_tokens_details.cached_tokens
    print(
        f"{name:<34} {prompt_len:>6} {len(seen):>6} {ideal:>6} {canonical:>9} {cached:>7} "
        f"{cached / max(ideal, 1):>8.3f}"
    )


def tool_loop(engine: Engine, template: Path) -> None:
    cfg = ServerConfig(port=0, served_model_name="m", chat_template=str(template))
    with ServerThread(engine, cfg) as st:
        client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="x")
        msgs = [SYSTEM, {"role": "user", "content": "Weather in Paris for two days?"}]
        named = {"type": "function", "function": {"name": "get_weather"}}
        r1, seen1 = _turn(client, msgs, tools=TOOLS, tool_choice=named, max_tokens=200)
        call = r1.choices[0].message.tool_calls[0]
        msgs += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
        ]
        r2, seen2 = _turn(client, msgs, tools=TOOLS, max_tokens=6)
        _row(f"tool loop {template.stem}: call->result", seen1, r2, engine.tokenizer)
        msgs += [
            {"role": "assistant", "content": r2.choices[0].message.content},
            {"role": "user", "content": "And tomorrow?"},
        ]
        r3, _ = _turn(client, msgs, tools=TOOLS, max_tokens=2)
        _row(f"tool loop {template.stem}: answer->user", seen2, r3, engine.tokenizer)


def think_chat(engine: Engine, name: str, template: str) -> None:
    cfg = ServerConfig(
        port=0, served_model_name="m", chat_template=template, reasoning_parser="qwen3"
    )
    with ServerThread(engine, cfg) as st:
        client = openai.OpenAI(base_url=st.base_url + "/v1", api_key="x")
        msgs = [SYSTEM, {"role": "user", "content": "Is 7 prime?"}]
        reply = "<think>\nSeven has no divisors but one and itself.\n</think>\n\nYes, it is."
        r1 = client.chat.completions.create(
            model="m", messages=msgs, temperature=0, max_tokens=200,
            extra_body={"return_token_ids": True, "regex": _escape(reply)},
        )  # fmt: skip
        c = r1.choices[0]
        seen = _seen(r1)
        msgs += [
            {
                "role": "assistant",
                "content": c.message.content,
                "reasoning_content": c.message.model_extra.get("reasoning_content"),
            },
            {"role": "user", "content": "And 9?"},
        ]
        r2, _ = _turn(client, msgs, max_tokens=2)
        _row(f"<think> chat, template {name}", seen, r2, engine.tokenizer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:qwen3_next")
    ap.add_argument("--template-dir", default=str(ROOT / "tests/server/tool_templates"))
    args = ap.parse_args()
    engine = Engine(model_path=args.model, max_total_tokens=16384, max_mamba_cache_size=64)
    try:
        print(
            f"{'scenario':<34} {'prompt':>6} {'+reply':>6} {'ideal':>6} {'canonical':>9} "
            f"{'cached':>7} "
            f"{'of ideal':>8}"
        )
        for template in sorted(Path(args.template_dir).glob("*.jinja")):
            tool_loop(engine, template)
        for name, template in THINK_TEMPLATES.items():
            think_chat(engine, name, template)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
