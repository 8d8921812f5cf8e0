"""Which adapters to catch up when an adapter request of a workflow arrives (``catchup`` mode).

Under ``--kvcmas-lora-share catchup`` every adapter keeps its own exact cache, as in SGLang, and
when an adapter's request of a workflow arrives, the same prompt is also prefilled, in the
background, for every *other* adapter that has spoken in that workflow. Those prefills run in the
scheduler's next batches, alongside the first request's own decode; when the next adapter's turn
comes, its prompt (this prompt plus the message being written) finds all but the new message in
its own radix cache. The answers are exactly what stock LoRA serving gives (radix reuse of the
adapter's own exact prefill); the cost is the background prefill, which is counted.

It pays when agents speak one after another over a transcript they all see with the same head
(the same system prompt, the adapter alone differing): a prompt of one adapter is then a prefix of
the next adapter's prompt. Agents with their own system prompts would catch up a prompt that is
not theirs; this mode is for adapter-only agents.

An adapter with a request of its own in flight in the workflow is not caught up: agents that
answer together (a panel) would otherwise prefill the same prompt twice. The caller checks
:meth:`CatchupPlanner.in_flight` after a short grace period, so a request that arrives together
with the writer's is seen.

Memory is bounded: at most ``max_workflows`` workflows (least recently active dropped first) and
``max_adapters`` adapters per workflow.

Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class CatchupPlanner:
    """Adapters seen per workflow, most recent first.

    Attributes:
        max_workflows: workflows remembered.
        max_adapters: adapters remembered per workflow (and caught up per request).
    """

    max_workflows: int = 1024
    max_adapters: int = 8
    _seen: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)
    _active: dict[tuple[str, str], int] = field(default_factory=dict)

    def started(self, workflow: str, adapter: str) -> None:
        """A request of ``adapter`` in ``workflow`` is in flight."""
        k = (workflow, adapter)
        self._active[k] = self._active.get(k, 0) + 1

    def finished(self, workflow: str, adapter: str) -> None:
        """That request has finished (or failed)."""
        k = (workflow, adapter)
        left = self._active.get(k, 0) - 1
        if left > 0:
            self._active[k] = left
        else:
            self._active.pop(k, None)

    def in_flight(self, workflow: str, adapter: str) -> bool:
        """Whether ``adapter`` has a request of its own in flight in ``workflow``."""
        return (workflow, adapter) in self._active

    def on_request(self, workflow: str, adapter: str) -> list[str]:
        """Record that ``adapter`` spoke in ``workflow``; the other adapters seen there (to
        catch up on this request's prompt), most recently seen first."""
        seen = self._seen.pop(workflow, [])
        others = [a for a in seen if a != adapter]
        self._seen[workflow] = [adapter, *others][: self.max_adapters]
        while len(self._seen) > self.max_workflows:
            self._seen.popitem(last=False)
        return others[: self.max_adapters - 1]

    def __len__(self) -> int:
        return len(self._seen)
