"""Every serving knob, defined once: its type, default and help, and from them its names.

Each field of :class:`ServingConfig` is one knob. From its name come

- the launcher flag ``--kvcmas-<name>`` (``-`` for ``_``; a ``bool`` is a switch),
- the environment variable ``KVCMAS_<NAME>``, through which the launcher hands the parsed value
  to every SGLang process it starts (a user may also set it; the flag wins),
- for the knobs marked ``per_request``, the request field ``custom_params.kvcmas_<name>``.

The launcher parses flags and environment once (:func:`resolve`), validates them and fails at
startup on a bad value; each scheduler reads the environment once when it builds its tree cache
(:meth:`ServingConfig.from_env`). Nothing reads a knob per scheduler step. Request fields are
parsed by ``policy/request_options.py`` with the same :class:`Knob` rules.

Pure Python: no SGLang or torch import.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any


class ConfigError(ValueError):
    """A knob's value is missing its type or range; the message names the knob as given."""


def _knob(default: Any, help: str, *, kind: type, per_request: bool = False,
          choices: tuple[str, ...] = (), low: float | None = None, high: float | None = None,
          optional: bool = False, launcher_only: bool = False) -> Any:
    return field(default=default, metadata={
        "help": help, "kind": kind, "per_request": per_request, "choices": choices, "low": low,
        "high": high, "optional": optional, "launcher_only": launcher_only,
    })


@dataclass(frozen=True)
class Knob:
    """One knob as the launcher, the environment and requests see it.

    Attributes:
        name: the ``ServingConfig`` field.
        kind: ``bool``, ``int``, ``float`` or ``str``.
        default: its default (None only when ``optional``).
        help: one or two sentences for ``--help`` and the README.
        per_request: a request may set it in ``custom_params``.
        choices: allowed values of a ``str`` knob (empty: any).
        low, high: inclusive bounds of a number (None: unbounded).
        optional: None is a value (given as an empty string in the environment).
        launcher_only: read by the launcher, never by a scheduler.
    """

    name: str
    kind: type
    default: Any
    help: str
    per_request: bool = False
    choices: tuple[str, ...] = ()
    low: float | None = None
    high: float | None = None
    optional: bool = False
    launcher_only: bool = False

    @property
    def flag(self) -> str:
        return "--kvcmas-" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "KVCMAS_" + self.name.upper()

    @property
    def request_field(self) -> str | None:
        return f"kvcmas_{self.name}" if self.per_request else None

    def parse(self, value: Any, where: str) -> Any:
        """A JSON value (a request field), checked strictly: no bool for a number, no float
        for an int, no NaN, nothing out of range.

        Raises:
            ConfigError: naming ``where``.
        """
        if isinstance(value, str) and (self.name, value) in REMOVED_CHOICES:
            raise ConfigError(f"{where}={value} is no longer served: "
                              f"{REMOVED_CHOICES[self.name, value]}")
        if value is None:
            if self.optional:
                return None
            raise ConfigError(f"{where} must be {self._expects()}, got null")
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                value = float(value)
                ok = math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            raise ConfigError(f"{where} must be {self._expects()}, got {_show(value)}")
        if self.choices and value not in self.choices:
            raise ConfigError(f"{where} must be one of {', '.join(self.choices)}, got "
                              f"{_show(value)}")
        if (self.low is not None and value < self.low) or (
                self.high is not None and value > self.high):
            raise ConfigError(f"{where} must be {self._expects()}, got {_show(value)}")
        return value

    def parse_text(self, text: str, where: str) -> Any:
        """A string from the environment or a flag.

        Raises:
            ConfigError: naming ``where``.
        """
        text = text.strip()
        if self.optional and not text:
            return None
        if self.kind is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ConfigError(f"{where} must be a boolean (1/0, true/false), got {text!r}")
        if self.kind in (int, float):
            try:
                value: Any = self.kind(text)
            except ValueError:
                raise ConfigError(f"{where} must be {self._expects()}, got {text!r}") from None
            return self.parse(value, where)
        return self.parse(text, where)

    def to_text(self, value: Any) -> str:
        if value is None:
            return ""
        if self.kind is bool:
            return "1" if value else "0"
        return str(value)

    def _expects(self) -> str:
        kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}[
            self.kind]
        if self.low is not None and self.high is not None:
            kind += f" in [{self.low:g}, {self.high:g}]"
        elif self.low is not None:
            kind += f" >= {self.low:g}"
        return kind + (" or null" if self.optional else "")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass(frozen=True)
