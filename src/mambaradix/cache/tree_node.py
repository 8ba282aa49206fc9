"""Records of the radix tree: the node, and the results of match and insert."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mambaradix.cache.lru import LRULink

CMP_STEP = 64  # tokens compared per C-level slice comparison before the per-token scan


@dataclass(slots=True, eq=False)
class TreeNode:
    key: list[int]
    kv: torch.Tensor
    state_slot: int | None
    parent: TreeNode | None
    children: dict = field(default_factory=dict)
    kv_lock: int = 0
    state_lock: int = 0
    depth: int = 0
    stored: bool = False  # its prefix and state were also written to the storage tier
    wait_pins: int = 0  # waiting requests that expect to resume from its state (soft pins)
    path_pins: int = 0  # wait_pins of the states at or below it: its KV goes last if > 0
    branched: bool = False  # has had two children: requests went on from it in two ways
    kv_link: LRULink = field(default=None)  # type: ignore[assignment]
    st_link: LRULink = field(default=None)  # type: ignore[assignment]
    st_entry: list | None = None  # its entry in the ``value`` state policy's heap

    def __post_init__(self) -> None:
        self.kv_link = LRULink(self)
        self.st_link = LRULink(self)

    def __repr__(self) -> str:
        key = self.key if len(self.key) <= 8 else [*self.key[:8], "..."]
        return (
            f"TreeNode(key={key}, depth={self.depth}, state={self.state_slot}, "
            f"kv_lock={self.kv_lock}, state_lock={self.state_lock})"
        )


@dataclass(slots=True)
class MatchResult:
    """``kv_len``: longest matched KV prefix (whole pages, may end mid-edge); ``node``: deepest
    node with a state at depth <= limit (root if none); ``prefix_len`` = its depth;
    ``kv_slots``: KV slots of tokens [0, prefix_len) (a fresh tensor)."""

    kv_len: int
    prefix_len: int
    node: TreeNode
    kv_slots: torch.Tensor


@dataclass(slots=True)
class InsertResult:
    """``existing_len``: leading tokens already in the tree before the insert; ``node``: the node
    ending at ``inserted_len``; ``state_attached``: the given state slot now belongs to the tree
    (False: the caller still owns and must free it). ``inserted_len`` is ``len(tokens)`` except
    when no state was given and the tokens extend past the tree: a stateless leaf can't be kept,
    so the tail is not inserted and ``kv_slots[inserted_len:]`` stay the caller's."""

    existing_len: int
    node: TreeNode
    state_attached: bool
    inserted_len: int = 0


def common_prefix_len(key: list[int], tokens: list[int], pos: int) -> int:
    """Length of the common prefix of ``key`` and ``tokens[pos:]``."""
    n = min(len(key), len(tokens) - pos)
    i = 0
    while i + CMP_STEP <= n and key[i : i + CMP_STEP] == tokens[pos + i : pos + i + CMP_STEP]:
        i += CMP_STEP
    while i < n and key[i] == tokens[pos + i]:
        i += 1
    return i
