"""The array walk of a borrowed path (``BorrowedPath``), the array selection and the row's shift
map equal their one-object-per-token references, over random trees with scattered leaves."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from sglang_kvcmas.policy.recompute import (
    RecomputeConfig,
    select_recompute,
    select_recompute_arrays,
    top_by_mass,
)
from sglang_kvcmas.tree.agent_split import AgentSplit
from sglang_kvcmas.tree.borrowed import (
    BorrowedPath,
    SharedPrefixHandle,
    borrowed_spans,
    borrowed_tokens,
    row_spans,
)
from sglang_kvcmas.tree.shared_tree import SharedTree

HEAD = 7
AGENTS = ["a", "b", "c"]


def random_tree(rng: random.Random, segments: int) -> tuple[SharedTree, list[int]]:
    """A chain of ``segments`` nodes with random owners, positions, head mass (some ties, some
    zeros, some unrecorded) and leaves of agent "a" (some at another reader position)."""
    tree = SharedTree(lambda s: None)
    tokens: list[int] = []
    slot = 0
    for i in range(segments):
        n = rng.choice([1, 2, 5, 17, 40])
        new = [rng.randrange(100, 10**6) for _ in range(n)]
        mass = None
        if rng.random() < 0.8:
            mass = torch.tensor([rng.choice([0.0, 0.1, 0.5, rng.random()]) for _ in range(n)])
        owner = rng.choice(AGENTS)
        start = len(tokens)
        tokens += new
        _, node = tree.insert("ns", tokens, start, torch.arange(slot, slot + n), owner,
                              HEAD + start + rng.choice([0, 0, 3, -2]), anchor=None,
                              head_mass=mass)
        slot += n
        if rng.random() < 0.6:
            k = rng.randrange(1, n + 1)
            offs = sorted(rng.sample(range(n), k))
            reader_start = HEAD + start + (0 if rng.random() < 0.8 else 1)
            tree.add_overrides(node, "a", torch.tensor(offs),
                               torch.arange(10**6 + slot, 10**6 + slot + k), reader_start)
            slot += k
    return tree, tokens


def handle_for(tree, tokens, begin, use_leaves=True, recompute=()):
    _, node = tree.match("ns", tokens, split=True)
    split = AgentSplit("a", HEAD, HEAD + len(tokens))
    return SharedPrefixHandle(None, HEAD + begin, node, begin, len(tokens), split, "ns",
                              recompute=recompute, use_leaves=use_leaves)


@pytest.mark.parametrize("seed", range(12))
def test_walk_equals_reference_tokens(seed):
    rng = random.Random(seed)
    tree, tokens = random_tree(rng, rng.randrange(1, 9))
    begin = rng.randrange(0, len(tokens))
    for use_leaves in (True, False):
        handle = handle_for(tree, tokens, begin, use_leaves)
        path = BorrowedPath.walk(handle)
        ref = borrowed_tokens(handle)
        assert path.offsets.tolist() == [t.token.offset for t in ref]
        assert path.slots.tolist() == [t.slot for t in ref]
        assert path.shift.tolist() == [t.shift for t in ref]
        assert path.foreign.tolist() == [t.token.foreign for t in ref]
        assert path.from_leaf.tolist() == [t.token.from_leaf for t in ref]
        np.testing.assert_array_equal(path.mass, np.array([t.token.mass for t in ref],
                                                          dtype=np.float32))


CONFIGS = [
    RecomputeConfig(boundary_tokens=0, mass_fraction=0.0, min_borrowed=0),
    RecomputeConfig(boundary_tokens=3, mass_fraction=0.1, min_borrowed=0),
    RecomputeConfig(boundary_tokens=16, mass_fraction=0.3, max_fraction=0.2, min_borrowed=0),
    RecomputeConfig(boundary_tokens=1, mass_fraction=1.0, max_fraction=1.0, min_borrowed=0,
                    tail_tokens=5),
    RecomputeConfig(boundary_tokens=0, mass_fraction=0.5, max_fraction=0.05, min_borrowed=0),
    RecomputeConfig(boundary_tokens=2, mass_fraction=0.5, max_fraction=1.0, min_borrowed=0),
    RecomputeConfig(boundary_tokens=0, mass_fraction=1.0, min_borrowed=0),
]


@pytest.mark.parametrize("seed", range(12))
def test_array_selection_equals_reference(seed):
    rng = random.Random(100 + seed)
    tree, tokens = random_tree(rng, rng.randrange(1, 9))
    handle = handle_for(tree, tokens, rng.randrange(0, len(tokens)))
    spans, path = borrowed_spans(handle), BorrowedPath.walk(handle)
    ref_tokens = [t.token for t in borrowed_tokens(handle)]
    for config in CONFIGS:
        want = select_recompute(spans, ref_tokens, config)
        got = select_recompute_arrays(spans, path.offsets, path.foreign, path.from_leaf,
                                      path.mass, config)
        assert got == want, config


@pytest.mark.parametrize("seed", range(8))
def test_row_spans_equal_a_token_by_token_row(seed):
    rng = random.Random(200 + seed)
    tree, tokens = random_tree(rng, rng.randrange(2, 9))
    begin = rng.randrange(0, len(tokens) - 1)
    offsets = list(range(begin, len(tokens)))
    recompute = tuple(sorted(rng.sample(offsets, rng.randrange(0, len(offsets)))))
    handle = handle_for(tree, tokens, begin, recompute=recompute)
    prompt = [0] * HEAD + tokens + [1, 2]
    row, kept = row_spans("r", prompt, handle)
    ref = borrowed_tokens(handle)  # recomputed ones left out
    assert int(kept.sum()) == len(ref)
    shifts = [0] * handle.radix_len + [t.shift for t in ref]
    got = row.key_shifts.shifts[row.key_shifts.index_upto(len(shifts))].tolist()
    assert got == shifts
    if recompute:
        positions = list(range(handle.radix_len)) + [HEAD + t.token.offset for t in ref]
        assert row.recomputed.row_start == len(positions)
        assert row.recomputed.positions == tuple(HEAD + o for o in recompute)
        assert row.recomputed.token_ids == tuple(prompt[HEAD + o] for o in recompute)
        assert row.positions.tolist() == positions + [HEAD + o for o in recompute]
    else:
        assert row.recomputed is None and row.positions is None


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (50, 10), (50, 50), (50, 60), (200, 1)])
def test_top_by_mass_is_a_stable_sort_prefix(n, k):
    rng = np.random.default_rng(n + k)
    mass = rng.choice([0.0, 0.25, 0.5, 0.75], size=3 * n).astype(np.float32)  # many ties
    candidates = np.sort(rng.choice(3 * n, size=n, replace=False))
    want = candidates[np.argsort(-mass[candidates], kind="stable")][:k]
    np.testing.assert_array_equal(top_by_mass(candidates, mass, k), want)
