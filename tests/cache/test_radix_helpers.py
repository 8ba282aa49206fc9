"""Shared helpers for the radix tree tests (no tests here): tiny pools and a tree over them."""

from __future__ import annotations

import torch

from mambaradix.cache.kv_pool import KVPool
from mambaradix.cache.radix import InsertResult, RadixTree, TreeNode
from mambaradix.cache.state_pool import StatePool
from mambaradix.core import KVSpec, StateLayerSpec, StateSpec

TINY_KV = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1)
TINY_STATE = StateSpec(layers=(StateLayerSpec(conv_shape=(2, 1), temporal_shape=(1, 1, 2)),))


def make_tree(
    kv_size: int = 256, state_size: int = 16, page_size: int = 1, state_policy: str = "lru"
) -> tuple[RadixTree, KVPool, StatePool]:
    kv_pool = KVPool(TINY_KV, kv_size, page_size=page_size)
    state_pool = StatePool(TINY_STATE, state_size)
    tree = RadixTree(kv_pool, state_pool, page_size=page_size, state_policy=state_policy)
    return tree, kv_pool, state_pool


def put(tree: RadixTree, tokens: list[int], state: bool = True) -> InsertResult:
    """Insert ``tokens`` with freshly allocated KV (and a state slot), freeing what the tree
    does not take, as a finishing request would."""
    kv = tree.kv_pool.alloc(len(tokens))
    assert kv is not None, "test pool too small"
    slot = tree.state_pool.alloc(1)[0] if state else None
    res = tree.insert(tokens, kv, slot)
    if slot is not None and not res.state_attached:
        tree.state_pool.free([slot])
    if res.inserted_len < len(tokens):
        tree.kv_pool.free(kv[res.inserted_len :])
    return res


def shape(tree: RadixTree) -> dict:
    """The tree as nested dicts: (key tuple, has_state) -> children."""

    def walk(node: TreeNode) -> dict:
        return {
            (tuple(c.key), c.state_slot is not None): walk(c)
            for c in sorted(node.children.values(), key=lambda c: c.key)
        }

    return walk(tree.root)


def seq(a: int, b: int) -> list[int]:
    return list(range(a, b + 1))


def as_list(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.tolist()]
