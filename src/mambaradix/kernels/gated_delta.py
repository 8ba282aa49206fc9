"""Gated delta rule (Gated DeltaNet) torch reference kernels.

Per value head, with state ``S`` (``[Dk, Dv]``), decay ``a_t = exp(g_t)`` and write strength
``beta_t``::

    S'  = a_t * S
    u_t = beta_t * (v_t - S'^T k_t)        # the delta: what the decayed state mispredicts
    S   = S' + k_t u_t^T
    o_t = S^T q_t

``q``/``k`` are L2-normalised (when ``use_qk_l2norm``) and ``q`` is scaled by ``Dk**-0.5``.
Key heads are shared by ``Hv // Hk`` consecutive value heads. States are fp32.

Chunked form (chunk of C tokens, cumulative log decay ``c`` inside the chunk, start state S0)::

    (I + A) U = diag(beta) V - diag(beta e^c) K S0,  A_ij = beta_i e^(c_i - c_j) k_i.k_j  (j < i)
    O         = diag(e^c) Q S0 + (Q K^T * Gamma) U,  Gamma_ij = e^(c_i - c_j)  (j <= i)
    S_end     = e^(c_last) S0 + (K * e^(c_last - c))^T U

Right-padding a sequence with ``beta = 0`` and ``g = 0`` leaves its state unchanged, so
sequences of different lengths can share one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mambaradix.kernels.conv import causal_conv1d_update


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the convention of the FLA kernels)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _prepare_qk(
    q: torch.Tensor, k: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool, head_dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5)
    rep = num_v_heads // q.shape[head_dim]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=head_dim)
        k = k.repeat_interleave(rep, dim=head_dim)
    return q, k


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
    states_at: list[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Chunked gated delta rule over B equal-length (right-padded) sequences.

    Shapes: q, k ``[B, T, Hk, Dk]``; v ``[B, T, Hv, Dv]``; g, beta ``[B, T, Hv]``;
    initial_state ``[B, Hv, Dk, Dv]``. Returns ``(out [B, T, Hv, Dv] in v's dtype,
    final_state [B, Hv, Dk, Dv] fp32)``, and with ``states_at`` (pairs ``(row, m)``,
    ``1 <= m <= T``) also the state of row ``row`` after its first ``m`` tokens, one
    ``[Hv, Dk, Dv]`` per pair, stacked in order. Exact (up to rounding) for any T; splitting a
    sequence and chaining final -> initial state gives the same result.

    A state inside a chunk costs one small matmul: with ``i`` tokens of chunk ``n`` done,
    ``S_i = e^(c_(i-1)) S0 + (K[:i] * e^(c_(i-1) - c[:i]))^T U[:i]`` (the chunk-end formula
    over the first ``i`` rows: ``U`` is lower-triangular in the tokens, so its first ``i`` rows
    do not depend on later ones). A snapshot anywhere therefore needs no extra pass.
    """
    B, T, Hv, Dv = v.shape
    out_dtype = v.dtype
    q, k = _prepare_qk(q, k, Hv, use_qk_l2norm)
    # -> [B, H, T, D]
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.float().transpose(1, 2)
    g = g.float().transpose(1, 2)
    beta = beta.float().transpose(1, 2)

    C = chunk_size
    pad = (-T) % C
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    N = (T + pad) // C
    Dk = k.shape[-1]
    q = q.reshape(B, Hv, N, C, Dk)
    k = k.reshape(B, Hv, N, C, Dk)
    v = v.reshape(B, Hv, N, C, Dv)
    c = g.reshape(B, Hv, N, C).cumsum(-1)
    beta = beta.reshape(B, Hv, N, C)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # Gamma_ij = exp(c_i - c_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    gamma = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a_mat = (beta.unsqueeze(-1) * kk * gamma).tril(-1)
    eye = torch.eye(C, dtype=a_mat.dtype, device=a_mat.device)
    system = eye + a_mat
    rhs = torch.cat([beta.unsqueeze(-1) * v, (beta * c.exp()).unsqueeze(-1) * k], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    w, kc = sol[..., :Dv], sol[..., Dv:]  # U = w - kc @ S0
    qk = (q @ k.transpose(-1, -2)) * gamma
    q_dec = q * c.exp().unsqueeze(-1)
    last = c[..., -1:]
    k_dec = k * (last - c).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)  # [B, H, N, 1, 1]

    state = initial_state.float().clone()
    out = torch.empty(B, Hv, N * C, Dv, dtype=torch.float32, device=v.device).view(B, Hv, N, C, Dv)
    wanted: dict[int, list[tuple[int, int, int]]] = {}  # chunk -> (pair index, row, i)
    for j, (row, m) in enumerate(states_at or ()):
        if not 1 <= m <= T:
            raise ValueError(f"states_at: position {m} outside 1..{T}")
        wanted.setdefault((m - 1) // C, []).append((j, row, m - (m - 1) // C * C))
    picked = torch.empty(len(states_at or ()), Hv, Dk, Dv, dtype=torch.float32, device=v.device)
    pos = torch.arange(C, device=v.device)
    for n in range(N):
        u = w[:, :, n] - kc[:, :, n] @ state
        out[:, :, n] = q_dec[:, :, n] @ state + qk[:, :, n] @ u
        inside = [x for x in wanted.get(n, ()) if x[2] < C]
        if inside:  # states after i < C tokens of this chunk, all wanted ones at once
            js, rows, ii = (torch.tensor(t, device=v.device) for t in zip(*inside))
            cn = c[rows, :, n]  # [W, H, C]
            c_last = cn.gather(-1, (ii - 1)[:, None, None].expand(-1, Hv, 1))  # c_(i-1)
            after = (pos >= ii[:, None])[:, None, :]  # tokens past i: masked before exp
            weight = (c_last - cn).masked_fill(after, float("-inf")).exp()  # [W, H, C]
            k_i = k[rows, :, n] * weight.unsqueeze(-1)
            picked[js] = state[rows] * c_last.exp().unsqueeze(-1) + k_i.transpose(-1, -2) @ u[rows]
        state = state * chunk_decay[:, :, n] + k_dec[:, :, n].transpose(-1, -2) @ u
        ends = [x for x in wanted.get(n, ()) if x[2] == C]
        if ends:  # at the chunk's end: the state just computed (aligned snapshots land here)
            js, rows = (torch.tensor(t, device=v.device) for t in list(zip(*ends))[:2])
            picked[js] = state[rows]
    out = out.reshape(B, Hv, N * C, Dv)[:, :, :T].transpose(1, 2)
    if states_at is not None:
        return out.to(out_dtype), state, picked
    return out.to(out_dtype), state


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for B sequences: q, k ``[B, Hk, Dk]``; v ``[B, Hv, Dv]``; g, beta ``[B, Hv]``;
    state ``[B, Hv, Dk, Dv]``. Returns ``(out [B, Hv, Dv], new_state fp32)``. ``state`` is not
    modified unless ``inplace`` (then a fp32 ``state`` is updated and returned)."""
    B, Hv, Dv = v.shape
    q, k = _prepare_qk(q, k, Hv, use_qk_l2norm)
    s = state if (inplace and state.dtype == torch.float32) else state.float().clone()
    s.mul_(g.float().exp()[..., None, None])
    flat = s.view(B * Hv, -1, Dv)
    kf = k.reshape(B * Hv, 1, -1)
    pred = torch.bmm(kf, flat).view(B, Hv, Dv)  # S^T k
    delta = (v.float() - pred) * beta.float().unsqueeze(-1)
    flat.baddbmm_(kf.transpose(1, 2), delta.view(B * Hv, 1, Dv))
    out = torch.bmm(q.reshape(B * Hv, 1, -1), flat).view(B, Hv, Dv)
    return out.to(v.dtype), s


def gdn_gates(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's log decay and write strength from the projected ``a``, ``b``
    (``[..., Hv]``): ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32), ``beta = beta_scale *
    sigmoid(b)`` (in b's dtype; ``beta_scale`` 2 lets OLMo-Hybrid's state take negative
    eigenvalues)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b)
    return g, beta if beta_scale == 1.0 else beta * beta_scale


def gated_delta_decode(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    activation: str | None = "silu",
    use_qk_l2norm: bool = True,
    beta_scale: float = 1.0,
) -> torch.Tensor:
    """One decode token of B requests through the short conv and the delta rule, in place on
    the state pools.

    ``x`` ``[B, conv_dim]``: the pre-conv ``q|k|v`` rows (``conv_dim = 2 Hk Dk + Hv Dv``);
    ``conv_pool`` ``[S, conv_dim, K-1]`` and ``ssm_pool`` ``[S, Hv, Dk, Dv]``; ``slots`` ``[B]``
    (distinct) the requests' slots, whose conv and delta states advance by one token;
    ``weight`` ``[conv_dim, K]``; ``a``, ``b`` ``[B, Hv]`` the gate projections and ``A_log``,
    ``dt_bias`` ``[Hv]`` and ``beta_scale`` (``gdn_gates``). Returns ``[B, Hv, Dv]`` in x's
    dtype.
    """
    B = x.shape[0]
    hv, dk, dv = ssm_pool.shape[1:]
    g, beta = gdn_gates(a, b, A_log, dt_bias, beta_scale)
    conv_out, new_conv = causal_conv1d_update(
        x, conv_pool.index_select(0, slots), weight, bias, activation
    )
    q, k, v = torch.split(conv_out, [num_k_heads * dk, num_k_heads * dk, hv * dv], dim=-1)
    o, new_ssm = recurrent_gated_delta_step(
        q.reshape(B, num_k_heads, dk),
        k.reshape(B, num_k_heads, dk),
        v.reshape(B, hv, dv),
        g,
        beta,
        ssm_pool.index_select(0, slots),
        use_qk_l2norm,
        inplace=True,
    )
    conv_pool.index_copy_(0, slots, new_conv.to(conv_pool.dtype))
    ssm_pool.index_copy_(0, slots, new_ssm.to(ssm_pool.dtype))
    return o


def naive_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token loop (tests only): same contract as ``chunk_gated_delta_rule``."""
    state = initial_state.float()
    outs = []
    for t in range(v.shape[1]):
        o, state = recurrent_gated_delta_step(
            q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, use_qk_l2norm
        )
        outs.append(o)
    return torch.stack(outs, dim=1), state
