from __future__ import annotations

import math

import torch

from sglang_kvcmas_lab.correction.fidelity import first_divergence, kv_relative_error, teacher_forced


def test_identical_logits_are_perfect():
    x = torch.randn(9, 50)
    tf = teacher_forced(x, x.clone())
    assert tf.top1 == 1.0 and tf.mean_kl < 1e-12 and tf.num_positions == 9


def test_kl_matches_closed_form():
    p = torch.tensor([[0.0, 0.0]])  # uniform
    q = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64)  # 1/4, 3/4
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    tf = teacher_forced(p, q)
    assert abs(tf.mean_kl - want) < 1e-9
    assert tf.top1 == 0.0  # argmax of uniform is index 0, of q index 1


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([5], [6]) == 0


def test_kv_relative_error():
    r = [torch.ones(4, 2, 3), torch.zeros(4, 2, 3)]
    t = [torch.ones(4, 2, 3) * 1.1, torch.ones(4, 2, 3)]
    err = kv_relative_error(r, t)
    assert abs(err[0] - 0.1) < 1e-6
    assert abs(err[1] - (24 ** 0.5)) < 1e-6
