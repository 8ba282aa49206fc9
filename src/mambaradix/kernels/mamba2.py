"""Mamba2 state-space kernels (torch reference, CPU): varlen chunked scan and batched single step.

Shapes (T packed tokens of S sequences, H heads of dim P in G groups, state size N)::

    x  [T, H, P]   inputs after the conv           dt [T, H]   after softplus and clamp
    B  [T, G, N]   C [T, G, N]                      A  [H]      negative (``-exp(A_log)``)
    state [S, H, P, N]  h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T,   y_t = h_t C_t + D x_t

Head ``h`` reads group ``h // (H // G)``. All math runs in float32.

Chunked scan layout: every sequence is cut into *pieces* at the offsets whose state the caller
wants (snapshots); each piece starts a fresh chunk of ``chunk_size`` tokens and the tail of its
last chunk is padding with ``dt = 0``. A padded step has decay ``exp(0) = 1`` and input 0, so it
leaves the state unchanged: the state at each piece boundary is exactly the start state of the
next chunk, which the inter-chunk recurrence computes anyway. No per-token Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ChunkLayout", "mamba2_chunk_scan", "mamba2_step", "process_dt", "split_xbc"]


def process_dt(
    dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float] = (0.0, float("inf"))
) -> torch.Tensor:
    """``clamp(softplus(dt_raw + dt_bias), *dt_limit)`` in float32 (the discretization step)."""
    dt = F.softplus(dt_raw.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def split_xbc(
    xbc: torch.Tensor, shape: tuple[int, int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output ``[T, H*P + 2*G*N]`` as views ``x [T, H, P]``, ``B`` and ``C``
    ``[T, G, N]``; ``shape`` is ``(H, P, G, N)``."""
    H, P, G, N = shape
    x, B, C = xbc.split([H * P, G * N, G * N], dim=-1)
    t = xbc.shape[0]
    return x.reshape(t, H, P), B.reshape(t, G, N), C.reshape(t, G, N)


