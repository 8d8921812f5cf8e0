"""Segment tree: keyed by tokens only, first owner's base kept, bytes counted."""

from __future__ import annotations

import pytest
import torch

from sglang_kvcmas.models.reference_llama import KVCache
from sglang_kvcmas.segments import SegmentTree


def cache(T):
    z = torch.zeros(T, 2, 4)
    return KVCache([z, z], [z, z], torch.arange(T))


def test_growing_transcript_is_a_path_matched_by_every_agent():
    tree = SegmentTree()
    q = tree.new_segment(torch.tensor([1, 2, 3]), owner="a")
    n1 = tree.insert(tree.root, q, cache(3))
    ans = tree.new_segment(torch.tensor([4, 5]), owner="b")
    n2 = tree.insert(n1, ans, cache(2))
    assert SegmentTree.path(n2) == [n1, n2] and n2.depth == 2
    assert tree.match([torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([9])]) == [n1, n2]
    # a second owner of the same tokens does not replace the first base
    again = tree.insert(tree.root, tree.new_segment(torch.tensor([1, 2, 3]), owner="c"), cache(3))
    assert again is n1 and again.owner == "a"
    assert tree.base_nbytes() == cache(3).nbytes() + cache(2).nbytes()


def test_rejects_mismatched_base():
    tree = SegmentTree()
    with pytest.raises(ValueError):
        tree.insert(tree.root, tree.new_segment(torch.tensor([1, 2]), "a"), cache(3))
