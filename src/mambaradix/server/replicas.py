"""``mambaradix serve --dp-size N``: N engine processes behind the SGLang Model Gateway.

The launcher starts N ``mambaradix serve`` replicas on local ports it holds for its whole
life (``server.ports.ReservedPort``: no other process takes one before its replica binds it,
or while a replica restarts), each with ``--num-threads`` threads (default ``cores // N``),
waits until each answers ``/health``, then starts the gateway from the ``sglang-router``
package (``python -m sglang_router.launch_router``) on ``--host``/``--port`` with
``--router-policy`` and every replica's URL. There is no routing code here: the gateway
routes, health-checks, retries and circuit-breaks. The launcher only supervises:

- a replica that exits is taken out of the gateway at once, through the gateway's worker API
  (``DELETE /workers/{id}`` of sglang-router 0.3.2; a thread waits on each replica process, so
  this happens within milliseconds of its death instead of at the gateway's next health check,
  which left requests routed to the dead replica failing meanwhile), started again on the same
  port, and put back (``POST /workers``) once it answers ``/health``;
- the gateway exiting, or SIGTERM / SIGINT to the launcher, stops everything: SIGTERM is
  forwarded to every child, each gets ``STOP_GRACE_S`` to exit, then SIGKILL;
- children get SIGTERM from the kernel if the launcher itself is killed (PR_SET_PDEATHSIG).

``--api-key`` protects the gateway and every replica; the gateway is given the key to reach
the replicas.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from mambaradix.config import EngineConfig, ServerConfig, opt
from mambaradix.server.ports import ReservedPort

logger = logging.getLogger(__name__)

POLICIES = ["cache_aware", "round_robin", "power_of_two", "random"]
STOP_GRACE_S = 15.0
HEALTH_TIMEOUT_S = 600.0
POLL_S = 0.5


@dataclass
class ScaleOutConfig:
    dp_size: int = opt(
        1,
        "Engine replicas. Above 1, N processes are started behind the SGLang Model Gateway "
        "(pip install 'mambaradix[router]'), which listens on --host/--port.",
    )
    router_policy: str = opt(
        "cache_aware", "Gateway routing policy (with --dp-size > 1).", POLICIES
    )
    router_balance_abs_threshold: int = opt(
        8,
        "cache_aware: the gateway sends a request to the least-loaded replica instead of the "
        "one its tree picks once the replicas' in-flight requests differ by more than this "
        "(and by --router-balance-rel-threshold). The gateway's default, 64, is sized for GPU "
        "servers batching hundreds; 8 is about one CPU replica's decode batch.",
    )
    router_balance_rel_threshold: float = opt(
        1.5, "cache_aware: ... and the busiest replica has more than this times the idlest's."
    )
    router_cache_threshold: float = opt(
        0.3,
        "cache_aware: the share of a prompt (in characters) that must match the gateway's tree "
        "for the request to follow the match; below it the gateway picks the replica with the "
        "smallest tree.",
    )
    router_prometheus_port: int = opt(
        0, "Port of the gateway's own Prometheus metrics; 0 picks a free one (logged)."
    )
    router_health_check_interval_secs: int = opt(
        1,
        "How often the gateway health-checks each replica (with --dp-size > 1). A replica "
        "that exits is taken out of the gateway by the launcher at once; this check finds "
        "replicas that hang.",
    )

    dp_private_cache: bool = opt(
        False,
        "With --dp-size > 1, keep each replica's cache to itself. By default every replica "
        "gets the same storage tier (--enable-hierarchical-cache, one --hicache-storage-dir "
        "or Redis), so a prefix one replica computed is a hit on the others and a restarted "
        "replica starts warm.",
    )

    def validate(self) -> None:
        if self.dp_size < 1:
            raise ValueError("--dp-size must be >= 1")
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError("--router-cache-threshold must be in [0, 1]")
        if self.router_balance_abs_threshold < 0:
            raise ValueError("--router-balance-abs-threshold must be >= 0")
        if self.router_balance_rel_threshold < 1:
            raise ValueError("--router-balance-rel-threshold must be >= 1")
        if self.router_health_check_interval_secs < 1:
            raise ValueError("--router-health-check-interval-secs must be >= 1")


def config_args(cfg: Any) -> list[str]:
    """The command-line flags that rebuild ``cfg`` (a config dataclass) in a child process."""
    args: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                args.append(flag)
        elif isinstance(value, (tuple, list)):  # a list flag (nargs="+"): absent when empty
            if value:
                args += [flag, *map(str, value)]
        elif value != "" and value is not None:
            args += [flag, str(value)]
    return args


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class GatewayWorkers:
    """The gateway's worker-management API (sglang-router 0.3.2): ``GET /workers`` lists
    ``{"workers": [{"id": <uuid>, "url": ...}, ...]}``, ``DELETE /workers/{id}`` and ``POST
    /workers`` ``{"url", "api_key"}`` queue a removal / an addition (202; an addition of a URL
    already there is a no-op). With ``--api-key`` the key is the control plane's admin token,
    and the gateway is given it to reach the worker."""

    def __init__(self, url: str, api_key: str, timeout: float = 5.0) -> None:
        self.url = url
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout

    def list(self) -> list[dict]:
        r = httpx.get(self.url + "/workers", headers=self.headers, timeout=self.timeout)
        r.raise_for_status()
        return r.json()["workers"]

    def remove(self, worker_url: str) -> bool:
        """Take ``worker_url`` out of rotation; False if the gateway does not list it."""
        ids = [w["id"] for w in self.list() if w["url"] == worker_url]
        for wid in ids:
            r = httpx.delete(f"{self.url}/workers/{wid}", headers=self.headers,
                             timeout=self.timeout)  # fmt: skip
            if r.status_code not in (200, 202, 404):  # 404: gone already
                r.raise_for_status()
        return bool(ids)

    def add(self, worker_url: str) -> None:
        body: dict[str, Any] = {"url": worker_url}
        if self.api_key:
            body["api_key"] = self.api_key
        r = httpx.post(self.url + "/workers", json=body, headers=self.headers,
                       timeout=self.timeout)  # fmt: skip
        r.raise_for_status()


class Replica:
    """One ``mambaradix serve`` child on a fixed local port. ``on_exit(replica, proc)`` is
    called from a watcher thread as soon as the process ends."""

    def __init__(
        self,
        index: int,
        cmd: list[str],
        port: int,
        api_key: str,
        on_exit: Callable[[Replica, subprocess.Popen], None] | None = None,
    ) -> None:
        self.index = index
        self.cmd = cmd
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.on_exit = on_exit
        self.in_gateway = False  # listed by the gateway (from its start, or re-added)

    def start(self) -> None:
        self.proc = proc = subprocess.Popen(self.cmd, preexec_fn=_die_with_parent)
        logger.info("replica %d: pid %d on %s", self.index, proc.pid, self.url)
        if self.on_exit is not None:
            threading.Thread(
                target=self._watch, args=(proc,), name=f"replica-{self.index}", daemon=True
            ).start()

    def _watch(self, proc: subprocess.Popen) -> None:
        proc.wait()
        if self.on_exit is not None:
            self.on_exit(self, proc)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False


class ReplicaSet:
    """N replicas and the gateway; ``run()`` blocks until a signal or the gateway's exit."""

    def __init__(self, ecfg: EngineConfig, scfg: ServerConfig, so: ScaleOutConfig) -> None:
        if so.dp_size < 2:
            raise ValueError("ReplicaSet needs --dp-size >= 2")
        self.scfg = scfg
        self.so = so
        threads = ecfg.num_threads or max(1, _cores() // so.dp_size)
        ecfg = dataclasses.replace(ecfg, num_threads=threads)
        self.replicas: list[Replica] = []
        # held until close(): the replicas' ports (kept for their restarts) and the gateway's
        # metrics port, each bound by its server while the reservation stands
        self.ports = [ReservedPort() for _ in range(so.dp_size)]
        for i, port in enumerate(p.port for p in self.ports):
            rcfg = dataclasses.replace(scfg, host="127.0.0.1", port=port)
            cmd = [sys.executable, "-m", "mambaradix.cli", "serve"]
            cmd += config_args(ecfg) + config_args(rcfg)
            self.replicas.append(Replica(i, cmd, port, scfg.api_key, self._replica_exited))
        if not so.router_prometheus_port:
            self.ports.append(ReservedPort())
        self.prometheus_port = so.router_prometheus_port or self.ports[-1].port
        self.gateway: subprocess.Popen | None = None
        gateway_host = "127.0.0.1" if scfg.host in ("0.0.0.0", "::", "") else scfg.host
        self.workers = GatewayWorkers(f"http://{gateway_host}:{scfg.port}", scfg.api_key)
        self._stopping = False
        self._lock = threading.Lock()  # the watcher threads and the supervising loop

    def gateway_cmd(self) -> list[str]:
        cmd = [sys.executable, "-m", "sglang_router.launch_router"]
        cmd += ["--host", self.scfg.host, "--port", str(self.scfg.port)]
        cmd += ["--worker-urls", *[r.url for r in self.replicas]]
        cmd += ["--policy", self.so.router_policy]
        if self.so.router_policy == "cache_aware":
            cmd += ["--cache-threshold", str(self.so.router_cache_threshold)]
            cmd += ["--balance-abs-threshold", str(self.so.router_balance_abs_threshold)]
            cmd += ["--balance-rel-threshold", str(self.so.router_balance_rel_threshold)]
        # its default (29000) would clash with a second gateway on the machine
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port)]
        cmd += ["--health-check-interval-secs", str(self.so.router_health_check_interval_secs)]
        # the gateway logs every workflow step at info: keep it to warnings unless debugging
        cmd += ["--log-level", "debug" if self.scfg.log_level == "debug" else "warn"]
        if self.scfg.api_key:
            cmd += ["--api-key", self.scfg.api_key]
        return cmd

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        try:
            import sglang_router  # noqa: F401
        except ImportError:
            raise SystemExit(
                "--dp-size > 1 needs the SGLang Model Gateway: pip install 'mambaradix[router]'"
            ) from None
        for r in self.replicas:
            r.start()
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        pending = list(self.replicas)
        while pending and not self._stopping:
            for r in list(pending):
                if not r.alive():
                    self.stop()
                    raise SystemExit(f"replica {r.index} exited during start-up")
                if r.healthy():
                    pending.remove(r)
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"replicas not healthy after {HEALTH_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
        for r in self.replicas:
            r.in_gateway = True  # the gateway starts with every replica's URL
        self.gateway = subprocess.Popen(self.gateway_cmd(), preexec_fn=_die_with_parent)
        logger.info(
            "gateway (%s): pid %d on http://%s:%d (its metrics on :%d), replicas %s",
            self.so.router_policy,
            self.gateway.pid,
            self.scfg.host,
            self.scfg.port,
            self.prometheus_port,
            " ".join(r.url for r in self.replicas),
        )

    def _replica_exited(self, r: Replica, proc: subprocess.Popen) -> None:
        """Watcher thread: a replica process ended; take it out of the gateway now (the
        supervising loop restarts it)."""
        with self._lock:
            if self._stopping or r.proc is not proc:
                return
            r.in_gateway = False
        logger.warning(
            "replica %d exited (code %s); removing it from the gateway", r.index, proc.returncode
        )
        try:
            self.workers.remove(r.url)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            # the gateway's health check takes it out of rotation instead
            logger.warning("could not remove replica %d from the gateway: %s", r.index, exc)

    def supervise_once(self) -> bool:
        """One supervision round: restart dead replicas, put restarted ones that answer
        ``/health`` back into the gateway; False once the gateway has exited."""
        if self.gateway is not None and self.gateway.poll() is not None:
            logger.error("the gateway exited (code %s); stopping", self.gateway.returncode)
            return False
        for r in self.replicas:
            if self._stopping:
                break
            if not r.alive():
                code = r.proc.returncode if r.proc is not None else None
                logger.warning("replica %d exited (code %s); restarting it", r.index, code)
                r.restarts += 1
                r.start()
            elif not r.in_gateway and self.gateway is not None and r.healthy(timeout=0.5):
                # the gateway adds a worker in the background (and drops it if that fails):
                # ask again each round until it lists the replica
                try:
                    if r.url not in {w["url"] for w in self.workers.list()}:
                        self.workers.add(r.url)
                        continue
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    logger.warning("could not add replica %d to the gateway: %s", r.index, exc)
                    continue
                r.in_gateway = True
                logger.info("replica %d is back in the gateway", r.index)
        return True

    def run(self) -> int:
        """Start, supervise until SIGTERM / SIGINT or the gateway's exit, stop. Exit code."""
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def on_signal(signum: int, _frame: Any) -> None:
            logger.info(
                "signal %d: stopping the gateway and %d replicas", signum, len(self.replicas)
            )
            self._stopping = True

        for s in previous:
            signal.signal(s, on_signal)
        code = 0
        try:
            self.start()
            while not self._stopping:
                if not self.supervise_once():
                    code = 1
                    break
                time.sleep(POLL_S)
        finally:
            self.stop()
            for s, h in previous.items():
                signal.signal(s, h)
        return code

    def stop(self) -> None:
        """SIGTERM to every child, wait up to the replicas' graceful-shutdown timeout +
        ``STOP_GRACE_S`` in all, SIGKILL the rest."""
        with self._lock:
            self._stopping = True
        procs = [p for p in [self.gateway] + [r.proc for r in self.replicas] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        # a replica drains for --graceful-shutdown-timeout before it aborts what is left
        grace = max(STOP_GRACE_S, self.scfg.graceful_shutdown_timeout + STOP_GRACE_S)
        deadline = time.monotonic() + grace
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop within %.0f s; killing it", p.pid, grace)
                p.kill()
                p.wait()
        self.close()

    def close(self) -> None:
        """Release the reserved ports (``stop`` does; a set never started needs only this)."""
        for port in self.ports:
            port.close()


def shared_storage(ecfg: EngineConfig, so: ScaleOutConfig) -> EngineConfig:
    """The replicas' engine config: the storage tier on (one location for all) unless the
    radix cache is off or ``--dp-private-cache`` is given."""
    if so.dp_private_cache or ecfg.disable_radix_cache or ecfg.enable_hierarchical_cache:
        return ecfg
    from mambaradix.engine.storage_setup import storage_location

    ecfg = dataclasses.replace(ecfg, enable_hierarchical_cache=True)
    if ecfg.hicache_storage_backend == "file":
        ecfg.hicache_storage_dir = storage_location(ecfg)
    logger.info("replicas share the storage tier at %s", storage_location(ecfg))
    return ecfg


def serve_replicas(ecfg: EngineConfig, scfg: ServerConfig, so: ScaleOutConfig) -> int:
    return ReplicaSet(shared_storage(ecfg, so), scfg, so).run()
