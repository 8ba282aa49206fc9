"""Result processing: what a batch's results do to its requests, once they arrive.

For each request of the batch: the resume source is released, prompt logprobs are kept, the
strategy settles the forward's snapshot (``SnapshotStrategy.forward_done``), and a sampled
token is appended and checked against the stop conditions. A request that ended while its
batch was in flight only has its in-flight count dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from mambaradix.cache.request_cache import RequestCache
from mambaradix.core import FinishReason
from mambaradix.engine.batch import RunResult
from mambaradix.engine.forwards import Entry, ScheduledBatch
from mambaradix.engine.request import Req, ReqStatus
from mambaradix.engine.spec_policy import AdaptiveDrafts
from mambaradix.engine.strategies import SnapshotStrategy
from mambaradix.stats import EngineStats


class ResultProcessor:
    """``on_tokens(req, ids, logprobs) -> bool`` reports new tokens (True: a stop string
    matched); ``finish(req, reason)`` and ``fail(req, exc)`` end a request."""

    def __init__(
        self,
        cache: RequestCache,
        strategy: SnapshotStrategy,
        stats: EngineStats,
        *,
        eos_token_ids: list[int],
        context_length: int,
        on_tokens: Callable[[Req, list[int], list[float]], bool],
        finish: Callable[[Req, FinishReason], None],
        fail: Callable[[Req, BaseException], None],
        adaptive: AdaptiveDrafts | None = None,
    ) -> None:
        self.adaptive = adaptive  # --speculative-adaptive: told each verify's outcome
        self.cache = cache
        self.strategy = strategy
        self.stats = stats
        self.eos = set(eos_token_ids)
        self.context_length = context_length
        self.on_tokens = on_tokens
        self.finish = finish
        self.fail = fail

    def process(self, batch: ScheduledBatch, result: RunResult) -> None:
        self.strategy.copies_done(batch.copies)
        for e in batch.entries:
            req = e.req
            req.inflight -= 1
            if req.rc is None or req.status is ReqStatus.FINISHED:
                continue
            if e.resumed:
                self.cache.resume_done(req.rc)
            if e.prompt_idx is not None:
                lps, top = result.prompt[e.prompt_idx]
                if e.prompt_first == req.params.prompt_logprob_start + len(req.prompt_lps):
                    req.prompt_lps.extend(lps)
                    req.prompt_top.extend(top)
            if e.draft is not None:
                self._take_verified(req, result, e)
                continue
            self.strategy.forward_done(req, e.end, e.spot)
            if e.sample_row is not None:
                self._take_token(req, result, e.sample_row)

    def _take_verified(self, req: Req, result: RunResult, e: Entry) -> None:
        """A verify step's tokens, one at a time through the same stop checks as decoding's
        (a stop mid-draft drops the rest); then the state after the tokens kept becomes the
        working state (``RequestCache.settle_spec``) before the request may finish."""
        row = e.sample_row
        req.futures.pop(0)
        if result.errors and row in result.errors:
            self.fail(req, result.errors[row])
            return
        emitted, lps = result.accepted[row]
        if self.adaptive is not None:
            self.adaptive.observe_verify(req, len(e.draft), len(emitted))
        self.stats.spec_draft_tokens += len(e.draft)
        start = e.end - 1 - len(e.draft)
        kept, reason, error = 0, None, None
        for tok, lp in zip(emitted, lps):
            kept += 1
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            self.stats.generated_tokens += 1
            try:
                reason = self._finish_reason(req, tok)
                if self.on_tokens(req, [tok], [lp]):
                    reason = FinishReason.STOP
            except Exception as exc:  # detokenization / stop strings of this request
                error = exc
            if reason is not None or error is not None:
                break
        req.fed_len = start + kept
        self.cache.settle_spec(req.rc, kept)
        self.strategy.forward_done(req, req.fed_len, e.spot)
        req.spec_verify_ct += 1
        req.spec_accepted += kept
        self.stats.spec_accepted_tokens += kept
        if error is not None:
            self.fail(req, error)
        elif reason is not None:
            self.finish(req, reason)

    def _take_token(self, req: Req, result: RunResult, row: int) -> None:
        tok = result.tokens[row]
        req.futures.pop(0)
        if result.errors and row in result.errors:
            self.fail(req, result.errors[row])  # its sampling raised
            return
        req.output_ids.append(tok)
        req.output_logprobs.append(result.logprobs[row])
        if req.params.top_logprobs:
            req.output_top.append(result.top[row])
        self.stats.generated_tokens += 1
        try:
            reason = self._finish_reason(req, tok)
            if row in result.grammar_ended:  # its grammar is complete (ignore_eos or not)
                req.finish_matched = tok
                reason = FinishReason.STOP
            if self.on_tokens(req, [tok], [result.logprobs[row]]):
                reason = FinishReason.STOP  # a stop string matched
        except Exception as exc:  # detokenization / stop strings of this request
            self.fail(req, exc)
            return
        if reason is not None:
            self.finish(req, reason)

    def _finish_reason(self, req: Req, tok: int) -> FinishReason | None:
        p = req.params
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            req.finish_matched = tok
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.context_length:
            return FinishReason.LENGTH
        return None
