"""The storage tier under the RAM pools: demoted prefixes written out, stored prefixes loaded
back, all by content key (``cache.storage.keys``).

Residency of a cached prefix (tokens [0, P) with the recurrent state at P)::

    RAM       a tree node with a state slot (and its path's KV slots)     radix tree
    RAM+disk  the same, ``node.stored``: its objects were written too     radix tree + storage
    storage   objects only: KV blocks [0, align_down(P)) + state(P)      found by its tokens
    nowhere   neither (a tombstone in the tree, or nothing)

Writes (``stage``) copy the state slot and the KV rows not yet stored out of the pools on the
caller's thread (the scheduler's: the slots may be freed right after) and hand the encoding and
the backend's ``put`` to the I/O threads. Loads (``probe`` on the scheduler's thread: one
batched ``exists``; ``load`` on an I/O thread) read, check and decode the objects and copy them
into pool slots the caller allocated for them; a missing or bad object fails the load (the
request recomputes) and a bad one is deleted. The tier never touches the tree: the request
cache inserts what a load brought in.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mambaradix.cache.storage.backend import StorageBackend
from mambaradix.cache.storage.keys import KeyChain
from mambaradix.cache.storage.objects import BadObject, TensorSpec, decode, encode, encoded_size

logger = logging.getLogger(__name__)

WRITE_BACK = "write_back"
WRITE_THROUGH = "write_through"
WRITE_THROUGH_SELECTIVE = "write_through_selective"
WRITE_POLICIES = (WRITE_BACK, WRITE_THROUGH, WRITE_THROUGH_SELECTIVE)

_KNOWN_CAP = 1 << 18  # keys this process remembers as stored (a hint: saves an exists check)
_TAIL_CAP = 1 << 16  # block digests with stored states past them at unaligned positions


@dataclass(slots=True)
class TierCounters:
    """What the tier did; copied into ``EngineStats`` when stats are read."""

    objects_written: int = 0
    bytes_written: int = 0
    write_failures: int = 0
    writes_skipped: int = 0  # staged bytes over the cap, or the backend refusing writes
    loads: int = 0
    load_failures: int = 0  # missing or bad objects: the request recomputed
    bad_objects: int = 0  # corrupt, truncated, foreign: deleted
    bytes_read: int = 0
    load_seconds: float = 0.0
    loads_skipped_slow: int = 0  # a load estimated slower than recomputing
    probes: int = 0
    probe_seconds: float = 0.0  # on the scheduler's thread: hashing + the batched exists


@dataclass(slots=True)
class StoredPrefix:
    """A probe's answer: the state at ``position`` is stored, and so are the KV blocks covering
    [``ram_depth``, ``align_down(position)``) (the RAM tree holds the KV before ``ram_depth``)."""

    position: int
    ram_depth: int
    block_keys: list[tuple[int, str]]  # (block index, key) of the blocks to read
    state_key: str
    nbytes: int


@dataclass(slots=True, eq=False)
class LoadJob:
    prefix: StoredPrefix
    kv_slots: torch.Tensor  # pool slots for tokens [ram_depth, position)
    state_slot: int
    future: Future
    started: float = field(default_factory=time.monotonic)


class StorageTier:
    """Writes and loads of cached prefixes through one ``StorageBackend``.

    ``kv_pool`` / ``state_pool``: the pools objects are copied from and into. ``block``: tokens
    per KV object (the snapshot alignment, whole pages). ``thread_init`` runs first on each I/O
    thread (the engine passes its serial-torch setting, so I/O threads start no OpenMP pool).
    ``max_staged_bytes`` bounds the bytes copied out and not yet written; past it writes are
    skipped and counted."""

    def __init__(
        self,
        backend: StorageBackend,
        *,
        kv_pool: object,
        state_pool: object,
        block: int,
        fingerprint: str,
        write_policy: str = WRITE_BACK,
        io_threads: int = 2,
        thread_init: Callable[[], object] | None = None,
        max_staged_bytes: int = 1 << 30,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"--hicache-write-policy {write_policy!r}: choose one of {list(WRITE_POLICIES)}"
            )
        page = getattr(kv_pool, "page_size", 1)
        if block % page:
            raise ValueError(f"storage block {block} is not a whole number of pages of {page}")
        self.backend = backend
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.block = block
        self.page_size = page
        self.chain = KeyChain(fingerprint, block)
        self.fingerprint = fingerprint
        self.write_policy = write_policy
        self.max_staged_bytes = max_staged_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._staged = 0  # bytes copied out, not yet written
        self._pending: set[Future] = set()
        self._known: OrderedDict[str, None] = OrderedDict()  # keys stored (by us or seen)
        self._tails: OrderedDict[bytes, set[int]] = OrderedDict()  # digest -> stored tail lens
        self._failed: OrderedDict[str, None] = OrderedDict()  # handed over, write failed
        self._io = ThreadPoolExecutor(
            max_workers=io_threads, thread_name_prefix="mambaradix-storage", initializer=thread_init
        )
        spec = kv_pool.spec
        self._kv_layers = spec.num_layers
        self._kv_row = (spec.num_kv_heads, spec.head_dim)
        self._kv_dtype = spec.dtype
        self._kv_token_bytes = spec.bytes_per_token()
        self._state_specs: list[TensorSpec] = []
        for i, s in enumerate(state_pool.spec.layers):
            self._state_specs.append((f"conv{i}", s.conv_dtype, tuple(s.conv_shape)))
            if s.temporal_shape is not None:
                self._state_specs.append(
                    (f"temporal{i}", s.temporal_dtype, tuple(s.temporal_shape))
                )
        self._state_bytes = state_pool.spec.slot_bytes()
        self._read_rate = 0.0  # bytes / s of recent loads (0: not measured yet)
        self._closed = False

    # ------------------------------------------------------------------ layouts

    def _kv_specs(self, n: int, prefix: str = "") -> list[TensorSpec]:
        out: list[TensorSpec] = []
        for layer in range(self._kv_layers):
            out.append((f"{prefix}k{layer}", self._kv_dtype, (n, *self._kv_row)))
            out.append((f"{prefix}v{layer}", self._kv_dtype, (n, *self._kv_row)))
        return out

    def _gather_kv(self, slots: torch.Tensor, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
        out = []
        for layer in range(self._kv_layers):
            out.append((f"{prefix}k{layer}", self.kv_pool.k[layer].index_select(0, slots)))
            out.append((f"{prefix}v{layer}", self.kv_pool.v[layer].index_select(0, slots)))
        return out

    def _gather_state(self, slot: int) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i in range(len(self.state_pool.spec.layers)):
            out.append((f"conv{i}", self.state_pool.conv[i][slot].clone()))
            temporal = self.state_pool.temporal[i]
            if temporal is not None:
                out.append((f"temporal{i}", temporal[slot].clone()))
        return out

    def _remember(self, key: str) -> None:
        known = self._known
        known[key] = None
        known.move_to_end(key)
        if len(known) > _KNOWN_CAP:
            known.popitem(last=False)

    def _remember_tail(self, digest: bytes, tail: int) -> None:
        tails = self._tails
        got = tails.get(digest)
        if got is None:
            got = tails[digest] = set()
        got.add(tail)
        tails.move_to_end(digest)
        if len(tails) > _TAIL_CAP:
            tails.popitem(last=False)

    # ------------------------------------------------------------------ writes

    def stage(self, tokens: list[int], kv_slots: torch.Tensor, state_slot: int) -> bool:
        """Write the prefix ``tokens`` (its KV slots, page-aligned length P) and the state slot
        holding the state at P. The data is copied out now; the write runs on an I/O thread.
        Returns False (nothing staged) when the tier is over its staged-bytes bound."""
        if self._closed:
            return False
        n = len(tokens)
        b = self.block
        nb = n // b
        digests = self.chain.digests(tokens, nb)
        state_key = self.chain.state_key(digests[nb], tokens[nb * b :])
        if state_key in self._known:
            return True
        with self._lock:
            self._failed.pop(state_key, None)
        keys = [self.chain.kv_key(digests[i + 1]) for i in range(nb)] if self._kv_layers else []
        unknown = [i for i, k in enumerate(keys) if k not in self._known]
        there = self.backend.exists([keys[i] for i in unknown] + [state_key])
        if there[-1]:  # stored already (by another process, or before a restart)
            with self._lock:
                self._remember(state_key)
            return True
        blocks: list[tuple[str, int]] = []
        with self._lock:
            for i, present in zip(unknown, there):
                if present:
                    self._remember(keys[i])
                else:
                    blocks.append((keys[i], i))
        need = len(blocks) * b * self._kv_token_bytes + self._state_bytes
        with self._lock:
            if self._staged + need > self.max_staged_bytes:
                self.counters.writes_skipped += 1
                return False
            self._staged += need
        items: list[tuple[str, str, list[tuple[str, torch.Tensor]]]] = []
        for key, i in blocks:
            items.append((key, "kv", self._gather_kv(kv_slots[i * b : (i + 1) * b])))
        tail = self._gather_kv(kv_slots[nb * b : n], prefix="tail_") if self._kv_layers else []
        items.append((state_key, "state", self._gather_state(state_slot) + tail))
        with self._lock:
            for key, _, _ in items:
                self._remember(key)
        if n % b:
            with self._lock:
                self._remember_tail(digests[nb], n - nb * b)
        fut = self._io.submit(self._write, items, need)
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._write_done)
        return True

    def _write(
        self, items: list[tuple[str, str, list[tuple[str, torch.Tensor]]]], staged: int
    ) -> None:
        try:
            batch = [(key, encode(key, self.fingerprint, kind, ts)) for key, kind, ts in items]
            ok = self.backend.put(batch)
            written = sum(encoded_size(p) for (_, p), good in zip(batch, ok) if good)
            with self._lock:
                self.counters.objects_written += sum(ok)
                self.counters.bytes_written += written
                self.counters.write_failures += len(ok) - sum(ok)
            if not all(ok):  # forget them: a later eviction may try again
                with self._lock:
                    for (key, _), good in zip(batch, ok):
                        if not good:
                            self._known.pop(key, None)
                            self._failed[key] = None
                            if len(self._failed) > _KNOWN_CAP:
                                self._failed.popitem(last=False)
        finally:
            with self._lock:
                self._staged -= staged

    def _write_done(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)
        exc = fut.exception()
        if exc is not None:
            logger.error("storage write failed: %r", exc, exc_info=exc)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every staged write to finish; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            pending[0].exception(timeout=left)  # waits; a failed write was already logged

    # ------------------------------------------------------------------ lookups

    def probe(
        self,
        tokens: list[int],
        limit: int,
        state_depth: int,
        ram_depth: Callable[[int], int],
        min_gain: int,
    ) -> StoredPrefix | None:
        """The deepest stored state at a position q with ``state_depth + min_gain <= q <=
        limit`` (q a whole number of pages) whose KV blocks past ``ram_depth(q)`` (the tokens
        whose KV the RAM tree can lend, >= ``state_depth``) are stored too, found with one
        batched existence check. Candidates: every block boundary, ``limit`` itself (an exact
        repeat), and the unaligned positions this process has stored."""
        with self._timed_probe():
            if self._closed or limit - state_depth < max(1, min_gain):
                return None
            b = self.block
            nb = limit // b
            digests = self.chain.digests(tokens, nb)
            positions = {i * b for i in range(1, nb + 1)}
            positions.add(limit - limit % self.page_size)
            for i in range(nb + 1):
                for tail in self._tails.get(digests[i], ()):
                    positions.add(i * b + tail)
            lo = state_depth + max(1, min_gain)
            cands = sorted((q for q in positions if lo <= q <= limit), reverse=True)
            if not cands:
                return None
            state_keys = [
                self.chain.state_key(digests[q // b], tokens[q // b * b : q]) for q in cands
            ]
            first = state_depth // b
            last = cands[0] // b  # blocks [first, last) may be needed
            block_keys = [self.chain.kv_key(digests[i + 1]) for i in range(first, last)]
            if not self._kv_layers:
                block_keys = []
            there = self.backend.exists(state_keys + block_keys)
            have_block = there[len(state_keys) :]
            for q, key, present in zip(cands, state_keys, there):
                if not present:
                    continue
                d = ram_depth(q)
                need = list(range(d // b, q // b)) if block_keys else []
                if not all(have_block[i - first] for i in need):
                    continue
                tail = q - q // b * b
                nbytes = (len(need) * b + tail) * self._kv_token_bytes + self._state_bytes
                return StoredPrefix(q, d, [(i, block_keys[i - first]) for i in need], key, nbytes)
            return None

    def worth_loading(self, prefix: StoredPrefix, gain: int, s_per_token: float) -> bool:
        """Load only when reading is estimated faster than recomputing the ``gain`` tokens
        (``s_per_token``: the engine's measured prefill cost; 0: unknown, load)."""
        if s_per_token <= 0 or self._read_rate <= 0:
            return True
        if prefix.nbytes / self._read_rate < gain * s_per_token:
            return True
        with self._lock:
            self.counters.loads_skipped_slow += 1
        return False

    # ------------------------------------------------------------------ loads

    def load(self, prefix: StoredPrefix, kv_slots: torch.Tensor, state_slot: int) -> LoadJob:
        """Start reading ``prefix`` on an I/O thread. Its future gives None (missing or bad
        objects: recompute) or a function that copies what was read into ``kv_slots`` (tokens
        [ram_depth, position)) and ``state_slot``: the caller runs it where no forward in
        flight can read those slots (the runner, before the next forward's state ops)."""
        fut = self._io.submit(self._read, prefix, kv_slots, state_slot)
        return LoadJob(prefix, kv_slots, state_slot, fut)

    def _read(
        self, prefix: StoredPrefix, kv_slots: torch.Tensor, state_slot: int
    ) -> Callable[[], None] | None:
        t0 = time.perf_counter()
        b = self.block
        q, d = prefix.position, prefix.ram_depth
        tail_len = q - q // b * b
        keys = [k for _, k in prefix.block_keys] + [prefix.state_key]
        datas = self.backend.get(keys)
        got = sum(len(x) for x in datas if x is not None)
        if any(x is None for x in datas):
            self._count_load(False, got, t0)
            return None
        kv_parts: list[tuple[dict[str, torch.Tensor], str, int, torch.Tensor]] = []
        try:
            for (i, key), data in zip(prefix.block_keys, datas):
                ts = decode(
                    data, key=key, fingerprint=self.fingerprint, kind="kv",
                    expected=self._kv_specs(b),
                )  # fmt: skip
                lo = max(d, i * b)  # tokens of this block the RAM tree does not hold
                kv_parts.append((ts, "", lo - i * b, kv_slots[lo - d : (i + 1) * b - d]))
            key, data = prefix.state_key, datas[-1]
            state = decode(
                data, key=key, fingerprint=self.fingerprint, kind="state",
                expected=self._state_specs + self._kv_specs(tail_len, "tail_"),
            )  # fmt: skip
            start = q - tail_len
            lo = max(d, start)
            if self._kv_layers and lo < q:
                kv_parts.append((state, "tail_", lo - start, kv_slots[lo - d : q - d]))
        except BadObject as e:
            logger.warning("storage object %s is unusable (%s): removed, recomputing", key, e)
            self.backend.delete([key])
            with self._lock:
                self._known.pop(key, None)
                self.counters.bad_objects += 1
            self._count_load(False, got, t0)
            return None
        with self._lock:
            for k in keys:
                self._remember(k)
        self._count_load(True, got, t0)

        def write() -> None:
            for ts, prefix_name, first, slots in kv_parts:
                self._put_kv(ts, prefix_name, first, slots)
            self._put_state(state, state_slot)

        return write

    def _put_kv(
        self, ts: dict[str, torch.Tensor], prefix: str, first: int, slots: torch.Tensor
    ) -> None:
        n = slots.numel()
        for layer in range(self._kv_layers):
            rows_k = ts[f"{prefix}k{layer}"][first : first + n]
            rows_v = ts[f"{prefix}v{layer}"][first : first + n]
            self.kv_pool.k[layer].index_copy_(0, slots, rows_k)
            self.kv_pool.v[layer].index_copy_(0, slots, rows_v)

    def _put_state(self, ts: dict[str, torch.Tensor], slot: int) -> None:
        for i in range(len(self.state_pool.spec.layers)):
            self.state_pool.conv[i][slot].copy_(ts[f"conv{i}"])
            temporal = self.state_pool.temporal[i]
            if temporal is not None:
                temporal[slot].copy_(ts[f"temporal{i}"])

    def _count_load(self, ok: bool, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        with self._lock:
            c = self.counters
            c.loads += ok
            c.load_failures += not ok
            c.bytes_read += nbytes
            c.load_seconds += dt
            if ok and nbytes and dt > 0:
                rate = nbytes / dt
                self._read_rate = (
                    rate if self._read_rate <= 0 else 0.7 * self._read_rate + 0.3 * rate
                )

    # ------------------------------------------------------------------ the rest

    def knows(self, tokens: list[int]) -> bool:
        """Whether this process handed the state at ``len(tokens)`` to storage (written, being
        written, or failed: a node marks itself stored when it hands its data over)."""
        key = self.chain.state_key_at(tokens, len(tokens))
        return key in self._known or key in self._failed

    def write_failed(self, tokens: list[int]) -> bool:
        """Whether the last write of the state at ``len(tokens)`` failed."""
        return self.chain.state_key_at(tokens, len(tokens)) in self._failed

    @contextmanager
    def _timed_probe(self) -> Iterator[None]:
        """Count and time a probe: the tier's whole cost on the scheduler's thread while
        nothing is written."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.counters.probes += 1
                self.counters.probe_seconds += time.perf_counter() - t0

    def snapshot_counters(self) -> TierCounters:
        with self._lock:
            c = self.counters
            return TierCounters(**{f: getattr(c, f) for f in c.__slots__})

    def clear_storage(self) -> int:
        """Remove every stored object (an explicit call; ``/flush_cache`` empties RAM only)."""
        self.drain(timeout=60)
        with self._lock:
            self._known.clear()
            self._tails.clear()
        return self.backend.clear()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the staged writes (up to ``timeout``), then stop the I/O threads."""
        if self._closed:
            return
        if not self.drain(timeout):
            logger.warning("storage: %d writes still running at close", len(self._pending))
        self._closed = True
        self._io.shutdown(wait=True, cancel_futures=True)
        self.backend.close()