class ServingConfig:
    """The serving knobs of one deployment (see the module docstring for how each is set)."""

    share_context: bool = _knob(
        False, "Let agents read each other's KV for their common transcript (one copy of it); "
        "off: the kvcmas tree cache behaves exactly like SGLang's RadixCache.", kind=bool)
    stock_cache: bool = _knob(
        False, "Serve with SGLang's default tree cache instead of ours (the baseline).",
        kind=bool, launcher_only=True)
    leaf_budget: float | None = _knob(
        None, "Most KV readers' leaves may hold (exact leaves' pool slots, and factored "
        "leaves' bytes in tokens of KV), as a fraction of the tokens the shared tree indexes "
        "(its one copy of the transcripts); past it, the least recently used leaves of either "
        "type are freed first, exact ones only on nodes no request reads (unset: exact leaves "
        "are bounded by the pool only).", kind=float, low=0, optional=True)
    budget_tokens: int | None = _knob(
        None, "Every workflow's budget in computed tokens (prefill + decode over the whole "
        "run) unless a request gives its own (kvcmas_budget_tokens); responses report the "
        "spend and forecast against it (unset: no budget).", kind=int, low=1, optional=True)
    budget_enforce: bool = _knob(
        False, "Refuse a workflow's further turns (400) once its budget is spent or even the "
        "low end of its spend forecast is past it (a request may set kvcmas_budget_enforce).",
        kind=bool)
    forecast_artifact: str | None = _knob(
        None, "The workflow spend forecaster's artifact (a JSON file written by "
        "benchmark/serving/forecast_bench.py --fit on your own recorded runs); unset: the one "
        "shipped for the served model when it is a known model with one, else the package's "
        "generic one.", kind=str, optional=True)
    recompute_boundary: int = _knob(
        16, "A reader recomputes the first N tokens of every span it borrows, in its own "
        "context and in the same forward pass (0: naive reuse).", kind=int, low=0,
        per_request=True)
    recompute_mass_fraction: float = _knob(
        0.1, "A reader also recomputes this share of its borrowed tokens: those with the "
        "largest attention mass on their owner's head (recorded in the owner's pass).",
        kind=float, low=0, high=1, per_request=True)
    recompute_tail: int = _knob(
        0, "A reader recomputes the last N foreign borrowed tokens before its own suffix.",
        kind=int, low=0, per_request=True)
    leaf_mode: str = _knob(
        "factored", "What a reader keeps of the borrowed tokens it recomputes: 'factored' "
        "(their deviation from the owner's KV as rank-r factors: host memory, up to "
        "head_dim / r times smaller than exact leaves less a basis per turn, read "
        "approximately; the recomputed slots freed right after the prefill) or 'exact' (exact "
        "leaves: pool slots, read exactly).",
        kind=str, choices=("exact", "factored"), per_request=True)
    leaf_rank: int = _knob(
        4, "Rank of a reader's factored leaves (leaf mode 'factored'), per layer and KV head.",
        kind=int, low=1, high=64, per_request=True)
    fidelity_share: float = _knob(
        0.02, "Share of reader turns the fidelity monitor checks against exact serving "
        "(their first tokens teacher-forced through an exact prefill of the prompt, after the "
        "response); readers recompute more, up to exact, in a namespace or agent whose top-1 "
        "agreement falls below the target (0: no monitor, no loop).",
        kind=float, low=0, high=1)
    lora_share: str = _knob(
        "separate", "LoRA agents (requests naming an adapter): 'separate' keeps each adapter's "
        "own cache of the transcript, as SGLang does; 'borrow' lets an adapter read the "
        "transcript another adapter computed, through the same read path as prompt agents, "
        "recomputing the first 8 tokens of every span and message and at least the last 32 "
        "(unless its request sets its own). Requests without an adapter never read an "
        "adapter's KV.",
        kind=str, choices=("separate", "borrow"))

    def __post_init__(self) -> None:
        for knob in KNOBS:  # defined below, before any instance exists
            knob.parse(getattr(self, knob.name), knob.name)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ServingConfig:
        """The knobs set in the environment (``KVCMAS_<NAME>``), defaults elsewhere.

        Raises:
            ConfigError: naming the variable.
        """
        environ = os.environ if environ is None else environ
        for name, why in REMOVED.items():
            env = "KVCMAS_" + name.upper()
            if env in environ:
                raise ConfigError(removed_message(env, why))
        values = {k.name: k.parse_text(environ[k.env], k.env) for k in KNOBS if k.env in environ}
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """Every scheduler-side knob as environment variables (what the launcher exports)."""
        return {k.env: k.to_text(getattr(self, k.name)) for k in KNOBS if not k.launcher_only}

    def with_values(self, **values: Any) -> ServingConfig:
        """A copy with some knobs changed (validated)."""
        return replace(self, **values)


KNOBS: tuple[Knob, ...] = tuple(
    Knob(f.name, default=f.default if f.default is not MISSING else None, **f.metadata)
    for f in fields(ServingConfig)
)
"""Every serving knob, in declaration order."""

BY_REQUEST_FIELD: dict[str, Knob] = {k.request_field: k for k in KNOBS if k.per_request}
"""``custom_params`` field -> knob, for the knobs a request may set."""
_BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}


_LOWRANK_GONE = ("low-rank corrections read worse than naive re-positioning; use 'factored' "
                 "(the default) or 'exact'")

