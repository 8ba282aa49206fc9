"""Pictures of the radix tree: ``render_tree`` writes a ``RadixTree`` as Mermaid or Graphviz DOT
text, for people who would rather look than read (``Engine.cache_tree``, ``GET /debug/tree``).

One box per node, breadth-first from the root with siblings in token order, so the same tree
always gives the same text and a cut keeps the shallow structure::

    root ── "The radix" +9 tok, depth 9, tombstone      dashed grey box (KV only: a split)
              ├── " tree" +5 tok, depth 14, state 3     rounded green box (a resume point)
              └── " cache" +6 tok, depth 15, state 4    (a thick red border when locked)
    2 nodes cut, 12 tok, 1 state not shown               one summary box, dotted edges from
                                                         the shown nodes with children cut
Each box says its tokens (``len(key)``), its depth, its KV pages (``len(key) // page_size``),
its state slot (and ``stored``: also in the storage tier) or that it is a tombstone, and its
locks when it has any (a thick red border). A reader of the tree only: it touches no LRU, takes
no lock, and must run where the tree is not being changed (the engine's thread).
"""

from __future__ import annotations

import string
import unicodedata
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mambaradix.cache.radix import RadixTree
from mambaradix.cache.tree_node import TreeNode

FORMATS = ("mermaid", "dot")
PREVIEW_TOKENS = 6  # tokens decoded (or ids listed) per box
PREVIEW_CHARS = 24  # characters of the decoded text kept

# Mermaid class of a node kind: fill, border and text colours
_MERMAID_CLASSES = {
    "state": "fill:#dcedc8,stroke:#33691e,color:#1b1b1b",
    "tomb": "fill:#f5f5f5,stroke:#9e9e9e,stroke-dasharray:4 3,color:#616161",
    "stateLocked": "fill:#dcedc8,stroke:#c62828,stroke-width:3px,color:#1b1b1b",
    "tombLocked": "fill:#f5f5f5,stroke:#c62828,stroke-width:3px,stroke-dasharray:4 3,color:#616161",
    "cut": "fill:#fff8e1,stroke:#ff8f00,stroke-dasharray:2 2,color:#5d4037",
}
# DOT attributes of the same kinds
_DOT_STYLES = {
    "state": 'shape=box, style="rounded,filled", fillcolor="#dcedc8", color="#33691e"',
    "tomb": 'shape=box, style="dashed", color="#9e9e9e", fontcolor="#616161"',
    "stateLocked": 'shape=box, style="rounded,filled", fillcolor="#dcedc8", color="#c62828", '
    "penwidth=3",
    "tombLocked": 'shape=box, style="dashed", color="#c62828", fontcolor="#616161", penwidth=3',
    "cut": 'shape=note, style="dashed", color="#ff8f00"',
    "root": "shape=circle",
}
_MERMAID_PLAIN = set(string.ascii_letters + string.digits + " ,.:_-+=/!?*@$^~'")

Box = tuple[str, str, list[str]]  # (id, kind, label lines)


@dataclass(slots=True)
class CutSummary:
    """What a bounded picture left out: nodes, their tokens and their state snapshots."""

    nodes: int = 0
    tokens: int = 0
    states: int = 0


def render_tree(
    tree: RadixTree,
    fmt: str = "mermaid",
    max_nodes: int = 200,
    tokenizer: object | None = None,
) -> str:
    """The tree as Mermaid (``flowchart TD``) or DOT (``digraph``) text.

    At most ``max_nodes`` nodes besides the root, taken breadth-first with siblings sorted by
    their tokens; what is left out is counted in one summary box (and a comment). With a
    ``tokenizer`` (anything with ``decode(list[int]) -> str``) each box starts with its first
    tokens decoded, else with their ids. Raises ``ValueError`` for an unknown format or a
    ``max_nodes`` below 1."""
    check_args(fmt, max_nodes)
    shown, cut, frontier = _select(tree, max_nodes)
    ids = {node: f"n{i}" for i, node in enumerate(shown)}
    preview = _previewer(tokenizer)
    boxes: list[Box] = [
        (ids[node], _kind(node), _lines(tree, node, preview) if node is not tree.root else [])
        for node in shown
    ]
    edges = [(ids[n.parent], ids[n]) for n in shown if n.parent is not None]
    root_lines = _root_lines(tree, shown, cut)
    cut_lines = _cut_lines(cut) if cut.nodes else []
    cut_from = [ids[n] for n in frontier]
    if fmt == "mermaid":
        return _mermaid(boxes, edges, root_lines, cut_lines, cut_from)
    return _dot(boxes, edges, root_lines, cut_lines, cut_from)


