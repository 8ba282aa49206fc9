"""``serve --dp-size 2`` behind the SGLang Model Gateway, tested as a client would use it:
registration under the real model id, the API key on the gateway and each replica, a
shared-prefix text workload through ``mambaradix bench`` (hit rate against one replica alone,
per-replica figures), the gateway's view of our ``/get_load`` under ``power_of_two``, a replica
killed (taken out of the gateway by the launcher at once, restarted, put back), and SIGTERM
stopping everything. The tests share one stack and run in file order (the last one stops
it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from scaleout_stack import API_KEY, AUTH, MODEL, alive, children

from mambaradix.bench.remote import read_counters
from mambaradix.cli import main as cli_main
from mambaradix.server.ports import ReservedPort

BENCH = [
    "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "4",
    "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "256",
    "--gsp-question-len", "32", "--gsp-output-len", "4", "--gsp-interleave",
    "--max-concurrency", "2", "--disable-tqdm", "--api-key", API_KEY,
]  # fmt: skip


def completion(url: str, prompt: str, headers: dict | None = None, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, headers=AUTH if headers is None
                      else headers, timeout=120)  # fmt: skip


def flush_all(stack) -> None:
    r = httpx.post(stack.url + "/flush_cache", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text


def test_gateway_registers_the_real_model_id(stack):
    models = httpx.get(stack.url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]  # not "unknown"
    workers = stack.workers()
    assert {w["model_id"] for w in workers} == {MODEL}
    assert all(w["metadata"]["served_model_name"] == MODEL for w in workers)
    r = completion(stack.url, "Hello there")
    assert r.status_code == 200 and r.json()["model"] == MODEL
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", stack.url + "/v1/completions", json=body, headers=AUTH) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    r = httpx.post(stack.url + "/generate", headers=AUTH, timeout=60,
                   json={"text": "native through the gateway",
                         "sampling_params": {"max_new_tokens": 3}})  # fmt: skip
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3


def test_api_key_on_gateway_and_replicas(stack):
    assert completion(stack.url, "no key", headers={}).status_code == 401
    assert (
        completion(stack.url, "bad key", headers={"Authorization": "Bearer x"}).status_code == 401
    )
    for url in stack.replicas:
        assert completion(url, "direct, no key", headers={}).status_code == 401
        assert completion(url, "direct, with key").status_code == 200
        assert httpx.get(url + "/get_server_info", timeout=10).status_code == 401
    assert completion(stack.url, "with key").status_code == 200


def _bench(base_url: str, tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    code = cli_main(["bench", "--base-url", base_url, *BENCH, "--output-json", str(out), *extra])
    report = json.loads(out.read_text())
    assert code == 0 and report["results"]["failed"] == 0  # bench through anything: 0 failed
    return report["results"]


def test_shared_prefix_hit_rate_through_gateway(stack, tmp_path):
    """Two requests in flight at most: within --router-balance-abs-threshold (8), so every
    request goes where the gateway's tree says and the hit rate is one replica's."""
    flush_all(stack)
    one = _bench(stack.replicas[0], tmp_path, "one")
    flush_all(stack)
    both = _bench(stack.url, tmp_path, "gateway", "--replica-urls", ",".join(stack.replicas))
    print("hit rates: one replica", one["cache_hit_rate"], "gateway", both["cache_hit_rate"])
    assert one["cache_hit_rate"] > 0.3  # the workload does share prefixes
    assert both["cache_hit_rate"] >= 0.9 * one["cache_hit_rate"], (one, both)
    reps = both["replicas"]
    assert len(reps) == 2
    # every prompt token of the run (+ the warm-up request) was served by one of the replicas
    assert sum(r["prompt_tokens"] for r in reps) >= both["total_input_tokens"]
    assert sum(r["cached_tokens"] for r in reps) >= both["cached_tokens"]


def test_power_of_two_sees_our_loads(stack):
    port, metrics = ReservedPort(), ReservedPort()  # held until the gateway stops
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
           "--port", str(port.port), "--worker-urls", *stack.replicas,
           "--policy", "power_of_two", "--api-key", API_KEY, "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics.port)]  # fmt: skip
    gw = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port.port}"
    stop = threading.Event()

    def load(i: int) -> None:
        body = {"text": f"load {i} " * 40, "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}  # fmt: skip
        with httpx.Client(timeout=120, headers=AUTH) as c:
            with c.stream("POST", url + "/generate", json=body) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        break

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    if len(httpx.get(url + "/workers", headers=AUTH).json()["workers"]) == 2:
                        break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        idle = httpx.get(url + "/get_loads", headers=AUTH, timeout=10).json()["workers"]
        assert len(idle) == 2 and all(w["load"] >= 0 for w in idle)  # parsed (-1: not parsed)
        for t in threads:
            t.start()
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(x > 0 for x in seen):
            loads = httpx.get(url + "/get_loads", headers=AUTH, timeout=10).json()["workers"]
            seen = [w["load"] for w in loads]
            time.sleep(0.2)
        assert any(x > 0 for x in seen), seen
        assert all(x >= 0 for x in seen), seen
    finally:
        stop.set()
        for t in threads:
            if t.ident is not None:
                t.join(120)
        gw.send_signal(signal.SIGTERM)
        gw.wait(30)
        port.close()
        metrics.close()


def test_killed_replica_is_routed_around_and_restarted(stack):
    """The launcher takes a dead replica out of the gateway at once (its worker API), so every
    request after that succeeds; the gateway's own health check runs only every 600 s in this
    stack (conftest), so it cannot be what routed around the replica. The restarted replica is
    put back into the gateway and receives requests again."""
    victim = stack.replicas[0]
    pid = stack.replica_pid(victim)
    assert pid is not None
    prompts = [f"shared prefix {g} " * 30 + f"question {i}" for g in range(4) for i in range(2)]
    for p in prompts:  # fill the gateway's tree: some of these prefixes now point at the victim
        assert completion(stack.url, p).status_code == 200
    subprocess.run(["kill", "-9", str(pid)], check=True)
    t0 = time.monotonic()
    while victim in [w["url"] for w in stack.workers()]:  # how fast is printed, not asserted
        assert time.monotonic() - t0 < 60, "the launcher did not remove the dead replica"
        time.sleep(0.02)
    removed_after = time.monotonic() - t0
    codes = [completion(stack.url, p + " again").status_code for p in prompts]
    assert codes == [200] * len(prompts)  # every later request succeeds
    deadline = time.monotonic() + 180
    while True:  # restarted and put back into the gateway (by the launcher: POST /workers)
        listed = {w["url"]: w["is_healthy"] for w in stack.workers()}
        if listed.get(victim) and stack.replica_pid(victim) not in (None, pid):
            break
        assert time.monotonic() < deadline, f"the killed replica did not come back: {listed}"
        time.sleep(0.5)
    before = read_counters(victim, API_KEY)["prompt"]
    # In this stack sglang-router 0.3.2 sends every cache miss to the survivor and never to a
    # worker added back through its API: the restarted replica gets work when the in-flight
    # requests are imbalanced (--router-balance-abs-threshold, 8 by default), so a burst of
    # concurrent requests must reach it
    for burst in range(3):  # a slow machine may finish some before the others arrive
        fresh = [f"a new prefix {burst} {g} " * 30 for g in range(24)]
        with ThreadPoolExecutor(len(fresh)) as pool:
            codes = list(
                pool.map(
                    lambda p: completion(stack.url, p, max_tokens=64, ignore_eos=True).status_code,
                    fresh,
                )
            )
        assert codes == [200] * len(fresh)
        if read_counters(victim, API_KEY)["prompt"] > before:
            break
    assert read_counters(victim, API_KEY)["prompt"] > before, "no request reached it again"
    log = stack.log.read_text()
    assert "removing it from the gateway" in log and "restarting it" in log
    print(f"dead replica out of the gateway {removed_after * 1000:.0f} ms after the kill")


def test_sigterm_stops_every_child(stack):
    kids = children(stack.proc.pid)
    assert len(kids) == 3  # two replicas and the gateway
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(60) == 0
    deadline = time.monotonic() + 60
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(k) for k in kids)
