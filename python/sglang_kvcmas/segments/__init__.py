"""Shared-context segments: the tree of transcript segments, their owners' bases and delta leaves."""

from sglang_kvcmas.segments.tree import Segment, SegmentNode, SegmentTree

__all__ = ["Segment", "SegmentNode", "SegmentTree"]