def check_args(fmt: str, max_nodes: int) -> None:
    """Raise ``ValueError`` (naming the fix) for arguments ``render_tree`` does not take."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")


# ---------------------------------------------------------------------- what is shown


def _children(node: TreeNode) -> list[TreeNode]:
    # by tokens: siblings differ in their first token (first page), so this is "by first token"
    return sorted(node.children.values(), key=lambda c: c.key)


def _select(tree: RadixTree, max_nodes: int) -> tuple[list[TreeNode], CutSummary, list[TreeNode]]:
    """(root + up to ``max_nodes`` nodes breadth-first, what was cut, the shown nodes with a
    child cut). Everything past the bound is walked only to be counted."""
    shown = [tree.root]
    frontier: list[TreeNode] = []
    cut = CutSummary()
    queue: deque[TreeNode] = deque([tree.root])
    while queue:
        node = queue.popleft()
        was_cut = False
        for child in _children(node):
            if len(shown) <= max_nodes:
                shown.append(child)
                queue.append(child)
            else:
                was_cut = True
                _count(child, cut)
        if was_cut:
            frontier.append(node)
    return shown, cut, frontier


def _count(node: TreeNode, cut: CutSummary) -> None:
    stack = [node]
    while stack:
        n = stack.pop()
        cut.nodes += 1
        cut.tokens += len(n.key)
        cut.states += n.state_slot is not None
        stack.extend(n.children.values())


def _kind(node: TreeNode) -> str:
    if node.parent is None:
        return "root"
    kind = "state" if node.state_slot is not None else "tomb"
    return kind + "Locked" if node.kv_lock or node.state_lock else kind


def _lines(tree: RadixTree, node: TreeNode, preview: Callable[[list[int]], str]) -> list[str]:
    lines = [
        preview(node.key),
        f"+{len(node.key)} tok, depth {node.depth}, "
        + _plural(len(node.key) // tree.page_size, "page"),
    ]
    if node.state_slot is None:
        lines.append("tombstone")
    else:
        lines.append(f"state {node.state_slot}" + (", stored" if node.stored else ""))
    if node.kv_lock or node.state_lock:
        lines.append(f"kv_lock {node.kv_lock}, state_lock {node.state_lock}")
    if node.branched and node.state_slot is not None:  # its state is evicted last but pins
        lines.append("branch point")
    if node.wait_pins:
        lines.append(f"awaited by {_plural(node.wait_pins, 'waiting request')}")
    return lines


def _root_lines(tree: RadixTree, shown: list[TreeNode], cut: CutSummary) -> list[str]:
    nodes = len(shown) - 1 + cut.nodes
    tokens = sum(len(n.key) for n in shown) + cut.tokens
    states = sum(n.state_slot is not None for n in shown) + cut.states
    counts = f"{_plural(nodes, 'node')}, {tokens} tok, {_plural(states, 'state')}"
    return ["root", f"{counts}, page {tree.page_size}"]


def _cut_lines(cut: CutSummary) -> list[str]:
    return [
        f"{_plural(cut.nodes, 'node')} cut",
        f"{cut.tokens} tok, {_plural(cut.states, 'state')} not shown",
    ]


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _previewer(tokenizer: object | None) -> Callable[[list[int]], str]:
    def ids(key: list[int]) -> str:
        head = " ".join(str(t) for t in key[:PREVIEW_TOKENS])
        return f"[{head}{' ...' if len(key) > PREVIEW_TOKENS else ''}]"

    if tokenizer is None:
        return ids

    def text(key: list[int]) -> str:
        try:
            s = tokenizer.decode(key[:PREVIEW_TOKENS])  # type: ignore[attr-defined]
        except Exception:  # a token the tokenizer cannot decode: show the ids instead
            return ids(key)
        s = _visible(s)
        more = len(key) > PREVIEW_TOKENS or len(s) > PREVIEW_CHARS
        return '"' + s[:PREVIEW_CHARS] + ('..."' if more else '"')

    return text


def _visible(s: str) -> str:
    """Control and format characters (newlines, tabs, zero-width ones) as escapes."""
    out = []
    for ch in s:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif unicodedata.category(ch)[0] in "CZ" and ch != " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


# ---------------------------------------------------------------------- the two formats


def mermaid_escape(s: str) -> str:
    """Text safe inside a quoted Mermaid label: anything but plain characters as an entity
    code (``#34;`` for '"'), so quotes, brackets, '<' and '#' cannot end or break the label."""
    return "".join(
        ch if ch in _MERMAID_PLAIN or (ch.isalnum() and ord(ch) > 127) else f"#{ord(ch)};"
        for ch in s
    )


def dot_escape(s: str) -> str:
    """Text safe inside a quoted DOT string: backslashes doubled (DOT reads ``\\n``, ``\\l``),
    quotes escaped."""
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _mermaid(
    boxes: list[Box],
    edges: list[tuple[str, str]],
    root_lines: list[str],
    cut_lines: list[str],
    cut_from: list[str],
) -> str:
    """One line per node, per parent's edges (``a --> b & c``) and per class used: short
    enough to paste into a README, where GitHub draws it."""
    out = ["flowchart TD"]
    for nid, kind, lines in boxes:
        label = "<br/>".join(mermaid_escape(x) for x in (root_lines if kind == "root" else lines))
        if kind == "root":
            out.append(f'  {nid}(("{label}"))')
        elif kind.startswith("state"):
            out.append(f'  {nid}("{label}"):::{kind}')
        else:
            out.append(f'  {nid}["{label}"]:::{kind}')
    children: dict[str, list[str]] = {}
    for a, b in edges:
        children.setdefault(a, []).append(b)
    out.extend(f"  {a} --> {' & '.join(bs)}" for a, bs in children.items())
    if cut_lines:  # the summary box says what was cut (DOT has it as a comment too)
        label = "<br/>".join(mermaid_escape(x) for x in cut_lines)
        out.append(f'  cut[/"{label}"/]:::cut')
        if cut_from:
            out.append(f"  {' & '.join(cut_from)} -.-> cut")
    used = {kind for _, kind, _ in boxes} | ({"cut"} if cut_lines else set())
    out.extend(
        f"  classDef {name} {style}" for name, style in _MERMAID_CLASSES.items() if name in used
    )
    return "\n".join(out) + "\n"


def _dot(
    boxes: list[Box],
    edges: list[tuple[str, str]],
    root_lines: list[str],
    cut_lines: list[str],
    cut_from: list[str],
) -> str:
    out = ["digraph radix_tree {", '  node [fontname="Helvetica", fontsize=10];']
    if cut_lines:
        out.append(f"  // {' / '.join(cut_lines)}")
    for nid, kind, lines in boxes:
        label = "\\n".join(dot_escape(x) for x in (root_lines if kind == "root" else lines))
        out.append(f'  {nid} [label="{label}", {_DOT_STYLES[kind]}];')
    for a, b in edges:
        out.append(f"  {a} -> {b};")
    if cut_lines:
        label = "\\n".join(dot_escape(x) for x in cut_lines)
        out.append(f'  cut [label="{label}", {_DOT_STYLES["cut"]}];')
        out.extend(f"  {a} -> cut [style=dotted];" for a in cut_from)
    out.append("}")
    return "\n".join(out) + "\n"
