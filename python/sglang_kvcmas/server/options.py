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

from sglang_kvcmas import envs

DEFAULT_RADIX_CACHE_BACKEND = "kvcmas"
SHARED_ATTENTION_BACKEND = "kvcmas_delta"
"""The attention backend that reads borrowed KV re-positioned (needed with sharing on)."""
DEFAULT_CPU_THREADS = 1
"""OpenMP threads for the server on CPU when ``OMP_NUM_THREADS`` is unset.

Measured on a shared 2-core machine (benchmark/serving/throughput.py, SmolLM2 fp32, 1000-token
prefill / 64-token decode): 1 thread 277 / 12.6 tok/s, 2 threads 103 / 1.8 tok/s. Two OpenMP
threads spin-wait on each other whenever another process holds a core, so one thread is the
robust default; on dedicated cores pass ``--kvcmas-cpu-threads`` or set ``OMP_NUM_THREADS``.
"""


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
        stock_radix_cache: serve with SGLang's default tree cache instead of ``kvcmas``.
        cpu_threads: OMP_NUM_THREADS for the server when the environment does not set it.
        sglang_argv: every other argument, passed to SGLang.
        device: ``--device`` as given by the user, or None (our default: cpu).
        share_context: cross-agent sharing on (``--kvcmas-share-context``, or
            ``KVCMAS_SHARE_CONTEXT=1`` in the environment).
        turn_order: ``--kvcmas-turn-order`` (None: ``KVCMAS_TURN_ORDER``, default leader).
    """

    model: str | None
    stock_radix_cache: bool
    cpu_threads: int
    sglang_argv: tuple[str, ...]
    device: str | None
    share_context: bool = False
    turn_order: str | None = None

    def server_env(self) -> dict[str, str]:
        """Environment the server processes read our serving options from."""
        env = {envs.KVCMAS_SHARE_CONTEXT.name: "1" if self.share_context else "0"}
        if self.turn_order:
            env[envs.KVCMAS_TURN_ORDER.name] = self.turn_order
        return env

    @property
    def on_cpu(self) -> bool:
        return self.device in (None, "cpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sglang-kvcmas-server",
        add_help=False,  # --help falls through to SGLang's full help
        allow_abbrev=False,  # never swallow an abbreviated SGLang flag
    )
    parser.add_argument("--model-path", "--model", dest="model", default=None)
    parser.add_argument("--kvcmas-stock-cache", dest="stock_radix_cache", action="store_true")
    parser.add_argument("--kvcmas-cpu-threads", dest="cpu_threads", type=int,
                        default=DEFAULT_CPU_THREADS)
    parser.add_argument("--kvcmas-share-context", dest="share_context", action="store_true")
    parser.add_argument("--kvcmas-turn-order", dest="turn_order", choices=("leader", "fifo"),
                        default=None)
    return parser


def _device_of(argv: list[str]) -> str | None:
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    peek.add_argument("--device", default=None)
    known, _ = peek.parse_known_args(argv)
    return known.device


def parse_launcher_args(argv: list[str]) -> LauncherOptions:
    """Split ``argv`` into our options and SGLang's.

    Raises:
        SystemExit: (argparse) for a malformed value of one of our own flags.
    """
    known, rest = _parser().parse_known_args(argv)
    if known.cpu_threads < 1:
        raise SystemExit("sglang-kvcmas-server: error: --kvcmas-cpu-threads must be >= 1")
    share = known.share_context or envs.KVCMAS_SHARE_CONTEXT.get_bool()
    if share and known.stock_radix_cache:
        raise SystemExit("sglang-kvcmas-server: error: --kvcmas-share-context needs our tree "
                         "cache; drop --kvcmas-stock-cache")
    return LauncherOptions(
        model=known.model,
        stock_radix_cache=known.stock_radix_cache,
        cpu_threads=known.cpu_threads,
        sglang_argv=tuple(rest),
        device=_device_of(rest),
        share_context=share,
        turn_order=known.turn_order,
    )


def default_flags(options: LauncherOptions) -> tuple[DefaultFlag, ...]:
    """Our defaults for SGLang's options, for this launch."""
    flags = [
        DefaultFlag("device", ("--device", "cpu"), cpu_only=True),
        # fp16 (SGLang's CPU default cast) decodes ~10x slower than fp32 on these CPUs.
        DefaultFlag("dtype", ("--dtype", "float32"), cpu_only=True),
        # Sharing needs the backend that re-positions borrowed KV (it wraps torch_native).
        DefaultFlag("attention_backend", ("--attention-backend", SHARED_ATTENTION_BACKEND))
        if options.share_context
        else DefaultFlag("attention_backend", ("--attention-backend", "torch_native"),
                         cpu_only=True),
        # Without a bound SGLang sizes the KV pool from host RAM (15 GB seen).
        DefaultFlag("max_total_tokens", ("--max-total-tokens", "16384"), cpu_only=True),
        DefaultFlag("mem_fraction_static", ("--mem-fraction-static", "0.1"), cpu_only=True),
        DefaultFlag("enable_cache_report", ("--enable-cache-report",)),
    ]
    if importlib.util.find_spec("prometheus_client") is not None:
        flags.append(DefaultFlag("enable_metrics", ("--enable-metrics",)))
    if not options.stock_radix_cache:
        flags.append(
            DefaultFlag("radix_cache_backend", ("--radix-cache-backend", DEFAULT_RADIX_CACHE_BACKEND))
        )
    return tuple(f for f in flags if options.on_cpu or not f.cpu_only)


def build_sglang_argv(
    options: LauncherOptions, model_path: str, explicit_dests: set[str]
) -> list[str]:
    """SGLang's command line: the user's flags, the resolved model, then our unset defaults.

    Args:
        options: parsed launcher options.
        model_path: the resolved local model folder.
        explicit_dests: SGLang option dests the user set (see ``integration.serve``).
    """
    argv = [*options.sglang_argv, "--model-path", model_path]
    for flag in default_flags(options):
        if flag.dest not in explicit_dests:
            argv.extend(flag.tokens)
    return argv
