"""The output stage: what the scheduler's new tokens become for the client. Incremental
detokenization, stop strings (the text that could still start one held back), the logprob
extras, and the events batched per request until the engine loop flushes them once a turn."""

from __future__ import annotations

import logging
from typing import Any

from mambaradix.core import FinishReason
from mambaradix.engine.detokenizer import DetokState, IncrementalDetokenizer, find_stop, holdback
from mambaradix.engine.outputs import ENGINE_DEAD, OutputBatcher, RequestHandle, RequestOutput
from mambaradix.engine.request import Req

logger = logging.getLogger(__name__)


class OutputStage:
    """``on_tokens`` / ``on_finish`` are the scheduler's callbacks (engine thread); ``fail``
    ends a request with an error event from any thread that holds the engine's fail lock;
    ``flush`` hands the batched events to their handles."""

    def __init__(self, tokenizer: Any) -> None:
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.outbox = OutputBatcher()

    def on_tokens(self, req: Req, ids: list[int], logprobs: list[float]) -> bool:
        """New tokens of a running request; True when a stop string ended its text."""
        stop_hit = False
        st: DetokState = req.detok
        if self.detok is not None:
            self.detok.step(st, req.output_ids)
            stops = req.params.stop
            if stops:
                found = find_stop(st.text, stops, st.sent)
                if found is not None:
                    st.text = st.text[: found[0]]
                    req.finish_matched = found[1]
                    stop_hit = True
        text = self._take_text(req, final=stop_hit)
        lps = logprobs if req.params.return_logprob else None
        self.emit(req, ids, lps, text, finished=False)
        return stop_hit

    def on_finish(self, req: Req) -> None:
        """The request's last event: the rest of its text (a failing detokenization fails this
        request alone)."""
        text = ""
        if req.error is None:
            try:
                if self.detok is not None and not isinstance(req.finish_matched, str):
                    self.detok.flush(req.detok, req.output_ids)  # no stop string cut the text
                text = self._take_text(req, final=True)
            except Exception as exc:
                logger.error("request %s failed: %r", req.rid, exc, exc_info=exc)
                req.finish_reason = FinishReason.ERROR
                req.error = f"request failed: {type(exc).__name__}: {exc}"
        self.emit(req, [], None, text, finished=True)

    def fail(self, req: Req, detail: str) -> None:
        """End ``req`` with an error event naming the engine's failure."""
        req.finish_reason = FinishReason.ERROR
        req.error = detail if detail.startswith(ENGINE_DEAD) else f"{ENGINE_DEAD}: {detail}"
        self.emit(req, [], None, "", finished=True)

    def emit(
        self, req: Req, ids: list[int], lps: list[float] | None, text: str, finished: bool
    ) -> None:
        handle: RequestHandle = req.stream
        reason = req.finish_reason.value if (finished and req.finish_reason) else None
        out = RequestOutput(
            rid=req.rid,
            new_token_ids=list(ids),
            new_text=text,
            finished=finished,
            finish_reason=reason,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            storage_tokens=req.storage_tokens,
            new_logprobs=lps,
            finish_matched=req.finish_matched if finished else None,
            error=req.error if finished else None,
            queue_time=req.queue_time,
            spec_verify_ct=req.spec_verify_ct,
            spec_accepted=req.spec_accepted,
        )
        if req.params.return_logprob or req.params.wants_prompt_logprobs:
            self._logprob_extras(req, out, len(ids))
        self.outbox.put(handle, out)

    def flush(self) -> None:
        self.outbox.flush()

    def _logprob_extras(self, req: Req, out: RequestOutput, num_new: int) -> None:
        """Top-k logprobs of the new tokens and, once, the prompt logprobs."""
        p = req.params
        if p.return_logprob and p.top_logprobs and num_new:
            out.new_top_logprobs = req.output_top[-num_new:]
        if p.wants_prompt_logprobs and not req.prompt_sent and (num_new or out.finished):
            req.prompt_sent = True
            out.prompt_logprobs = list(req.prompt_lps)
            out.prompt_top_logprobs = list(req.prompt_top) if p.prompt_top_logprobs else None

    def _take_text(self, req: Req, final: bool) -> str:
        st: DetokState = req.detok
        if self.detok is None:
            return ""
        end = len(st.text) if final else len(st.text) - holdback(st.text, req.params.stop)
        text = st.text[st.sent : end] if end > st.sent else ""
        st.sent = max(st.sent, end)
        return text
