"""Pictures of the radix tree (``cache.tree_view``), no model: every node with its counts, state /
tombstone / locked nodes drawn apart, the bound and its summary, both formats parsed back by
small checkers (which are themselves shown to catch broken text), tricky tokens escaped."""

from __future__ import annotations

import re

import pytest
from test_radix_helpers import make_tree, put, seq

from mambaradix.cache.radix import RadixTree, TreeNode
from mambaradix.cache.tree_view import check_args, render_tree

# ---------------------------------------------------------------------- format checkers

_M_NODE = re.compile(
    r'^  (?P<id>[A-Za-z]\w*)(?P<open>\(\(|\(|\[/|\[)"(?P<label>[^"]*)"'
    r"(?P<close>\)\)|\)|/\]|\])(?::::(?P<cls>\w+))?$"
)
_M_EDGE = re.compile(r"^  (?P<a>\w+(?: & \w+)*) (?P<arrow>-->|-\.->) (?P<b>\w+(?: & \w+)*)$")
_PAIRS = {"((": "))", "(": ")", "[/": "/]", "[": "]"}


def parse_mermaid(text: str) -> tuple[dict[str, dict], list[tuple[str, str, str]]]:
    """Nodes (id -> open bracket, label lines unescaped, class) and edges of the renderer's
    Mermaid; asserts that every line is a header, comment, node, edge or classDef, that ids
    are unique and that every edge's ends are declared."""
    lines = text.rstrip("\n").split("\n")
    assert lines[0] in ("flowchart TD", "graph TD"), lines[0]
    nodes: dict[str, dict] = {}
    edges = []
    classes = set()
    for line in lines[1:]:
        if m := _M_NODE.match(line):
            assert m["id"] not in nodes, f"duplicate id {m['id']}"
            assert _PAIRS[m["open"]] == m["close"], line
            # anything that could end or break a quoted label is an entity code
            raw = m["label"].replace("<br/>", "\n")
            assert not set(raw) & set('"[](){}<>|\\`'), f"unescaped character in {line!r}"
            label = re.sub(r"#(\d+);", lambda g: chr(int(g[1])), raw)
            nodes[m["id"]] = {"open": m["open"], "lines": label.split("\n"), "cls": m["cls"]}
        elif m := _M_EDGE.match(line):  # ``a & b --> c & d``: every pair
            for a in m["a"].split(" & "):
                edges.extend((a, m["arrow"], b) for b in m["b"].split(" & "))
        elif line.startswith("  classDef "):
            classes.add(line.split()[1])
        else:
            raise AssertionError(f"not Mermaid this checker knows: {line!r}")
    for a, _, b in edges:
        assert a in nodes and b in nodes, f"edge {a} -> {b} to an undeclared node"
    for n in nodes.values():
        assert n["cls"] is None or n["cls"] in classes, n
    return nodes, edges


_DOT_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_D_NODE = re.compile(r"^  (?P<id>\w+) \[(?P<attrs>.*)\];$")
_D_ATTR = re.compile(r'\w+=(?:"(?:[^"\\]|\\.)*"|[\w.#]+)')
_D_ATTRS = re.compile(rf"{_D_ATTR.pattern}(?:, {_D_ATTR.pattern})*")
_D_EDGE = re.compile(r"^  (?P<a>\w+) -> (?P<b>\w+)(?: \[(?P<attrs>.*)\])?;$")


def _dot_unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda g: "\n" if g[1] == "n" else g[1], s)


def parse_dot(text: str) -> tuple[dict[str, dict], list[tuple[str, str, str]]]:
    """Nodes (id -> label lines, attributes) and edges of the renderer's DOT; asserts balanced
    braces and brackets outside strings, one statement per line, declared edge ends."""
    bare = _DOT_STRING.sub('""', text)
    assert '"' not in bare.replace('""', ""), "a quote no string accounts for"
    assert bare.count("{") == bare.count("}") == 1, "braces unbalanced outside strings"
    assert bare.count("[") == bare.count("]"), "brackets unbalanced outside strings"
    lines = text.rstrip("\n").split("\n")
    assert lines[0] == "digraph radix_tree {" and lines[-1] == "}"
    nodes: dict[str, dict] = {}
    edges = []
    for line in lines[1:-1]:
        if line.startswith("  // ") or line.startswith("  node ["):
            continue
        if m := _D_EDGE.match(line):
            edges.append((m["a"], "->", m["b"]))
        elif m := _D_NODE.match(line):
            assert m["id"] not in nodes, f"duplicate id {m['id']}"
            assert _D_ATTRS.fullmatch(m["attrs"]), f"not an attribute list: {line!r}"
            label = re.match(r'label="((?:[^"\\]|\\.)*)"', m["attrs"])
            assert label, line
            attrs = dict(kv.split("=", 1) for kv in _D_ATTR.findall(m["attrs"][label.end() :]))
            nodes[m["id"]] = {
                "lines": _dot_unescape(label[1]).split("\n"),
                "attrs": attrs,
                "raw": m["attrs"],
            }
        else:
            raise AssertionError(f"not DOT this checker knows: {line!r}")
    for a, _, b in edges:
        assert a in nodes and b in nodes, f"edge {a} -> {b} to an undeclared node"
    return nodes, edges


