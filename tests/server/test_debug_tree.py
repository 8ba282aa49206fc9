"""``GET /debug/tree``: absent (404) unless ``--enable-debug-endpoints``; then behind
``--api-key`` (401 without it) and the radix tree of what was served as text/plain Mermaid or
DOT; bad parameters and a disabled cache are 400s naming the problem."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from mambaradix.cache.tree_view import mermaid_escape
from mambaradix.config import ServerConfig
from mambaradix.engine.engine import Engine
from mambaradix.server.launch import ServerThread

KEY = {"authorization": "Bearer k"}


def test_off_by_default(http) -> None:
    """The directory's shared server runs without the flag: the route does not exist."""
    assert http.get("/debug/tree").status_code == 404
    assert http.get("/debug/tree", params={"format": "dot"}).status_code == 404


@pytest.fixture(scope="module")
def debug_server() -> Iterator[tuple[Engine, ServerThread]]:
    cfg = ServerConfig(port=0, enable_debug_endpoints=True, api_key="k")
    with Engine(
        model_path="tiny:qwen3_next", skip_warmup=True, max_total_tokens=4096,
        max_mamba_cache_size=32, debug_integrity=True,
    ) as eng, ServerThread(eng, cfg) as st:  # fmt: skip
        yield eng, st


def test_the_tree_of_served_prompts(debug_server) -> None:
    eng, st = debug_server
    shared = "The radix tree keeps recurrent states beside attention KV."
    prompts = [shared + " First question?", shared + " Second one, longer than that?"]
    with httpx.Client(base_url=st.base_url, timeout=60) as c:
        assert c.get("/debug/tree").status_code == 401  # no key
        assert c.get("/debug/tree", headers={"authorization": "Bearer x"}).status_code == 401
        empty = c.get("/debug/tree", headers=KEY)
        assert empty.status_code == 200 and "0 nodes, 0 tok" in empty.text
        for prompt in prompts:
            r = c.post(
                "/v1/completions",
                headers=KEY,
                json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200
        r = c.get("/debug/tree", headers=KEY)
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert text.startswith("flowchart TD\n")
        ids = [eng.tokenizer.encode(p) for p in prompts]
        # the shared prefix's first tokens, decoded, open the first node under the root
        head = eng.tokenizer.decode(ids[0][:6])
        assert mermaid_escape(f'"{head}') in text
        for p in ids:  # each request's finished state: prompt + completion[:-1]
            assert f"depth {len(p) + 2}," in text
        dot = c.get("/debug/tree", headers=KEY, params={"format": "dot", "max_nodes": "1"})
        assert dot.status_code == 200
        assert dot.text.startswith("digraph radix_tree {") and dot.text.rstrip().endswith("}")
        assert "nodes cut" in dot.text and dot.text.count(" [label=") == 3  # root, 1, summary
        assert dot.text == eng.cache_tree("dot", 1)


@pytest.mark.parametrize(
    "params, message",
    [
        ({"format": "svg"}, "format must be 'mermaid' or 'dot'"),
        ({"max_nodes": "abc"}, "max_nodes must be an integer in [1, 10000]"),
        ({"max_nodes": "0"}, "max_nodes must be an integer in [1, 10000]"),
        ({"max_nodes": "10001"}, "max_nodes must be an integer in [1, 10000]"),
    ],
)
def test_bad_parameters_are_400s(debug_server, params: dict, message: str) -> None:
    _, st = debug_server
    r = httpx.get(st.base_url + "/debug/tree", headers=KEY, params=params, timeout=30)
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]


def test_a_disabled_cache_has_no_tree() -> None:
    cfg = ServerConfig(port=0, enable_debug_endpoints=True)
    with Engine(
        model_path="tiny:qwen3_next", skip_warmup=True, max_total_tokens=2048,
        disable_radix_cache=True,
    ) as eng, ServerThread(eng, cfg) as st:  # fmt: skip
        with pytest.raises(ValueError, match="radix cache is disabled"):
            eng.cache_tree()
        r = httpx.get(st.base_url + "/debug/tree", timeout=30)
        assert r.status_code == 400 and "--disable-radix-cache" in r.text
