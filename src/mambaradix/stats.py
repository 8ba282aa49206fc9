"""The engine's one statistics record.

The scheduler and the request cache count into the same ``EngineStats`` (the engine owns it and
hands it to both); ``Engine.stats()`` returns a copy with the gauges (queue lengths, pool usage,
state copies) filled in at the time of the call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    # gauges: filled by Engine.stats() when it is read
    num_running: int = 0
    num_waiting: int = 0
    token_usage: float = 0.0
    mamba_usage: float = 0.0
    num_used_tokens: int = 0  # KV tokens in use (size - free - evictable)
    max_total_num_tokens: int = 0  # KV pool size in tokens
    state_copies: int = 0  # executed by the state pool
    state_copy_bytes: int = 0
    decode_graph_bytes: int = 0  # held by the recorded decode steps (engine.step_graph)
    # scheduler counters
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_prefill_tokens: int = 0
    generated_tokens: int = 0
    spec_verify_ct: int = 0  # speculative verify forwards (one per request per step)
    spec_accepted_tokens: int = 0  # tokens those verify steps emitted
    spec_draft_tokens: int = 0  # draft tokens those verify steps scored
    retractions: int = 0
    admission_waits: int = 0
    held_for_sharing: int = 0
    finished_requests: int = 0
    forwards: int = 0
    resumes: int = 0  # admissions that copy a tree state into their working slot
    snapshot_copies: int = 0  # no_buffer working -> snapshot copies recorded
    # request-cache counters
    evicted_kv_tokens: int = 0
    evicted_states: int = 0
    skipped_snapshots: int = 0
    snapshots_inserted: int = 0
    snapshot_attempts: int = 0  # snapshot slots offered to the tree (attached or not)
    # runner counters (engine.step_graph)
    decode_graph_replays: int = 0  # decode steps replayed from a recorded step
    decode_graph_recordings: int = 0  # decode steps recorded (kept as graphs)
    # reuse the cache lost: requests whose KV matched deeper than any state they could resume
    # from (a tombstone or mid-edge), and the tokens between (recomputed)
    lost_reuse_requests: int = 0
    lost_reuse_tokens: int = 0
    # the storage tier (cache.storage): request counters, then the tier's own (Engine.stats)
    storage_hit_tokens: int = 0  # of cached_tokens, those read back from storage
    storage_loaded_tokens: int = 0  # tokens inserted into the tree by loads
    storage_loads: int = 0
    storage_load_failures: int = 0  # missing or bad objects: recomputed instead
    storage_bad_objects: int = 0  # corrupt / truncated / foreign objects removed
    storage_load_seconds: float = 0.0  # summed over loads
    storage_loads_skipped_slow: int = 0  # estimated slower than recomputing
    storage_bytes_read: int = 0
    storage_bytes_written: int = 0
    storage_objects_written: int = 0
    storage_write_failures: int = 0
    storage_writes_skipped: int = 0
    storage_probes: int = 0  # lookups in storage (one batched exists each)
    storage_probe_seconds: float = 0.0
    storage_objects: int = 0  # gauge: objects the backend holds
    storage_bytes: int = 0  # gauge: bytes the backend holds
