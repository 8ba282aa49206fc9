"""Outputs of one engine step reach an event loop in one cross-thread call, in order."""

from __future__ import annotations

import asyncio
import threading

from mambaradix.engine.outputs import OutputBatcher, RequestHandle, RequestOutput


def _out(rid: str, i: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [i], str(i), finished, "length" if finished else None, 3, i + 1, 0)


def test_one_wakeup_per_loop_per_flush_and_order_kept():
    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe

        def counting(cb, *args):
            calls.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting
        handles = [RequestHandle(f"r{i}", 3) for i in range(5)]
        batcher = OutputBatcher()

        def engine_thread():  # two steps of outputs, like the engine loop
            for step in range(2):
                for h in handles:
                    batcher.put(h, _out(h.rid, step, finished=step == 1))
                batcher.flush()
            batcher.flush()  # nothing pending: no call

        t = threading.Thread(target=engine_thread)
        t.start()
        got = {}
        for h in handles:
            got[h.rid] = [o.new_token_ids[0] async for o in h.aevents()]
        t.join()
        return calls, got

    calls, got = asyncio.run(main())
    assert len(calls) == 2  # one per flush with outputs, not one per output (10)
    assert got == {f"r{i}": [0, 1] for i in range(5)}


def test_handles_outside_a_loop_get_their_outputs_directly():
    h = RequestHandle("sync", 3)  # made outside any event loop
    batcher = OutputBatcher()
    batcher.put(h, _out("sync", 0))
    batcher.put(h, _out("sync", 1, finished=True))
    batcher.flush()
    assert [o.new_token_ids for o in h.events()] == [[0], [1]]
