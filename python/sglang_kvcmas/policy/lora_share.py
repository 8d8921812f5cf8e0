"""Which requests may read each other's transcript KV when agents differ by LoRA adapter.

SGLang keys its radix cache by ``extra_key``, and appends a request's adapter id to it
(``Req.extra_key = (extra_key or "") + lora_id``): every adapter keeps its own copy of every
prefix. The sharing namespace decides what the shared-context tree may lend across; it never
crosses ``cache_salt`` or the caller's own ``extra_key``:

=============  ==========================================  ================================
``lora_share`` request with an adapter                      request without an adapter
=============  ==========================================  ================================
``separate``   its adapter's namespace only (SGLang's own)  the base model's namespace
``catchup``    its adapter's namespace only                 the base model's namespace
``borrow``     one namespace for all adapters               the base model's namespace
``rebase``     one namespace for all adapters               the base model's namespace
=============  ==========================================  ================================

``catchup`` keeps every adapter's cache exact and separate, and prefills a turn's prompt for the
workflow's other adapters in the background (``policy/lora_catchup.py``,
``integration/lora_catchup.py``).

Under ``borrow`` an adapter reads the transcript another adapter computed through the same read
path as prompt agents (its own head exact, borrowed tokens re-positioned, some recomputed with its
own adapter, leaf mode as configured); the first adapter to compute a segment is an exact owner.
Measured far less faithful than across prompt agents (``benchmark/serving/lora_head_to_head.py``),
so it is opt-in.

``rebase`` (PReCache's ReBaseShared, rebuilt before the read, with the adapters' centroid as the
base): every adapter request's prompt is first prefilled under the **centroid adapter**
(:data:`CENTROID`, the mean of the named adapters' deltas, ``server/lora_centroid.py``) and
only those centroid requests write the shared transcript; an adapter request reads it as under
``borrow`` but never writes it (:func:`writes_shared`), so every adapter reads one base that
sits between them all rather than the first writer's view of the text. What it promises an
adapter request: its view of the transcript is its own head (exact), the centroid's exact
prefill of the transcript (the base) and its picks recomputed with its own adapter over that
base; with every borrowed token picked, that is its own exact prefill. The base's deviation
from each adapter a is bounded by the adapters' spread: per projection, ``|dW_a - dW_c| <=
(N-1)/N * mean_b |dW_a - dW_b|`` over the other adapters b, where ``borrow`` reads another
adapter's KV at one whole ``|dW_a - dW_b|``. On the embedded model's role adapters the base
with nothing recomputed leaves a teacher-forced KL to exact of 0.007-0.014 against 0.16-0.19
for another adapter's KV, and the default picks 0.0015 (``test/server/test_lora_server.py``,
``test/server/test_lora_centroid.py``).
A request without an adapter never reads KV computed with one (and never lends to one), so the
base model's answers are what they are without adapters in the server.

The agent of a request with an adapter is its head *and* its adapter (:func:`lora_agent`): two
adapters behind the same system prompt are two agents, each with its own leaves.

Pure Python: no SGLang import.
"""

from __future__ import annotations

from typing import Any

MODES = ("separate", "catchup", "borrow", "rebase")
ADAPTERS = "lora"
"""The namespace tag every adapter shares under ``borrow`` and ``rebase``."""
CENTROID = "kvcmas-centroid"
"""The name the centroid adapter is served under (``rebase``)."""
CENTROID_RID = "kvcmas-centroid-"
"""Prefix of the request ids of centroid prefills (the scheduler tells them by it)."""

LORA_RECOMPUTE_TAIL = 32
"""Under ``borrow`` and ``rebase``, the fewest last borrowed tokens before its suffix that a
reader with an adapter recomputes (what it attends to most; across adapters every borrowed token
deviates, not only a span's first ones), unless its request sets ``kvcmas_recompute_tail``."""
LORA_RECOMPUTE_BOUNDARY = 8
"""Under ``borrow`` and ``rebase``, the first tokens of every span and every message a reader
with an adapter borrows that it recomputes, in place of the deployment's ``recompute_boundary``,
unless its request sets ``kvcmas_recompute_boundary``."""
LORA_RECOMPUTE_MASS_FRACTION = 0.0
"""Under ``borrow`` and ``rebase``, the share of its borrowed tokens that a reader with an
adapter recomputes by owner head mass, in place of the deployment's
``recompute_mass_fraction``, unless its request sets ``kvcmas_recompute_mass_fraction``.
Model-dependent: on the embedded model head mass picks no better tokens than the tail does (0 is
its best); on Qwen2.5-Coder-0.5B a quarter recovers the fidelity the tail misses at most of the
speed."""


def is_centroid(rid: Any) -> bool:
    """Whether a request id is one of ``rebase``'s centroid prefills."""
    return isinstance(rid, str) and rid.startswith(CENTROID_RID)


def writes_shared(mode: str, lora_id: str | None, rid: Any) -> bool:
    """Whether a request's computed transcript tokens join the shared tree: always, but under
    ``rebase`` an adapter request's (only the centroid writes there)."""
    return mode != "rebase" or lora_id is None or is_centroid(rid)


def caller_extra_key(extra_key: Any, lora_id: str | None) -> Any:
    """The caller's own ``extra_key``: SGLang's key with the appended adapter id taken off."""
    if lora_id is None:
        return extra_key
    if isinstance(extra_key, str) and extra_key.endswith(lora_id):
        return extra_key[: len(extra_key) - len(lora_id)] or None
    return extra_key


def sharing_namespace(extra_key: Any, cache_salt: Any, lora_id: str | None = None,
                      mode: str = "separate") -> tuple:
    """The namespace a request shares its transcript in (see the module docstring).

    Args:
        extra_key: the request's ``extra_key`` as SGLang keeps it (adapter id appended).
        cache_salt: its ``cache_salt`` (None or "" for none).
        lora_id: its adapter id (None: the base model).
        mode: one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"unknown lora_share mode {mode!r}; choose from {MODES}")
    salt = cache_salt or None
    if lora_id is None or mode not in ("borrow", "rebase"):
        return (extra_key, salt)
    return (caller_extra_key(extra_key, lora_id), salt, ADAPTERS)


def lora_agent(agent: str, lora_id: str | None) -> str:
    """The agent id of a request: its head's id, with its adapter when it names one."""
    return agent if lora_id is None else f"{agent}@lora:{lora_id}"
