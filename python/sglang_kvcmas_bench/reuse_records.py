"""Read a response's reuse record (``meta_info.kvcmas_reuse``) under one schema.

Servers before the first accounting rename called every borrowed token ``reused_corrected`` and
described what a reader recomputed and read from its leaves in a ``correction`` label
(``boundary_recompute:N+delta_leaf:M``); committed turn files keep that schema. Later a borrowed
token was ``reused_repositioned`` or ``reused_corrected`` (read through a correction or a
factored leaf); today it is ``reused_repositioned`` or ``reused_factored``, and the two counts
are fields of their own. Benchmarks read every schema through :func:`normalized`.
"""

from __future__ import annotations


def normalized(rec: dict | None) -> dict:
    """``{exact, borrowed, recomputed, recomputed_borrowed, exact_from_leaves}`` of one record
    ({} when the response carried none)."""
    if not rec:
        return {}
    if "correction" in rec:
        parts = dict(p.split(":") for p in (rec["correction"] or "none").split("+") if ":" in p)
        recomputed_borrowed = int(parts.get("boundary_recompute", 0))
        from_leaves = int(parts.get("delta_leaf", 0))
    else:
        recomputed_borrowed = rec.get("recomputed_borrowed", 0)
        from_leaves = rec.get("exact_from_leaves", 0)
    return {"exact": rec["reused_exact"],
            "borrowed": rec.get("reused_repositioned", 0) + rec.get("reused_factored", 0)
            + rec.get("reused_corrected", 0),
            "recomputed": rec["recomputed"], "recomputed_borrowed": recomputed_borrowed,
            "exact_from_leaves": from_leaves}


def of_meta(meta: dict) -> dict:
    """:func:`normalized` of a response's ``meta_info``."""
    rec = (meta or {}).get("kvcmas_reuse")
    return normalized(rec[0] if isinstance(rec, list) and rec else rec)
