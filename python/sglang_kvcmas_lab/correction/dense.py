"""No sharing: dense prefill of the reader's whole prompt (the reference every method is judged by)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_kvcmas_lab.correction.base import BuildResult, CacheBuilder, ReadRequest, register, split_views
from sglang_kvcmas_lab.models.reference_llama import RefLlama

__all__ = ["NoSharing"]


@register("no_sharing")
@dataclass
class NoSharing(CacheBuilder):
    def __post_init__(self):
        self.persistent = False

    def build(self, model: RefLlama, req: ReadRequest) -> BuildResult:
        out = model.forward(req.all_ids())
        return BuildResult(out.kv, out.logits[-1], split_views(out.kv, req), (),
                           req.num_read_tokens, {})
