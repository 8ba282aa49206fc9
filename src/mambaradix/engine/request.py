"""The engine's record of one request through its lifecycle."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from mambaradix.cache.request_cache import ReqCache
from mambaradix.core import FinishReason, SamplingParams
from mambaradix.engine.strategies import SnapshotPlan


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Req:
    """A request. Its sequence is ``prompt_ids + output_ids``; ``fed_len`` counts the tokens
    already scheduled into forwards (the runner executes batches in order, so the scheduler can
    treat them as computed). With overlap, the token sampled by a batch still in flight is known
    only as a placeholder in ``futures`` (which the runner resolves)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list = field(default_factory=list)  # per output token: (ids, logprobs) | None
    prompt_lps: list[float] = field(default_factory=list)  # from params.prompt_logprob_start
    prompt_top: list = field(default_factory=list)
    prompt_sent: bool = False  # prompt logprobs handed out (with the first output)
    logits_state: object = None  # engine.logits_process.RequestLogits, when sampling needs one
    grammar: object = None  # engine.grammar.GrammarMatcher (structured output); runner thread
    grammar_future: object = None  # its compile, until the request reaches the engine thread
    status: ReqStatus = ReqStatus.WAITING
    rc: ReqCache | None = None
    fed_len: int = 0
    futures: list[int] = field(default_factory=list)  # placeholders of tokens still in flight
    cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    storage_tokens: int = 0  # of cached_tokens, those loaded back from the storage tier
    loading: object = None  # cache.request_cache.LoadTicket this waiting request waits on
    storage_probed: bool = False  # the storage tier was asked for this request's prefix
    ram_prefix: int = 0  # prefix the RAM tree offered before a load
    wait_pin: object = None  # waiting: the tree node whose state it pins (engine.sharing)
    snapshot_plan: SnapshotPlan = field(default_factory=SnapshotPlan)  # (engine.strategies)
    inflight: int = 0  # batches containing this request not yet processed
    finish_reason: FinishReason | None = None
    finish_matched: str | int | None = None  # stop string or stop token
    error: str | None = None  # why the request failed (FinishReason.ERROR)
    queue_time: float | None = None  # seconds from arrival to first admission
    generator: torch.Generator | None = None
    np_ids: np.ndarray | None = None
    drafter: object = None  # engine.speculative.NgramDrafter over its tokens (speculation on)
    spec_verify_ct: int = 0  # verify steps run (SGLang's meta_info name)
    spec_accepted: int = 0  # tokens those steps emitted
    spec_rate: tuple[float, float] | None = None  # engine.spec_policy: (kept, trials), decayed
    stream: object = None  # engine-side output sink
    detok: object = None

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.futures)

    def tokens(self) -> list[int]:
        """All known tokens (prompt + outputs); excludes a token still in flight."""
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs + in-flight placeholders, without building
        the whole sequence (this runs for every request in every step)."""
        n_prompt, n_known = len(self.prompt_ids), len(self.prompt_ids) + len(self.output_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt and end <= n_known:
            return self.output_ids[start - n_prompt : end - n_prompt]
        ids = (
            self.prompt_ids[start:end] + self.output_ids[max(0, start - n_prompt) : end - n_prompt]
        )
        if end > n_known:
            ids += self.futures[max(0, start - n_known) : end - n_known]
        return ids

    def num_outputs(self) -> int:
        return len(self.output_ids) + len(self.futures)

    def prefix_ids(self) -> np.ndarray:
        if self.np_ids is None or len(self.np_ids) != len(self.prompt_ids) + len(self.output_ids):
            self.np_ids = np.asarray(self.tokens(), dtype=np.int64)
        return self.np_ids
