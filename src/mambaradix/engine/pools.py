"""Sizing the KV and state pools, the running-request cap and the snapshot strategy.

The pools' memory budget is, unless given (``--mem-budget-gb``), a share
(``--mem-fraction-static``) of the memory the machine has available once the weights are
loaded (``MemAvailable`` of /proc/meminfo on the CPU, the free device memory on a GPU). The
budget is split between state slots and KV tokens by ``--mamba-full-memory-ratio`` (state
bytes : KV bytes); explicit pool sizes win over the budget.

The running requests may hold at most ``RUNNING_SHARE`` of the state slots; the rest is room
for the tree's snapshots. ``auto`` picks ``extra_buffer`` (3 slots per running request: the
working state and two track slots the tree takes without a copy) when that still lets
``AUTO_MIN_RUNNING`` requests run, else ``no_buffer`` (1 slot per request; each snapshot is a
copy into a fresh slot), which runs three times as many requests in the same slots.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from mambaradix.config import EngineConfig
from mambaradix.core import EXTRA_BUFFER, NO_BUFFER, StateSpec, state_slots_per_request

logger = logging.getLogger(__name__)

GiB = 1 << 30
RUNNING_SHARE = 0.75  # of the state slots; the rest stays for the tree's snapshots
AUTO_MIN_RUNNING = 32  # auto keeps extra_buffer only if it still runs this many requests
MAX_RUNNING = 256
MIN_SLOTS, MAX_SLOTS = 16, 4096
MIN_TOKENS, MAX_TOKENS = 4096, 1 << 21
FALLBACK_AVAILABLE = 4 * GiB  # when the platform does not say how much memory is free


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """What the engine allocates, and why (``describe`` is the start-up log block)."""

    kv_tokens: int
    state_slots: int
    max_running: int
    strategy: str
    strategy_reason: str
    budget_bytes: float
    budget_source: str
    kv_bytes_per_token: int
    slot_bytes: int
    weight_bytes: int

    @property
    def pool_bytes(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token + self.state_slots * self.slot_bytes

    def describe(self) -> str:
        mb = 1 << 20
        return "\n".join(
            [
                f"  weights        {self.weight_bytes / GiB:.2f} GB",
                f"  pool budget    {self.budget_bytes / GiB:.2f} GB ({self.budget_source})",
                f"  KV pool        {self.kv_tokens} tokens x {self.kv_bytes_per_token} B "
                f"= {self.kv_tokens * self.kv_bytes_per_token / GiB:.2f} GB",
                f"  state pool     {self.state_slots} slots x {self.slot_bytes / mb:.2f} MB "
                f"= {self.state_slots * self.slot_bytes / GiB:.2f} GB",
                f"  running cap    {self.max_running} requests",
                f"  strategy       {self.strategy} ({self.strategy_reason})",
            ]
        )


def available_memory(device: str | torch.device = "cpu") -> int:
    """Bytes the machine can still give: free device memory on an accelerator, else Linux's
    ``MemAvailable`` (free + reclaimable page cache), else ``FALLBACK_AVAILABLE``."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        logger.warning("cannot tell the free memory; assuming %d GB", FALLBACK_AVAILABLE // GiB)
        return FALLBACK_AVAILABLE


