"""The sampler's per-row reductions (``kernels/sampling.py``, ``csrc/sampling.c``): the first
maximum exactly as torch's argmax gives it (ties, chunk boundaries, NaN, all -inf), and the
softmax normalizer (max, log_sum): the logprobs it gives as close to the float64 truth as
torch's log_softmax, with a bound that a kernel keeping one running fp32 sum fails (negative
control), and the same answer on any thread count."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from mambaradix.kernels.sampling import (
    argmax_logsumexp,
    argmax_logsumexp_reference,
    logprobs_of,
)

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None, reason="no C compiler: the native kernels cannot be built here"
)

CHUNK = 16384  # csrc/sampling.c's chunk of a row


def logprob_error(lp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|logprobs - float64 truth| over the rows' logprobs ``lp`` [B, V] of logits ``x``."""
    return (lp.double() - torch.log_softmax(x.double(), dim=-1)).abs().amax(dim=-1)


def fp32_running_norm(x: torch.Tensor):
    """(max, log_sum) with sum(exp) as one running fp32 sum (numpy's cumsum is sequential in
    the dtype it is given; torch's accumulates in fp64): the control."""
    m = x.amax(dim=-1)
    e = (x - m[:, None]).exp().numpy()
    run = torch.from_numpy(np.cumsum(e, axis=-1, dtype=np.float32)[:, -1])
    return m, run.log()


@pytest.mark.parametrize("b, v", [(1, 248320), (3, 65536), (2, 100352), (4, 17), (1, CHUNK + 1)])
def test_against_torch_and_the_truth(b, v):
    g = torch.Generator().manual_seed(v + b)
    x = torch.randn(b, v, generator=g) * 4
    idx, norm = argmax_logsumexp(x)
    assert torch.equal(idx, x.argmax(dim=-1))
    err = logprob_error(logprobs_of(x, norm), x)
    ref = logprob_error(torch.log_softmax(x, dim=-1), x)
    bound = torch.maximum(2 * ref, torch.full_like(ref, 2e-6))
    assert (err <= bound).all(), (err, ref)
    if v == 248320:
        bad = logprob_error(logprobs_of(x, fp32_running_norm(x)), x)
        assert (bad > bound).all(), (bad, bound)  # the bound sees a running fp32 sum


def test_ties_take_the_first_index_across_lanes_and_chunks():
    x = torch.zeros(4, 3 * CHUNK + 5)
    x[0, [7, 23, 39]] = 2.0  # the same lane position in three vectors, and another lane
    x[1, [CHUNK + 3, 2 * CHUNK + 1]] = 4.0  # a tie across chunks
    x[2, [3 * CHUNK + 4, 3 * CHUNK + 2]] = 1.0  # the scalar tail
    x[3, 5] = -1.0  # a row of zeros but one: the first zero
    idx, _ = argmax_logsumexp(x)
    assert idx.tolist() == x.argmax(dim=-1).tolist() == [7, CHUNK + 3, 3 * CHUNK + 2, 0]


def test_nan_and_minus_inf_rows_as_torch():
    x = torch.randn(3, 2 * CHUNK)
    x[0, CHUNK + 9] = float("nan")
    x[1] = float("-inf")
    x[2, :CHUNK] = float("-inf")
    idx, (maxv, log_sum) = argmax_logsumexp(x)
    ref_idx, (ref_max, ref_log_sum) = argmax_logsumexp_reference(x)
    assert torch.equal(idx, ref_idx)
    assert log_sum[0].isnan() and maxv[1] == log_sum[1] == float("-inf")
    assert maxv[2] == ref_max[2] and torch.allclose(log_sum[2], ref_log_sum[2], rtol=1e-6)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_thread_count_changes_nothing(threads):
    x = torch.randn(5, 100000, generator=torch.Generator().manual_seed(1)) * 3
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = argmax_logsumexp(x)
        torch.set_num_threads(threads)
        got = argmax_logsumexp(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_without_lse_and_other_inputs():
    x = torch.randn(2, 1000)
    idx, norm = argmax_logsumexp(x, want_norm=False)
    assert norm is None and torch.equal(idx, x.argmax(-1))
    strided = torch.randn(1000, 2).t()  # last dim not dense: torch's answer
    idx, norm = argmax_logsumexp(strided)
    assert torch.equal(idx, strided.argmax(-1))
    assert torch.allclose(logprobs_of(strided, norm), torch.log_softmax(strided, -1))