@dataclass(slots=True)
class ChunkLayout:
    """Where every token and chunk of a varlen chunked scan lives.

    ``token_rows[t]`` is token t's row in the padded ``[num_chunks * chunk_size]`` buffer;
    ``chunk_order[j]`` lists, for step j of the inter-chunk recurrence, the chunk id of every
    sequence that has a j-th chunk (``seq_of[j]`` says which sequence); ``snap_chunks[k]`` is the
    chunk whose start state is snapshot k (-1: the sequence's final state).
    """

    chunk_size: int
    num_chunks: int
    token_rows: torch.Tensor
    chunk_order: list[torch.Tensor]
    seq_of: list[torch.Tensor]
    snap_chunks: list[int]
    snap_seq: list[int]

    @classmethod
    def build(
        cls,
        seq_lens: list[int],
        snap_offsets: list[list[int]] | None,
        chunk_size: int,
        device: torch.device | str = "cpu",
    ) -> ChunkLayout:
        """``snap_offsets[i]``: offsets n (1 <= n <= seq_lens[i]) whose state sequence i wants."""
        rows: list[torch.Tensor] = []
        per_seq_chunks: list[list[int]] = []
        snap_chunks: list[int] = []
        snap_seq: list[int] = []
        next_chunk = 0
        for i, length in enumerate(seq_lens):
            wanted = snap_offsets[i] if snap_offsets is not None else []
            cuts = sorted({n for n in wanted if 0 < n < length})
            bounds = [0, *cuts, length]
            chunks: list[int] = []
            first_chunk_of_piece: dict[int, int] = {}
            for a, b in zip(bounds[:-1], bounds[1:]):
                first_chunk_of_piece[a] = next_chunk
                n_chunks = -(-(b - a) // chunk_size)
                base = next_chunk * chunk_size
                rows.append(torch.arange(base, base + (b - a), dtype=torch.long))
                chunks.extend(range(next_chunk, next_chunk + n_chunks))
                next_chunk += n_chunks
            per_seq_chunks.append(chunks)
            for n in wanted:
                if not 0 < n <= length:
                    raise ValueError(f"snapshot offset {n} outside 1..{length}")
                snap_chunks.append(-1 if n == length else first_chunk_of_piece[n])
                snap_seq.append(i)
        max_steps = max((len(c) for c in per_seq_chunks), default=0)
        chunk_order, seq_of = [], []
        for j in range(max_steps):
            seqs = [i for i, c in enumerate(per_seq_chunks) if len(c) > j]
            chunk_order.append(torch.tensor([per_seq_chunks[i][j] for i in seqs], device=device))
            seq_of.append(torch.tensor(seqs, device=device))
        token_rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        return cls(
            chunk_size=chunk_size,
            num_chunks=next_chunk,
            token_rows=token_rows.to(device),
            chunk_order=chunk_order,
            seq_of=seq_of,
            snap_chunks=snap_chunks,
            snap_seq=snap_seq,
        )


def _segsum(cs: torch.Tensor) -> torch.Tensor:
    """``out[..., l, s] = cs[..., l] - cs[..., s]`` (the sum of a over s+1..l) for l >= s, -inf
    above the diagonal, from float64 cumulative sums ``cs``: in float32 two large cumulative
    sums would cancel and lose the small differences that matter near the diagonal."""
    q = cs.shape[-1]
    out = (cs[..., :, None] - cs[..., None, :]).float()
    upper = torch.triu(torch.ones(q, q, dtype=torch.bool, device=cs.device), diagonal=1)
    return out.masked_fill_(upper, float("-inf"))


def mamba2_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    init_states: torch.Tensor,
    chunks: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Varlen chunked selective scan over packed sequences.

    Args: ``x [T,H,P]``, ``dt [T,H]`` (already processed, see ``process_dt``), ``A [H]``,
    ``B, C [T,G,N]``, ``D [H]`` or None, ``init_states [S,H,P,N]`` (state before each
    sequence), ``chunks`` from ``ChunkLayout.build`` for the same sequences.

    Returns ``(y [T,H,P] float32, final_states [S,H,P,N] float32, snapshots [K,H,P,N])`` where
    snapshot k is the state after the offset ``chunks`` listed k-th.
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    S = init_states.shape[0]
    Q, NC = chunks.chunk_size, chunks.num_chunks
    dev = x.device
    xf, dtf = x.float(), dt.float()
    rows = chunks.token_rows

    def padded(src: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((NC * Q, *src.shape[1:]), dtype=torch.float32, device=dev)
        out.index_copy_(0, rows, src.float())
        return out.view(NC, Q, *src.shape[1:])

    # token-major padded inputs; the head-major views below feed the batched matmuls
    xdt_t = padded(xf * dtf[..., None])  # [NC, Q, H, P]
    xdt = xdt_t.view(NC, Q, G, hpg, P).permute(0, 2, 3, 1, 4).contiguous()  # [NC,G,hpg,Q,P]
    dA = padded(dtf * A.float()[None, :]).permute(0, 2, 1)  # [NC, H, Q]
    Bg = padded(B).permute(0, 2, 1, 3)  # [NC, G, Q, N]
    Cg = padded(C).permute(0, 2, 1, 3)
    # cumulative log-decays in float64: their differences must not cancel (see _segsum)
    cs = torch.cumsum(dA.double(), dim=-1)  # [NC, H, Q]

    # 1. intra-chunk (diagonal blocks): y_l += sum_{s<=l} (C_l . B_s) exp(a_{s+1}+..+a_l) xdt_s
    decay_ls = torch.exp(_segsum(cs)).view(NC, G, hpg, Q, Q)
    cb = Cg @ Bg.transpose(-1, -2)  # [NC, G, Q, Q]
    y = (decay_ls * cb[:, :, None]) @ xdt  # [NC, G, hpg, Q, P]

    # 2. state contributed by each chunk on its own (zero start state): per chunk and group one
    # [hpg*P, Q] @ [Q, N] product (B broadcast over the group's heads cost a copy and many
    # small products)
    decay_to_end = torch.exp((cs[:, :, -1:] - cs).float())  # [NC, H, Q]
    weighted = xdt_t * decay_to_end.permute(0, 2, 1)[..., None]  # [NC, Q, H, P]
    chunk_states = weighted.view(NC, Q, G, hpg * P).permute(0, 2, 3, 1) @ Bg  # [NC,G,hpg*P,N]
    chunk_states = chunk_states.reshape(NC, H, P, N)
    chunk_decay = torch.exp(cs[:, :, -1].float())  # [NC, H]

    # 3. inter-chunk recurrence, batched across sequences: start state of every chunk
    start = torch.empty((NC, H, P, N), dtype=torch.float32, device=dev)
    cur = init_states.float().clone()
    for chunk_ids, seq_ids in zip(chunks.chunk_order, chunks.seq_of):
        h = cur.index_select(0, seq_ids)
        start.index_copy_(0, chunk_ids, h)
        h = h * chunk_decay.index_select(0, chunk_ids)[:, :, None, None]
        h = h + chunk_states.index_select(0, chunk_ids)
        cur.index_copy_(0, seq_ids, h)

    # 4. start state -> outputs of the chunk (off-diagonal blocks): per chunk and group one
    # [Q, N] @ [N, hpg*P] product
    decay_in = torch.exp(cs.float()).view(NC, G, hpg, Q, 1)
    off = Cg @ start.view(NC, G, hpg * P, N).transpose(-1, -2)  # [NC, G, Q, hpg*P]
    y = y + off.view(NC, G, Q, hpg, P).permute(0, 1, 3, 2, 4) * decay_in

    y = y.permute(0, 3, 1, 2, 4).reshape(NC * Q, H, P).index_select(0, rows)
    if D is not None:
        y = y + xf * D.float()[None, :, None]

    if chunks.snap_chunks:
        snaps = torch.stack(
            [cur[s] if c < 0 else start[c] for c, s in zip(chunks.snap_chunks, chunks.snap_seq)]
        )
    else:
        snaps = torch.empty((0, H, P, N), dtype=torch.float32, device=dev)
    assert cur.shape[0] == S
    return y, cur, snaps


def mamba2_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for a batch of sequences.

    Args: ``state [S,H,P,N]``, ``x [S,H,P]``, ``dt [S,H]`` (processed), ``A [H]``,
    ``B, C [S,G,N]``, ``D [H]`` or None. Returns ``(y [S,H,P], new_state [S,H,P,N])``, both
    float32. A float32 ``state`` is updated in place and returned (callers pass a gathered
    copy of the pool rows): the state is the large operand, so every pass over it counts.
    """
    S, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    hpg = H // G
    xf, dtf = x.float(), dt.float()
    decay = torch.exp(dtf * A.float()[None, :])  # [S, H]
    h = state.float().view(S, G, hpg, P, N)
    h.mul_(decay.view(S, G, hpg, 1, 1))
    xdt = (xf * dtf[..., None]).view(S, G, hpg, P, 1)
    h.addcmul_(xdt, B.float()[:, :, None, None, :])  # h += xdt (x) B, no outer-product temp
    y = (h @ C.float()[:, :, None, :, None]).view(S, H, P)  # [S, G, hpg, P, 1]
    if D is not None:
        y = y + xf * D.float()[None, :, None]
    return y, h.view(S, H, P, N)
