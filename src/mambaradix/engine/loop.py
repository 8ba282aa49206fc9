"""The engine thread: it owns the scheduler. Other threads talk to it only through typed
messages in its inbox; it takes them between steps, runs a step while there is work, and
flushes the output stage once a turn. A step that raises kills the engine: every request it
holds or has queued ends with an error event, and health reports why."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from mambaradix.core import SEED_LIMIT, FinishReason
from mambaradix.engine.cpu_runtime import serial_torch_thread
from mambaradix.engine.health import EngineHealth
from mambaradix.engine.output_stage import OutputStage
from mambaradix.engine.outputs import EngineDeadError
from mambaradix.engine.request import Req
from mambaradix.engine.scheduler import Scheduler
from mambaradix.engine.structured import StructuredOutput

logger = logging.getLogger(__name__)

ARRIVAL_WINDOW_S = 0.01  # waking from idle: how long a burst may take to arrive
_FAIL_LOCK = threading.Lock()  # failing queued work may run on a caller's thread and the loop's


# --------------------------------------------------------------------------- messages


@dataclass(slots=True)
class AddRequests:
    """New requests (their grammars, if any, compiled), planned together."""

    reqs: list[Req]


@dataclass(slots=True)
class Abort:
    rid: str


@dataclass(slots=True)
class AbortAll:
    pass


@dataclass(slots=True)
class Call:
    """Run ``fn`` on the engine thread between steps (after the batch in flight), its result
    or exception into ``future``."""

    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)


@dataclass(slots=True)
class Stop:
    pass


Message = AddRequests | Abort | AbortAll | Call | Stop


class EngineLoop:
    """Contract: ``put`` from any thread; after the loop ended (a fault, or ``stop``) what is
    put fails at once. ``requests`` is the loop's table of the requests it holds (read it on
    the engine thread: ``Call``)."""

    def __init__(
        self,
        structured: StructuredOutput,
        outputs: OutputStage,
        health: EngineHealth,
        seed: int | None,
        debug_integrity: bool,
    ) -> None:
        self.scheduler: Scheduler | None = None  # start() gives it
        self.structured = structured
        self.outputs = outputs
        self.health = health
        self.debug_integrity = debug_integrity
        # sampling requests without a seed of their own draw one from this in arrival order,
        # so that --seed makes their samples reproducible
        self._seeds = random.Random(seed)
        self.requests: dict[str, Req] = {}
        self.compiling: set[str] = set()  # rids whose grammar compiles (not queued yet)
        self._aborted_early: set[str] = set()  # of those, aborted before they were queued
        self._inbox: queue.Queue[Message] = queue.Queue()
        self.stopping = False
        self._thread = threading.Thread(target=self._run, name="mambaradix-engine", daemon=True)

    def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._thread.start()

    def put(self, msg: Message) -> None:
        """Queue for the engine thread. If the loop has ended, what was queued fails at once
        instead of waiting for a loop that will never run it."""
        self._inbox.put(msg)
        if self.health.error is not None or not self._thread.is_alive():
            self.fail_inbox()

    def queue_requests(self, reqs: list[Req]) -> None:
        """To the engine thread, once their grammars (if any) are compiled."""
        self.compiling.update(r.rid for r in reqs if r.grammar_future is not None)
        self.structured.when_compiled(reqs, lambda ready: self.put(AddRequests(ready)))

    def call(self, fn: Callable[[], Any]) -> Any:
        msg = Call(fn)
        self.put(msg)
        return msg.future.result()

    def stop(self, timeout: float) -> bool:
        """End the loop after the current turn; True when the thread ended."""
        self.stopping = True
        self._inbox.put(Stop())
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def finished(self, req: Req) -> None:
        """The scheduler's end of a request: out of the table, its last event out."""
        self.requests.pop(req.rid, None)
        self.outputs.on_finish(req)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        serial_torch_thread()  # no OpenMP pool beside the runner's (engine.cpu_runtime)
        health = self.health
        while not self.stopping:
            try:
                self._pull(block=self.scheduler.is_idle())
                if self.stopping:
                    self.outputs.flush()
                    break
                if not self.scheduler.is_idle():
                    health.step_started()
                    self.scheduler.step()
                    if self.debug_integrity:
                        self.scheduler.check_integrity()
                    health.step_done()
                self.outputs.flush()
            except BaseException as exc:  # a fault of the engine itself: it is dead
                health.die(exc)
                logger.exception("engine failed; every running and later request fails")
                self._fail_all()
                return

    def _pull(self, block: bool) -> None:
        """Take everything in the inbox. Waking from idle, wait a moment for the rest of a
        burst, so that requests sent together are planned together (in-batch sharing)."""
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.1 if block else None)
            except queue.Empty:
                return
            if block:
                time.sleep(ARRIVAL_WINDOW_S)
            block = False
            if isinstance(msg, Call):
                self._call(msg)
            elif isinstance(msg, AddRequests):
                for req in msg.reqs:
                    if not self._grammar_ready(req):
                        continue
                    self.requests[req.rid] = req
                    self._seed_unseeded(req)
                    self.scheduler.add(req)
            elif isinstance(msg, Abort):
                req = self.requests.get(msg.rid)
                if req is not None:
                    self.scheduler.abort(req)
                elif msg.rid in self.compiling:
                    self._aborted_early.add(msg.rid)
            elif isinstance(msg, AbortAll):
                for req in list(self.requests.values()):
                    self.scheduler.abort(req)
            elif isinstance(msg, Stop):
                return

    def _call(self, msg: Call) -> None:
        try:
            if not self.scheduler.is_idle():
                self.scheduler.drain()
        except BaseException as exc:  # a forward raised: the engine is dead
            msg.future.set_exception(exc)
            raise
        try:
            result = msg.fn()
            self.outputs.flush()
            msg.future.set_result(result)
        except BaseException as exc:
            msg.future.set_exception(exc)

    def _grammar_ready(self, req: Req) -> bool:
        """The request's matcher attached; False when it ended here instead (its grammar did
        not compile, or it was aborted while compiling)."""
        if req.grammar_future is None:
            return True
        self.compiling.discard(req.rid)
        error = self.structured.attach(req)
        if req.rid in self._aborted_early:
            self._aborted_early.discard(req.rid)
            req.finish_reason = FinishReason.ABORT
        elif error is not None:
            logger.info("request %s failed: %s", req.rid, error)
            req.finish_reason, req.error = FinishReason.ERROR, error
        else:
            return True
        self.outputs.emit(req, [], None, "", finished=True)
        return False

    def _seed_unseeded(self, req: Req) -> None:
        """A sampling request without a seed draws one from the engine's ``--seed`` generator
        (in arrival order); greedy and seeded requests are left alone."""
        p = req.params
        if p.seed is not None or p.temperature == 0.0 or p.top_k == 1:
            return
        req.generator = torch.Generator().manual_seed(self._seeds.randrange(SEED_LIMIT))

    # ------------------------------------------------------------------ failing

    def _fail_all(self) -> None:
        """The engine died: every request it holds or has queued ends with an error event."""
        detail = self.health.report().detail
        for req in list(self.requests.values()):
            self.outputs.fail(req, detail)
        self.requests.clear()
        self.fail_inbox()

    def fail_inbox(self) -> None:
        """Fail what waits in the inbox (the loop has ended); safe from any thread."""
        detail = self.health.report().detail if self.health.error else "engine is shut down"
        with _FAIL_LOCK:
            while True:
                try:
                    msg = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if isinstance(msg, AddRequests):
                    for req in msg.reqs:
                        self.outputs.fail(req, detail)
                elif isinstance(msg, Call):
                    msg.future.set_exception(EngineDeadError(detail))
            self.outputs.flush()
