"""Command line of ``sglang-kvcmas-server``: our own flags, and SGLang flags with our defaults.

Pure argument handling (no SGLang import), so it is cheap to test and runs before anything
heavy: a bad model path must fail in a second, not after SGLang has started booting.

Every SGLang flag is accepted unchanged; the defaults below are added only for options the user
did not give (an explicit ``--dtype bfloat16`` wins over our ``float32``).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from sglang_kvcmas.config import KNOBS, REMOVED, ConfigError, ServingConfig, resolve
from sglang_kvcmas.server.memory import (
    MIN_FRACTION,
    footprint_of_folder,
    free_host_bytes,
    static_fraction,
)

PROG = "sglang-kvcmas-server"
CPU_MAX_TOTAL_TOKENS = 16384
"""Our CPU default KV pool (tokens): without a bound SGLang sizes it from host RAM."""
DEFAULT_RADIX_CACHE_BACKEND = "kvcmas"
SHARED_ATTENTION_BACKEND = "kvcmas_delta"
"""The attention backend that reads borrowed KV re-positioned on CPU (sharing on)."""
SHARED_GPU_BACKENDS = ("flashinfer", "triton")
"""SGLang's GPU attention backends that serve sharing (``integration/shared_backends.py``),
preferred first; ``torch_native`` and ours serve it too (on CPU)."""


def shared_attention_backend(on_cpu: bool) -> str:
    """Our default ``--attention-backend`` with sharing on: ours on CPU; on GPU FlashInfer when
    it is installed, else Triton."""
    if on_cpu:
        return SHARED_ATTENTION_BACKEND
    return "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"


UNSHARED_FEATURES = (
    ("--speculative-algorithm", True, (
        "speculative decoding's verify and draft passes read the KV without re-positioning "
        "borrowed keys")),
    ("--enable-two-batch-overlap", False, (
        "a batch split in two loses the rows that say which keys are borrowed")),
    ("--kv-cache-dtype", True, (
        "borrowed keys are re-positioned in the model's dtype, without a quantized cache's "
        "scales (only 'auto' is served)")),
)
"""SGLang features sharing does not serve: (flag, whether it takes a value, why); a refusal at
start names both. A value of ``auto`` is SGLang's default, so it is served."""


def check_sharing_flags(argv: list[str] | tuple[str, ...]) -> None:
    """With sharing on, every attention backend the user named must read borrowed KV, and no
    feature of :data:`UNSHARED_FEATURES` may be on.

    Raises:
        SystemExit: naming the flag, its value and why sharing cannot serve it.
    """
    served = (SHARED_ATTENTION_BACKEND, "torch_native", *SHARED_GPU_BACKENDS)
    for flag in ("--attention-backend", "--prefill-attention-backend",
                 "--decode-attention-backend"):
        value = _peek(argv, flag)
        if value is not None and value not in served:
            raise SystemExit(
                f"{PROG}: error: --kvcmas-share-context reads other agents' KV re-positioned, "
                f"which the attention backends {', '.join(served)} do; got {flag} {value}"
            )
    for flag, takes_value, why in UNSHARED_FEATURES:
        value = _peek(argv, flag) if takes_value else (flag if flag in argv else None)
        if value not in (None, "auto"):
            shown = f"{flag} {value}" if takes_value else flag
            raise SystemExit(f"{PROG}: error: --kvcmas-share-context does not serve {shown}: "
                             f"{why}")


@dataclass(frozen=True)
class DefaultFlag:
    """One SGLang option our launcher sets unless the user set it.

    Attributes:
        dest: SGLang's ``ServerArgs`` field (argparse dest), used to detect a user's own value.
        tokens: what we append to the command line, e.g. ``("--device", "cpu")``.
        cpu_only: applied only when serving on CPU.
    """

    dest: str
    tokens: tuple[str, ...]
    cpu_only: bool = False


@dataclass(frozen=True)
class LauncherOptions:
    """The launcher's reading of its command line.

    Attributes:
        model: the ``--model-path`` value as given (None: the embedded model); resolved later.
        config: every ``--kvcmas-*`` knob, from flags, then environment, then defaults.
        sglang_argv: every other argument, passed to SGLang.
        device: ``--device`` as given by the user, or None (our default: cpu).
    """

    model: str | None
    config: ServingConfig
    sglang_argv: tuple[str, ...]
    device: str | None

    @property
    def share_context(self) -> bool:
        return self.config.share_context

    def server_env(self) -> dict[str, str]:
        """Environment the server processes read the parsed knobs from (every one, so a
        scheduler never falls back to a default the launcher did not choose)."""
        return self.config.to_env()

    @property
    def on_cpu(self) -> bool:
        return self.device in (None, "cpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        add_help=False,  # --help falls through to SGLang's full help
        allow_abbrev=False,  # never swallow an abbreviated SGLang flag
    )
    parser.add_argument("--model-path", "--model", dest="model", default=None)
    for k in KNOBS:
        if k.kind is bool:
            parser.add_argument(k.flag, dest=k.name, action="store_true",
                                default=argparse.SUPPRESS)
        else:
            parser.add_argument(k.flag, dest=k.name, default=argparse.SUPPRESS)
    for name in REMOVED:  # parsed so that resolve() names what replaced them
        parser.add_argument("--kvcmas-" + name.replace("_", "-"), dest=name, nargs="?",
                            const=True, default=argparse.SUPPRESS)
    return parser


