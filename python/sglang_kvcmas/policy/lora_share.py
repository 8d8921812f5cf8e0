"""Which requests may read each other's transcript KV when agents differ by LoRA adapter.

SGLang keys its radix cache by ``extra_key`` with the request's adapter id appended
(``Req.extra_key = (extra_key or "") + lora_id``): every adapter keeps its own copy of every
prefix. The sharing namespace decides what the shared-context tree may lend across; it never
crosses ``cache_salt`` or the caller's own ``extra_key``:

=============  ==========================================  ================================
``lora_share`` request with an adapter                      request without an adapter
=============  ==========================================  ================================
``separate``   its adapter's namespace only (SGLang's own)  the base model's namespace
``borrow``     one namespace for all adapters               the base model's namespace
=============  ==========================================  ================================

Under ``borrow`` an adapter reads the transcript another adapter computed through the same read
path as prompt agents; the first adapter to compute a segment is an exact owner. Across adapters
every borrowed token deviates, not only a span's first ones, so a reader with an adapter
recomputes more by default (the ``LORA_RECOMPUTE_*`` constants below), and the fidelity monitor
serves a namespace or agent whose sampled turns drift at a raised level (``policy/fidelity.py``).
A request without an adapter never reads KV computed with one (and never lends to one), so the
base model's answers are what they are without adapters in the server.

The agent of a request with an adapter is its head *and* its adapter (:func:`lora_agent`): two
adapters behind the same system prompt are two agents, each with its own leaves. Pure Python.
"""

from __future__ import annotations

from typing import Any

MODES = ("separate", "borrow")
ADAPTERS = "lora"
"""The namespace tag every adapter shares under ``borrow``."""
LORA_RECOMPUTE_TAIL = 32
"""Under ``borrow``, the fewest last borrowed tokens before its suffix (what it attends to most)
that a reader with an adapter recomputes, unless its request sets ``kvcmas_recompute_tail``."""
LORA_RECOMPUTE_BOUNDARY = 8
"""Under ``borrow``, the first tokens of every span and message that a reader with an adapter
recomputes, in place of ``recompute_boundary``, unless its request sets
``kvcmas_recompute_boundary``."""
LORA_RECOMPUTE_MASS_FRACTION = 0.0
"""Under ``borrow``, the share by owner head mass that a reader with an adapter recomputes, in
place of ``recompute_mass_fraction``, unless its request sets ``kvcmas_recompute_mass_fraction``.
Model-dependent: on the embedded model head mass picks no better tokens than the tail does; on
others it recovers fidelity the tail misses."""

def caller_extra_key(extra_key: Any, lora_id: str | None) -> Any:
    """The caller's own ``extra_key``: SGLang's key with the appended adapter id taken off."""
    if lora_id is None:
        return extra_key
    if isinstance(extra_key, str) and extra_key.endswith(lora_id):
        return extra_key[: len(extra_key) - len(lora_id)] or None
    return extra_key


def sharing_namespace(extra_key: Any, cache_salt: Any, lora_id: str | None = None,
                      mode: str = "separate") -> tuple:
    """The namespace a request shares its transcript in (see the module docstring), from its
    ``extra_key`` as SGLang keeps it (adapter id appended), its ``cache_salt`` (None or "" for
    none) and its adapter id (None: the base model)."""
    if mode not in MODES:
        raise ValueError(f"unknown lora_share mode {mode!r}; choose from {MODES}")
    salt = cache_salt or None
    if lora_id is None or mode != "borrow":
        return (extra_key, salt)
    return (caller_extra_key(extra_key, lora_id), salt, ADAPTERS)


def lora_agent(agent: str, lora_id: str | None) -> str:
    """The agent id of a request: its head's id, with its adapter when it names one."""
    return agent if lora_id is None else f"{agent}@lora:{lora_id}"