REMOVED: dict[str, str] = {
    "cpu_threads": "set OMP_NUM_THREADS (the launcher uses one thread on CPU when it is unset)",
    "turn_order": "the leader rule always applies (kvcmas_exact serves a request exactly)",
    "turn_max_wait_s": "a fixed bound (policy/turn_order.py: MAX_WAIT_S)",
    "turn_min_gain": "a fixed minimum (policy/turn_order.py: MIN_GAIN)",
    "min_borrowed": "a fixed minimum (policy/recompute.py: MIN_BORROWED)",
    "cache_agent_outputs": "an agent's outputs enter the cache through the shared transcript",
    "recompute_mass_max_tokens": "bound reader leaves with --kvcmas-leaf-budget",
    "recompute_segment_share": "a fixed share (policy/recompute.py: SEGMENT_SHARE)",
    "recompute_max_fraction": "a fixed cap (policy/recompute.py: MAX_FRACTION), lifted for a "
                              "request asking a larger kvcmas_recompute_mass_fraction",
    "recompute_batch_tokens": "bound reader leaves with --kvcmas-leaf-budget",
    "leaf_mass_fraction": "a reader keeps what it recomputes; bound it with --kvcmas-leaf-budget",
    "factored_reread": "decided per reader (integration/shared_tree_cache.py: _rereads)",
    "allow_sgl_kernel_standin": "the raising sgl_kernel stand-in serves only where no real "
                                "sgl_kernel is installed",
    "lora_centroid_ahead": "the centroid no longer prefills a streamed answer ahead of the next "
    "turn (it lengthened the makespan); each turn's centroid prefill computes the answers "
    "before it",
    "lora_centroid_handoff": "an adapter request under lora_share 'rebase' always goes to the "
    "scheduler once the centroid's response is back (the former 'response')",
    "lora_leaves": "a reader with an adapter always keeps the borrowed tokens it recomputes as "
    "leaves of the leaf mode (the former 'keep'); a request may still set kvcmas_read_leaves",
    "lora_recompute_boundary_at": "a reader with an adapter always takes its boundary tokens at "
    "every message the chat template closes inside a borrowed span, and at every span (the "
    "former 'message'; without a detected chat template, at every span)",
    "lora_recompute_tail": "a reader with an adapter recomputes at least the last 32 borrowed "
    "tokens (policy/lora_share.py LORA_RECOMPUTE_TAIL); a request sets its own with "
    "kvcmas_recompute_tail",
    "lora_recompute_boundary": "a reader with an adapter recomputes the first 8 tokens of every "
    "span and message it borrows (policy/lora_share.py LORA_RECOMPUTE_BOUNDARY); a request sets "
    "its own with kvcmas_recompute_boundary",
    "lora_recompute_mass_fraction": "a reader with an adapter recomputes no share by head mass "
    "(policy/lora_share.py LORA_RECOMPUTE_MASS_FRACTION); a request sets its own with "
    "kvcmas_recompute_mass_fraction",
    "cpu_lora_ops": "LoRA deltas without an accelerator always run grouped by adapter "
    "(lora/grouped_ops.py); benchmark/kernels/cpu_lora_bench.py times SGLang's own ops against "
    "them",
    "lowrank_rank": "renamed --kvcmas-leaf-rank (KVCMAS_LEAF_RANK, custom_params.kvcmas_leaf_rank)",
    "cache_dir": "converted models are kept under $XDG_CACHE_HOME/sglang-kvcmas (default "
                 "~/.cache/sglang-kvcmas)",
    "lowrank_chain": "it tuned leaf mode 'lowrank+exact', gone too: " + _LOWRANK_GONE,
}
"""Knobs once served and no longer: name -> what replaced it. Their flag, variable and request
field fail with that message (:func:`removed_message`) instead of being ignored."""

_LORA_GONE = ("use 'borrow' (an adapter reads the transcript another computed, bounded by the "
              "fidelity monitor) or 'separate' (the default: each adapter's own exact cache)")

REMOVED_CHOICES: dict[tuple[str, str], str] = {
    ("lora_share", "catchup"): "it was exact as 'separate' is, with a longer makespan; "
                               + _LORA_GONE,
    ("lora_share", "rebase"): "its centroid prefill sat on every turn's critical path, slower "
                              "than 'borrow'; " + _LORA_GONE,
    ("leaf_mode", "lowrank"): _LOWRANK_GONE,
    ("leaf_mode", "lowrank+exact"): _LOWRANK_GONE,
}
"""Values of a served knob that are no longer served: (knob name, value) -> what replaced it."""


def removed_message(where: str, why: str) -> str:
    """The error for a removed knob given as ``where`` (its flag, variable or request field)."""
    return f"{where} is no longer served: {why}"


def knob(name: str) -> Knob:
    return _BY_NAME[name]


def resolve(flags: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> ServingConfig:
    """The deployment's config: a flag given on the command line wins over its environment
    variable, which wins over the default.

    Args:
        flags: knob name -> value the command line gave (a string, or True for a switch);
            knobs not given are absent.
    Raises:
        ConfigError: naming the flag or variable.
    """
    for name, why in REMOVED.items():
        if name in flags:
            raise ConfigError(removed_message("--kvcmas-" + name.replace("_", "-"), why))
    base = ServingConfig.from_env(environ)
    values = {}
    for k in KNOBS:
        if k.name in flags:
            given = flags[k.name]
            values[k.name] = given if isinstance(given, bool) and k.kind is bool else \
                k.parse_text(str(given), k.flag)
    return replace(base, **values)