def knobs_help() -> str:
    """One line per ``--kvcmas-*`` flag: flag, environment variable, request field, default."""
    lines = []
    for k in KNOBS:
        field = f", custom_params.{k.request_field}" if k.per_request else ""
        lines.append(f"  {k.flag} ({k.env}{field}; default {k.to_text(k.default) or 'unset'}): "
                     f"{k.help}")
    return "\n".join(lines)


def _peek(argv: list[str] | tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``), or None."""
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument(flag, dest="value", default=None)
    known, _ = peek.parse_known_args(list(argv))
    return known.value


def cpu_mem_fraction(options: LauncherOptions, model_path: str) -> float:
    """Our CPU default ``--mem-fraction-static`` for this model and the pool asked for
    (``--max-total-tokens``, else ours), at the served ``--dtype`` (see ``server/memory.py``)."""
    tokens = _peek(options.sglang_argv, "--max-total-tokens")
    dtype = _peek(options.sglang_argv, "--dtype") or "float32"
    try:
        max_tokens = int(tokens) if tokens is not None else CPU_MAX_TOTAL_TOKENS
    except ValueError:
        return MIN_FRACTION  # SGLang's parser reports the bad value
    footprint = footprint_of_folder(Path(model_path), dtype)
    return static_fraction(footprint, max_tokens, free_host_bytes())


def parse_launcher_args(argv: list[str]) -> LauncherOptions:
    """Split ``argv`` into our options and SGLang's; every knob parsed and checked once.

    Raises:
        SystemExit: for a bad value of one of our flags or ``KVCMAS_*`` variables (the message
            names it), or flags that contradict each other.
    """
    known, rest = _parser().parse_known_args(argv)
    flags = vars(known)
    model = flags.pop("model")
    try:
        config = resolve(flags)
    except ConfigError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    if config.share_context and config.stock_cache:
        raise SystemExit(f"{PROG}: error: --kvcmas-share-context needs our tree cache; drop "
                         "--kvcmas-stock-cache")
    if config.share_context:
        check_sharing_flags(rest)
    return LauncherOptions(model=model, config=config, sglang_argv=tuple(rest),
                           device=_peek(rest, "--device"))


def default_flags(
    options: LauncherOptions, mem_fraction_static: float = MIN_FRACTION
) -> tuple[DefaultFlag, ...]:
    """Our defaults for SGLang's options, for this launch (``mem_fraction_static``: the CPU
    default of ``--mem-fraction-static``, see :func:`cpu_mem_fraction`)."""
    flags = [
        DefaultFlag("device", ("--device", "cpu"), cpu_only=True),
        # fp16 (SGLang's CPU default cast) decodes far slower than fp32 on CPUs.
        DefaultFlag("dtype", ("--dtype", "float32"), cpu_only=True),
        # Sharing needs a backend that re-positions borrowed KV: ours over torch_native on CPU,
        # SGLang's own GPU backends (made dispatchers with sharing on) elsewhere.
        DefaultFlag("attention_backend", ("--attention-backend", shared_attention_backend(
            options.on_cpu)))
        if options.share_context
        else DefaultFlag("attention_backend", ("--attention-backend", "torch_native"),
                         cpu_only=True),
        # Without a bound SGLang sizes the KV pool from host RAM.
        DefaultFlag("max_total_tokens", ("--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)),
                    cpu_only=True),
        # Sized from the model's weights and the pool (a fixed fraction fails larger models).
        DefaultFlag("mem_fraction_static", ("--mem-fraction-static", f"{mem_fraction_static:g}"),
                    cpu_only=True),
        # An idle scheduler otherwise polls for requests on one full core, for no lower latency.
        DefaultFlag("sleep_on_idle", ("--sleep-on-idle",), cpu_only=True),
        # SGLang's default LoRA backend is a GPU kernel; torch_native runs on CPU (cpu_lora).
        DefaultFlag("lora_backend", ("--lora-backend", "torch_native"), cpu_only=True),
        DefaultFlag("enable_cache_report", ("--enable-cache-report",)),
    ]
    if not options.on_cpu and _peek(options.sglang_argv, "--attention-backend") == \
            SHARED_ATTENTION_BACKEND:
        # Ours reads every batch eagerly (SGLang captures graphs for all but its torch ones).
        flags.append(DefaultFlag("disable_cuda_graph", ("--disable-cuda-graph",)))
    if importlib.util.find_spec("prometheus_client") is not None:
        flags.append(DefaultFlag("enable_metrics", ("--enable-metrics",)))
    if not options.config.stock_cache:
        flags.append(
            DefaultFlag("radix_cache_backend", ("--radix-cache-backend", DEFAULT_RADIX_CACHE_BACKEND))
        )
    return tuple(f for f in flags if options.on_cpu or not f.cpu_only)


def build_sglang_argv(
    options: LauncherOptions, model_path: str, explicit_dests: set[str]
) -> list[str]:
    """SGLang's command line: the user's flags, the resolved model folder, then our defaults
    for the options the user did not set (``explicit_dests``, see ``integration.serve``)."""
    argv = [*options.sglang_argv, "--model-path", model_path]
    fraction = (cpu_mem_fraction(options, model_path)
                if options.on_cpu and "mem_fraction_static" not in explicit_dests
                else MIN_FRACTION)
    for flag in default_flags(options, fraction):
        if flag.dest not in explicit_dests:
            argv.extend(flag.tokens)
    return argv