def model_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (tied parameters counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _running_cap(slots: int, per_req: int) -> int:
    return max(1, min(MAX_RUNNING, int(slots * RUNNING_SHARE) // per_req))


def size_pools(
    cfg: EngineConfig,
    kv_bytes_per_token: int,
    state_spec: StateSpec,
    weight_bytes: int = 0,
    available: int | None = None,
) -> PoolSizing:
    """Pool sizes, running cap and strategy for ``cfg`` (explicit flags win).

    ``available`` is the free memory after loading (measured when None). Raises ValueError
    when the pools cannot fit, naming the flags to change."""
    slot_bytes = max(1, state_spec.slot_bytes())
    kv_bytes = max(1, kv_bytes_per_token)
    if cfg.mem_budget_gb > 0:
        budget = cfg.mem_budget_gb * GiB
        source = "--mem-budget-gb"
    else:
        free = available_memory(cfg.device) if available is None else available
        budget = cfg.mem_fraction_static * free
        source = f"--mem-fraction-static {cfg.mem_fraction_static:g} x {free / GiB:.1f} GB free"
    ratio = cfg.mamba_full_memory_ratio
    if cfg.max_mamba_cache_size > 0:
        slots = cfg.max_mamba_cache_size
    else:
        slots = min(int(budget * ratio / (1 + ratio) // slot_bytes), MAX_SLOTS)
        if slots < MIN_SLOTS:
            if MIN_SLOTS * slot_bytes > budget:
                raise ValueError(
                    f"the pool budget ({budget / GiB:.2f} GB, {source}) cannot hold "
                    f"{MIN_SLOTS} state slots of {slot_bytes / (1 << 20):.1f} MB; free memory, "
                    "raise --mem-fraction-static / --mem-budget-gb, or set "
                    "--max-mamba-cache-size explicitly"
                )
            slots = MIN_SLOTS
    if cfg.max_total_tokens > 0:
        tokens = cfg.max_total_tokens
    else:
        rest = budget - slots * slot_bytes if cfg.max_mamba_cache_size > 0 else budget / (1 + ratio)
        tokens = min(int(max(rest, 0) // kv_bytes), MAX_TOKENS)
        if tokens < MIN_TOKENS:
            if cfg.max_mamba_cache_size > 0 and MIN_TOKENS * kv_bytes > rest:
                raise ValueError(
                    f"--max-mamba-cache-size {slots} ({slots * slot_bytes / GiB:.2f} GB) leaves "
                    f"{max(rest, 0) / GiB:.2f} GB of the pool budget ({budget / GiB:.2f} GB, "
                    f"{source}), less than {MIN_TOKENS} KV tokens of {kv_bytes} B; lower it, "
                    "raise --mem-fraction-static / --mem-budget-gb or set --max-total-tokens"
                )
            if MIN_TOKENS * kv_bytes > budget:
                raise ValueError(
                    f"the pool budget ({budget / GiB:.2f} GB, {source}) cannot hold "
                    f"{MIN_TOKENS} KV tokens of {kv_bytes} B; raise --mem-fraction-static / "
                    "--mem-budget-gb or set --max-total-tokens explicitly"
                )
            tokens = MIN_TOKENS
    tokens -= tokens % cfg.page_size

    enabled = not cfg.disable_radix_cache
    strategy = cfg.mamba_scheduler_strategy
    # speculation: a verify step holds the state after each draft token in a slot of its own
    spec = cfg.speculative_num_steps if cfg.speculative_algorithm else 0
    if not enabled:
        # no snapshots without the cache: one slot per request whatever the strategy says
        strategy = EXTRA_BUFFER if strategy == "auto" else strategy
        reason = "radix cache off: 1 slot per request"
    elif strategy != "auto":
        reason = "--mamba-scheduler-strategy"
    else:
        want = cfg.max_running_requests or AUTO_MIN_RUNNING
        extra = state_slots_per_request(EXTRA_BUFFER) + spec
        if _running_cap(slots, extra) >= min(want, MAX_RUNNING):
            strategy = EXTRA_BUFFER
            reason = f"auto: {slots} slots run >= {min(want, MAX_RUNNING)} requests at {extra} each"
        else:
            strategy = NO_BUFFER
            reason = (
                f"auto: {slots} slots of {slot_bytes / (1 << 20):.1f} MB run fewer than "
                f"{min(want, MAX_RUNNING)} requests at {extra} slots each; {1 + spec} each instead"
            )
    per_req = state_slots_per_request(strategy, enabled) + spec
    max_running = cfg.max_running_requests or _running_cap(slots, per_req)
    if max_running * per_req > slots:
        raise ValueError(
            f"--max-running-requests {max_running} needs {max_running * per_req} state slots "
            f"but the pool has {slots}; raise --max-mamba-cache-size or lower it"
        )
    return PoolSizing(
        kv_tokens=tokens,
        state_slots=slots,
        max_running=max_running,
        strategy=strategy,
        strategy_reason=reason,
        budget_bytes=budget,
        budget_source=source,
        kv_bytes_per_token=kv_bytes_per_token,
        slot_bytes=slot_bytes,
        weight_bytes=weight_bytes,
    )
