"""The Triton head-mass kernel equals the torch reference (``span_reads.head_mass``) over awkward
sizes: one query, blocks cut mid-way, GQA 1:1 to 7:1, head sizes that are not a power of two,
positions out of row order, empty and out-of-range head ranges; on CPU in Triton's interpreter.

Tolerances: float32 ``atol=2e-5`` in the interpreter (numpy float32, base-2 exponentials, a
different summation order); ``1e-4`` on CUDA (``ieee`` dots, other reduction orders); bfloat16
inputs (CUDA only) the same, both upcast to float32 before scoring.
"""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas.attention.span_reads import head_mass
from sglang_kvcmas.attention.triton_head_mass import head_mass_triton

pytestmark = pytest.mark.slow  # the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter

# n_q, n_kv, kv heads, GQA group, head_dim, head_from, head_to, key positions
CASES = [
    (1, 1, 1, 1, 16, 0, 1, "row"),  # one token, its own head: mass 1
    (17, 65, 2, 3, 40, 2, 9, "row"),  # head_dim 40: a masked dimension tile
    (130, 300, 3, 7, 64, 5, 40, "shuffled"),  # three query blocks, the last cut
    (5, 5, 2, 1, 128, 3, 3, "row"),  # an empty head range: mass 0
    (64, 200, 1, 4, 256, 0, 500, "row"),  # head past the keys: every key, mass 1
    (33, 97, 4, 1, 32, 90, 200, "recomputed"),  # the head's tail past the keys
]


def _positions(kind: str, n_kv: int, n_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "row":
        k_pos = torch.arange(n_kv)
    elif kind == "shuffled":
        k_pos = torch.randperm(n_kv)
    else:  # a reader's recomputed tokens: row order != position order before the new ones
        cut = n_kv - n_q
        k_pos = torch.cat([torch.arange(cut)[torch.randperm(cut)], torch.arange(cut, n_kv)])
    return k_pos[n_kv - n_q :] if kind != "shuffled" else torch.arange(n_kv - n_q, n_kv), k_pos


@pytest.mark.parametrize("n_q, n_kv, h_kv, group, d, head_from, head_to, kind", CASES)
def test_kernel_equals_the_reference(n_q, n_kv, h_kv, group, d, head_from, head_to, kind):
    torch.manual_seed(n_q * 31 + n_kv)
    q = torch.randn(n_q, h_kv * group, d, device=DEV).movedim(0, 1)  # strided, as served
    k = torch.randn(n_kv, h_kv, d, device=DEV).movedim(0, 1)
    q_pos, k_pos = (p.to(DEV) for p in _positions(kind, n_kv, n_q))
    want = head_mass(q, k, q_pos, k_pos, d ** -0.5, head_from, head_to)
    got = head_mass_triton(q, k, q_pos, k_pos, d ** -0.5, head_from, head_to)
    tol = 1e-4 if DEV == "cuda" else 2e-5
    assert got.shape == (n_q,) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if head_from >= head_to:
        assert got.eq(0).all()
    if head_from == 0 and head_to >= n_kv:
        torch.testing.assert_close(got, torch.ones_like(got), atol=tol, rtol=tol)


@pytest.mark.skipif(DEV != "cuda", reason="the interpreter's bfloat16 is not the GPU's")
def test_bf16_inputs_score_in_float32():
    torch.manual_seed(1)
    q = torch.randn(8, 70, 128, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(2, 300, 128, device=DEV, dtype=torch.bfloat16)
    pos = torch.arange(300, device=DEV)
    want = head_mass(q, k, pos[230:], pos, 128 ** -0.5, 4, 60)
    got = head_mass_triton(q, k, pos[230:], pos, 128 ** -0.5, 4, 60)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_no_queries_and_bad_groups():
    q, k = torch.randn(4, 0, 16, device=DEV), torch.randn(2, 3, 16, device=DEV)
    pos = torch.arange(3, device=DEV)
    assert head_mass_triton(q, k, pos[:0], pos, 1.0, 0, 1).shape == (0,)
    with pytest.raises(ValueError, match="multiple"):
        head_mass_triton(torch.randn(3, 1, 16), torch.randn(2, 3, 16), pos[:1].cpu(),
                         pos.cpu(), 1.0, 0, 1)