def parse(text: str, fmt: str) -> tuple[dict[str, dict], list[tuple[str, str, str]]]:
    return parse_mermaid(text) if fmt == "mermaid" else parse_dot(text)


def kind_of(node: dict, fmt: str) -> str:
    """The drawn kind: 'state' / 'tomb' (+ 'Locked'), from shape and style, not from the text."""
    if fmt == "mermaid":
        shape = {"(": "state", "[": "tomb"}[node["open"]]
        assert node["cls"].startswith(shape), node
        return node["cls"]
    raw = node["raw"]
    shape = "state" if 'style="rounded,filled"' in raw else "tomb"
    assert shape == "state" or 'style="dashed"' in raw
    return shape + ("Locked" if "penwidth=3" in raw else "")


def by_head(nodes: dict[str, dict]) -> dict[str, dict]:
    """Tree nodes by their first label line (the ids preview, e.g. '[1 2 3]')."""
    return {n["lines"][0]: n for nid, n in nodes.items() if nid not in ("n0", "cut")}


FORMATS = ["mermaid", "dot"]

# ---------------------------------------------------------------------- trees


def scenario() -> RadixTree:
    """root ── [1 2 3]* ── [4 5] ──┬── [6 7]*       (test_radix's scenario)
                                └── [60 70]*
    └── [10 11 12]*"""
    tree, *_ = make_tree()
    for tokens in ([1, 2, 3], seq(1, 7), [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        put(tree, tokens)
    return tree


def wide(fan: int = 4, sub: int = 3) -> RadixTree:
    """``fan`` first-level nodes of 2 tokens (states), each with ``sub`` children of 3 tokens
    (states), and under each first child one more node of 1 token (a state)."""
    tree, *_ = make_tree(kv_size=1024, state_size=64)
    for i in range(fan):
        a = 100 * (i + 1)
        put(tree, [a, a + 1])
        for j in range(sub):
            put(tree, [a, a + 1, a + 10 * (j + 2), 7, 7])
        put(tree, [a, a + 1, a + 20, 7, 7, 5])
    return tree


def walk(tree: RadixTree) -> list[TreeNode]:
    out, stack = [], list(tree.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_node_with_its_counts(fmt: str) -> None:
    tree = scenario()
    nodes, edges = parse(render_tree(tree, fmt), fmt)
    heads = by_head(nodes)
    assert set(heads) == {"[1 2 3]", "[4 5]", "[6 7]", "[60 70]", "[10 11 12]"}
    assert heads["[1 2 3]"]["lines"][1] == "+3 tok, depth 3, 3 pages"
    assert heads["[4 5]"]["lines"][1:] == ["+2 tok, depth 5, 2 pages", "tombstone"]
    assert heads["[60 70]"]["lines"][1] == "+2 tok, depth 7, 2 pages"
    state_of = {tuple(n.key): n.state_slot for n in walk(tree)}
    assert heads["[6 7]"]["lines"][2] == f"state {state_of[(6, 7)]}"
    assert nodes["n0"]["lines"] == ["root", "5 nodes, 12 tok, 4 states, page 1"]
    assert "cut" not in nodes and len(edges) == 5
    # every edge goes from the parent's box to the child's
    name = {nid: n["lines"][0] for nid, n in nodes.items()}
    assert {(name[a], name[b]) for a, _, b in edges} == {
        ("root", "[1 2 3]"),
        ("root", "[10 11 12]"),
        ("[1 2 3]", "[4 5]"),
        ("[4 5]", "[6 7]"),
        ("[4 5]", "[60 70]"),
    }


@pytest.mark.parametrize("fmt", FORMATS)
def test_states_tombstones_and_locks_are_drawn_apart(fmt: str) -> None:
    tree = scenario()
    node67 = tree.match(seq(1, 7)).node
    tree.lock(node67)  # kv_lock on [6 7] and its ancestors [4 5], [1 2 3]
    node10 = tree.match([10, 11, 12]).node
    tree.lock(node10)
    tree.lock_state(node10)
    node10.stored = True
    heads = by_head(parse(render_tree(tree, fmt), fmt)[0])
    kinds = {h: kind_of(n, fmt) for h, n in heads.items()}
    assert kinds == {
        "[1 2 3]": "stateLocked",
        "[4 5]": "tombLocked",
        "[6 7]": "stateLocked",
        "[60 70]": "state",
        "[10 11 12]": "stateLocked",
    }
    assert heads["[4 5]"]["lines"][-1] == "kv_lock 1, state_lock 0"
    assert heads["[10 11 12]"]["lines"][2:] == [
        f"state {node10.state_slot}, stored",
        "kv_lock 1, state_lock 1",
    ]
    assert len(heads["[60 70]"]["lines"]) == 3  # no lock line when unlocked
    tree.unlock(node67)
    tree.unlock_state(node10)
    tree.unlock(node10)
    text = render_tree(tree, fmt)
    heads = by_head(parse(text, fmt)[0])
    assert kind_of(heads["[6 7]"], fmt) == "state" and kind_of(heads["[4 5]"], fmt) == "tomb"
    if fmt == "mermaid":  # only the classes in use are defined
        assert "classDef tomb " in text and "Locked" not in text and "classDef cut" not in text


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_tombstone_renders_differently_from_a_state_there(fmt: str) -> None:
    """Negative control: the same tree, once with a state at [1 2 3] and once without."""
    with_state, without = make_tree()[0], make_tree()[0]
    for tree in (with_state, without):
        put(tree, seq(1, 5))
        put(tree, [1, 2, 3, 9, 9])  # splits [1..5] at 3: a tombstone [1 2 3]
    put(with_state, [1, 2, 3])  # the state lands on the split node
    a, b = render_tree(with_state, fmt), render_tree(without, fmt)
    assert a != b
    ka = kind_of(by_head(parse(a, fmt)[0])["[1 2 3]"], fmt)
    kb = kind_of(by_head(parse(b, fmt)[0])["[1 2 3]"], fmt)
    assert (ka, kb) == ("state", "tomb")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_bound_keeps_the_shallow_nodes_and_counts_the_cut(fmt: str) -> None:
    tree = wide(fan=4, sub=3)  # 4 + 12 + 4 = 20 nodes
    assert tree.num_nodes() == 20
    full_nodes, _ = parse(render_tree(tree, fmt, max_nodes=20), fmt)
    assert len(full_nodes) == 21 and "cut" not in full_nodes
    nodes, edges = parse(render_tree(tree, fmt, max_nodes=6), fmt)
    heads = by_head(nodes)
    assert len(heads) == 6
    # breadth-first, siblings in token order: the 4 first-level nodes, then [100 101]'s first two
    assert list(heads)[:4] == ["[100 101]", "[200 201]", "[300 301]", "[400 401]"]
    assert list(heads)[4:] == ["[120 7 7]", "[130 7 7]"]
    shown = {tuple(int(t) for t in h.strip("[]").split()) for h in heads}
    cut = [n for n in walk(tree) if tuple(n.key) not in shown]
    assert len(cut) == 14
    tokens, states = sum(len(n.key) for n in cut), sum(n.state_slot is not None for n in cut)
    assert nodes["cut"]["lines"] == ["14 nodes cut", f"{tokens} tok, {states} states not shown"]
    # [140 7 7], [5] under [120 7 7], and the three other first-level nodes' subtrees
    assert (tokens, states) == (3 + 1 + 3 * (3 * 3 + 1), 14)
    total = sum(len(n.key) for n in walk(tree))
    assert nodes["n0"]["lines"][1] == f"20 nodes, {total} tok, 20 states, page 1"
    # dotted edges to the summary from every shown node with a child cut
    to_cut = {a for a, _, b in edges if b == "cut"}
    names = {nid: n["lines"][0] for nid, n in nodes.items()}
    first_level = {"[100 101]", "[200 201]", "[300 301]", "[400 401]"}
    assert {names[a] for a in to_cut} == first_level | {"[120 7 7]"}
    if fmt == "dot":
        comment = f"  // 14 nodes cut / {tokens} tok, {states} states not shown\n"
        assert comment in render_tree(tree, fmt, max_nodes=6)


def test_the_bound_of_one_node_and_an_empty_tree() -> None:
    tree = scenario()
    nodes, _ = parse_mermaid(render_tree(tree, max_nodes=1))
    assert set(by_head(nodes)) == {"[1 2 3]"}
    assert nodes["cut"]["lines"][0] == "4 nodes cut"
    empty = make_tree()[0]
    for fmt in FORMATS:
        nodes, edges = parse(render_tree(empty, fmt), fmt)
        assert set(nodes) == {"n0"} and edges == []


def test_order_is_by_tokens_and_deterministic() -> None:
    """Siblings by token value (9 before 10, not as strings), whatever the insertion order;
    two trees with the same content give the same text but for the slot numbers."""
    seqs = [[10, 1], [9, 1], [100, 1], [9, 2, 3], [9, 1, 5]]
    t1, t2 = make_tree()[0], make_tree()[0]
    for s in seqs:
        put(t1, s)
    for s in reversed(seqs):
        put(t2, s)
    a, b = render_tree(t1, "dot"), render_tree(t2, "dot")
    assert a == render_tree(t1, "dot")
    strip = lambda s: re.sub(r"state \d+", "state N", s)  # noqa: E731
    assert strip(a) == strip(b)
    heads = list(by_head(parse_dot(a)[0]))
    assert heads[:3] == ["[9]", "[10 1]", "[100 1]"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_page_size_two_counts_pages(fmt: str) -> None:
    tree, *_ = make_tree(page_size=2)
    put(tree, seq(1, 6))
    put(tree, [1, 2, 3, 4, 9, 9])
    heads = by_head(parse(render_tree(tree, fmt), fmt)[0])
    assert heads["[1 2 3 4]"]["lines"][1] == "+4 tok, depth 4, 2 pages"
    assert heads["[9 9]"]["lines"][1] == "+2 tok, depth 6, 1 page"


TRICKY = {
    1: 'say "hi"',
    2: "[x](y){z}",
    3: "<b>&amp;</b>",
    4: "a\\nb\\",
    5: "#35;%% --> |pipe|;",
    6: "line\nbreak\ttab",
    7: "end",
    8: "日本語",
}


class TrickyTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(TRICKY[i] for i in ids)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tok", sorted(TRICKY))
def test_tricky_tokens_are_escaped(fmt: str, tok: int) -> None:
    tree, *_ = make_tree()
    put(tree, [tok, 50])
    put(tree, [tok, 51])
    nodes, _ = parse(render_tree(tree, fmt, tokenizer=TrickyTokenizer()), fmt)
    first = [n for nid, n in nodes.items() if n["lines"][1].startswith("+1 tok, depth 1")]
    assert len(first) == 1
    shown = TRICKY[tok].replace("\n", "\\n").replace("\t", "\\t")
    assert first[0]["lines"][0] == f'"{shown}"'


def test_decoded_text_is_cut_and_undecodable_ids_fall_back() -> None:
    tree, *_ = make_tree()
    put(tree, [1] * 9)
    put(tree, [1] * 8 + [99])  # 99 is not in TRICKY: the ids are shown
    nodes, _ = parse_mermaid(render_tree(tree, tokenizer=TrickyTokenizer()))
    heads = [n["lines"][0] for nid, n in nodes.items() if nid != "n0"]
    assert heads[0] == '"' + ('say "hi"' * 3)[:24] + '..."'
    assert sorted(heads[1:]) == ['"say "hi""', "[99]"]


def test_bad_arguments_name_the_fix() -> None:
    tree = scenario()
    with pytest.raises(ValueError, match="format 'svg' is not one of mermaid, dot"):
        render_tree(tree, "svg")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_nodes must be an integer >= 1"):
            check_args("dot", bad)  # type: ignore[arg-type]


def test_the_checkers_catch_broken_text() -> None:
    """Negative controls: the format checkers above fail on what a broken renderer would write."""
    good_dot = render_tree(scenario(), "dot")
    parse_dot(good_dot)
    with pytest.raises(AssertionError):  # an unescaped quote inside a label
        parse_dot(good_dot.replace('label="[1 2 3]', 'label="[1 "2" 3]'))
    with pytest.raises(AssertionError):  # an edge to a node never declared
        parse_dot(good_dot.replace("  n0 -> n1;", "  n0 -> n9;"))
    with pytest.raises(AssertionError):  # a lost closing brace
        parse_dot(good_dot.rstrip("}\n") + "\n")
    good = render_tree(scenario())
    parse_mermaid(good)
    with pytest.raises(AssertionError, match="duplicate id"):
        parse_mermaid(good.replace("  n2(", "  n1(", 1))
    with pytest.raises(AssertionError, match="unescaped"):
        parse_mermaid(good.replace("#91;1 2 3#93;", "[1 2 3]"))
    with pytest.raises(AssertionError):
        parse_mermaid(good.replace("flowchart TD", "flowchart"))
