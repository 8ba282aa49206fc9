"""In-batch prefix sharing: requests that share a prefix and are waiting or running together.

The first request of a group snapshots at the shared length; the others wait until that state is
in the tree and then resume from it, so a burst of requests with one system prompt computes it
once (design.md section 5, "Requests waiting together"). Once that state is in the tree, each
waiting request sharing it pins it (``RadixTree.pin_state``) until it is admitted or ends: with
few state slots, the snapshots of requests running meanwhile are evicted before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mambaradix.cache.radix import IntegrityError, RadixTree, TreeNode
from mambaradix.engine.planner import align_down, common_prefix_len
from mambaradix.engine.request import Req


def match_limit(req: Req) -> int | None:
    """Prompt logprobs need the logits of the positions before the first token still lacking
    one: the cache may resume the request at most there."""
    if not req.params.wants_prompt_logprobs:
        return None
    return req.params.prompt_logprob_start - 1 + len(req.prompt_lps)


def shared_with_queue(req: Req, waiting: list[Req], prefix_len: int, align: int) -> int:
    """Longest aligned prefix ``req`` shares with another waiting request (0: none beyond
    ``prefix_len``): where ``req`` should snapshot for them."""
    ids = req.prefix_ids()
    best = 0
    for w in waiting:
        if w is req or w.prompt_ids[0] != req.prompt_ids[0]:
            continue
        n = min(common_prefix_len(ids, w.prefix_ids()), len(w.prompt_ids) - 1)
        best = max(best, align_down(n, align))
    return best if best > prefix_len else 0


@dataclass(slots=True)
class Hold:
    """Why a waiting request is held: ``req`` will snapshot ``position``, a prefix both share.
    ``new_target``: that position is not yet one of ``req``'s targets; the caller adds it
    (``SnapshotPlan.add_share_target``)."""

    req: Req
    position: int
    new_target: bool


def held_for_sharing(req: Req, prefix_len: int, running: list[Req], align: int) -> Hold | None:
    """Whether waiting ``req`` (resumable at ``prefix_len``) should wait for a running request
    that is about to snapshot a longer prefix both share: one that already aims for such a
    snapshot, or one still in prefill that has not yet passed the shared point. Reads the
    running requests, changes none of them (only ``req``'s own prefix cache)."""
    n_req = len(req.prompt_ids) + len(req.output_ids)
    ids = None
    for r in running:
        for t in r.snapshot_plan.share_targets:
            if prefix_len < t < n_req:
                ids = req.prefix_ids() if ids is None else ids
                if (ids[:t] == r.prefix_ids()[:t]).all():
                    return Hold(r, t, new_target=False)
        n_r = len(r.prompt_ids) + len(r.output_ids)
        if r.fed_len >= n_r - 1 or r.prompt_ids[0] != req.prompt_ids[0]:
            continue  # not in prefill any more, or nothing shared
        ids = req.prefix_ids() if ids is None else ids
        lcp = req.snapshot_plan.lcp_cache.get(r.rid)
        if lcp is None:
            lcp = req.snapshot_plan.lcp_cache[r.rid] = common_prefix_len(ids, r.prefix_ids())
        p = align_down(min(lcp, n_req - 1, n_r - 1), align)
        if p > prefix_len and p > r.fed_len and p > r.rc.tree_len:
            return Hold(r, p, new_target=True)
    return None


def pin_waiters(
    tree: RadixTree, holder: Req, position: int, node: TreeNode, waiting: list[Req]
) -> None:
    """``holder``'s state at ``position`` (``node``) is in the tree and others wait for it: pin
    it for every waiting request that can resume there (and has no deeper pin)."""
    ids = holder.prefix_ids()[:position]
    for w in waiting:
        if w.prompt_ids[0] != holder.prompt_ids[0]:
            continue
        if w.wait_pin is not None and w.wait_pin.depth >= position:
            continue
        limit = match_limit(w)
        cap = len(w.prompt_ids) + len(w.output_ids) - 1  # as RequestCache.match caps it
        if (cap if limit is None else min(cap, limit)) < position:
            continue
        if not (w.prefix_ids()[:position] == ids).all():
            continue
        unpin(tree, w)
        tree.pin_state(node)
        w.wait_pin = node


def pin_loaded(tree: RadixTree, waiting: list[Req]) -> None:
    """Waiting requests whose stored prefix has been loaded into the tree pin its state until
    admitted (and have no deeper pin): the snapshots and admissions of others would otherwise
    free it before they run, and a request asks the storage tier only once."""
    for w in waiting:
        t = w.loading
        node = t.landed if t is not None and t.done else None
        if node is None or node.parent is None or node.state_slot is None:
            continue  # no load, or its state was evicted already
        if w.wait_pin is not None and w.wait_pin.depth >= node.depth:
            continue
        unpin(tree, w)
        tree.pin_state(node)
        w.wait_pin = node


def unpin(tree: RadixTree | None, req: Req) -> None:
    """``req`` is admitted, or ends while waiting: release its pin."""
    if req.wait_pin is not None:
        tree.unpin_state(req.wait_pin)
        req.wait_pin = None


def check_pins(tree: RadixTree, waiting: list[Req]) -> None:
    """Every node's ``wait_pins`` counts exactly the waiting requests pinning it (integrity)."""
    want: dict[int, int] = {}
    for w in waiting:
        if w.wait_pin is not None:
            want[id(w.wait_pin)] = want.get(id(w.wait_pin), 0) + 1
            if w.wait_pin.parent is not None and w.wait_pin.wait_pins <= 0:
                raise IntegrityError(f"request {w.rid} pins a node that counts no pin")
    stack = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node.wait_pins != want.get(id(node), 0):
            raise IntegrityError(
                f"{node!r} counts {node.wait_pins} pins, {want.get(id(node), 0)} waiting "
                "requests pin it"
            )
