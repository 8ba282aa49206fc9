"""check_integrity holds the cache's live entries against the scheduler's requests and the
tree's lock counts against the requests holding them; each check has a negative control."""

from __future__ import annotations

import random

import pytest
from engine_helpers import make_scheduler, rand_tokens

from mambaradix.cache.integrity import IntegrityError
from mambaradix.core import SamplingParams
from mambaradix.engine.request import Req


def _busy_scheduler():
    """A scheduler stopped mid-run: requests running, some resumed from shared prefixes."""
    rng = random.Random(0)
    sched = make_scheduler(disable_overlap_schedule=True)
    system = rand_tokens(rng, 130)
    for i in range(4):
        req = Req(
            rid=f"r{i}",
            prompt_ids=system + rand_tokens(rng, 20),
            params=SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True),
        )
        sched.add(req)
    for _ in range(8):
        sched.step()
        sched.check_integrity()
    assert sched.running and any(r.rc.node is not sched.cache.tree.root for r in sched.running)
    return sched


def test_busy_scheduler_passes():
    sched = _busy_scheduler()
    sched.check_integrity()
    sched.runner.shutdown()


def test_leaked_request_entry_is_caught():
    sched = _busy_scheduler()
    victim = sched.running.pop()  # the scheduler forgets a request that still holds slots
    with pytest.raises(IntegrityError, match="leaked request"):
        sched.check_integrity()
    sched.running.append(victim)
    sched.check_integrity()
    sched.runner.shutdown()


def test_released_resources_still_held_are_caught():
    sched = _busy_scheduler()
    req = sched.running[0]
    sched.cache.live.discard(req.rc)  # released behind the request's back
    with pytest.raises(IntegrityError, match="released|request rows"):
        sched.check_integrity()
    sched.runner.shutdown()


def test_waiting_request_holding_resources_is_caught():
    sched = _busy_scheduler()
    req = sched.running.pop()
    sched.waiting.append(req)
    with pytest.raises(IntegrityError, match="waiting request"):
        sched.check_integrity()
    sched.runner.shutdown()


def test_running_request_without_resources_is_caught():
    sched = _busy_scheduler()
    req = sched.running[0]
    rc, req.rc = req.rc, None
    with pytest.raises(IntegrityError, match="holds no cache resources"):
        sched.check_integrity()
    req.rc = rc
    sched.runner.shutdown()


def test_leaked_kv_lock_is_caught():
    sched = _busy_scheduler()
    node = next(r.rc.node for r in sched.running if r.rc.node is not sched.cache.tree.root)
    sched.cache.tree.lock(node)  # a lock nobody will release: the node can never be evicted
    with pytest.raises(IntegrityError, match="lock counts"):
        sched.check_integrity()
    sched.cache.tree.unlock(node)
    sched.check_integrity()
    sched.runner.shutdown()


def test_leaked_state_lock_is_caught():
    sched = _busy_scheduler()
    tree = sched.cache.tree
    node = next(r.rc.node for r in sched.running if r.rc.node is not tree.root)
    while node.state_slot is None:
        node = node.parent
    assert node is not tree.root
    tree.lock_state(node)  # kv_lock >= state_lock still holds: only the count check sees it
    with pytest.raises(IntegrityError, match="lock counts"):
        sched.check_integrity()
    tree.unlock_state(node)
    sched.runner.shutdown()


def test_a_forgotten_wait_pin_is_caught():
    """Requests held for a shared snapshot pin it once it is in the tree; a request that
    forgets its pin (the node still counts it) fails the check."""
    rng = random.Random(1)
    sched = make_scheduler(disable_overlap_schedule=True, max_running_requests=2)
    system = rand_tokens(rng, 130)
    for i in range(5):
        sched.add(
            Req(
                rid=f"r{i}",
                prompt_ids=system + rand_tokens(rng, 20),
                params=SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True),
            )
        )
    for _ in range(30):
        sched.step()
        sched.check_integrity()
        pinned = [r for r in sched.waiting if r.wait_pin is not None]
        if pinned:
            break
    assert pinned, "no waiting request pinned the shared snapshot"
    node, pinned[0].wait_pin = pinned[0].wait_pin, None
    with pytest.raises(IntegrityError, match="pins, .* waiting requests pin it"):
        sched.check_integrity()
    pinned[0].wait_pin = node
    sched.check_integrity()
    sched.runner.shutdown()
