"""``python -m sglang_kvcmas.launch_server`` / ``sglang-kvcmas-server``: SGLang's HTTP server with
sglang-kvcmas loaded and CPU-friendly defaults.

Same routes as ``python -m sglang.launch_server`` (``/generate``, OpenAI ``/v1/*``, ``/metrics``,
``/server_info``, ...) and every SGLang flag. What we add, each overridable by giving the flag:

- ``--model-path`` defaults to the embedded SmolLM2-135M-Instruct; also accepts ``embedded``, a
  Hugging Face folder, or a ``.gguf`` file (see ``sglang_kvcmas.models.resolve``). A bad path
  fails before SGLang boots, with exit status 2; so does an adapter of ``--lora-paths`` that
  does not fit the model (``models/adapter_check.py``).
- On CPU (no ``--device`` or ``--device cpu``): ``--device cpu --dtype float32
  --attention-backend torch_native --max-total-tokens 16384 --mem-fraction-static`` (sized from
  the model), ``--sleep-on-idle`` (an idle scheduler would poll on a full core),
  ``--lora-backend torch_native`` (used only with ``--enable-lora``),
  ``SGLANG_USE_CPU_ENGINE=1`` and, only if no real ``sgl_kernel`` is installed, our raising
  ``sgl_kernel`` stand-in; ``OMP_NUM_THREADS=1`` unless the environment sets it (one thread is
  robust on a shared machine: two spin-wait on each other when another process holds a core).
- Always: ``--enable-cache-report``, ``--enable-metrics`` (when prometheus_client is installed),
  and ``--radix-cache-backend kvcmas`` (our tree cache). ``--kvcmas-stock-cache`` leaves the
  backend unset, i.e. SGLang's default tree cache (``UnifiedRadixCache``), for baselines.
- ``--kvcmas-share-context`` (opt-in, per deployment): agents read each other's KV for their
  common transcript (the agent head, i.e. the system turn, stays per agent; never across
  ``cache_salt``); implies ``--attention-backend kvcmas_delta``. Every ``--kvcmas-*`` knob (listed
  by ``--help``, defined once in ``sglang_kvcmas/config.py``) can also be set by its ``KVCMAS_*``
  environment variable; the flag wins. A bad value fails here, before SGLang boots.
- The workflow spend forecaster: ``--kvcmas-forecast-artifact`` if given, else the artifact
  shipped for the served model (a known short name), else the generic one; one that does not
  load fails here (exit status 2).

The tree cache actually built is reported in the server log ("sglang-kvcmas: tree cache ... in
use") and in ``/server_info`` → ``internal_states[i].kvcmas.tree_cache_class``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from sglang_kvcmas.config import knob
from sglang_kvcmas.models.adapter_check import AdapterError
from sglang_kvcmas.models.registry import known_model
from sglang_kvcmas.models.resolve import ModelPathError, resolve_model_path
from sglang_kvcmas.policy import spend_forecast
from sglang_kvcmas.policy.spend_forecast import ForecastArtifactError
from sglang_kvcmas.server.lora_args import check_lora_paths
from sglang_kvcmas.server.options import build_sglang_argv, knobs_help, parse_launcher_args

EXIT_BAD_MODEL = 2


def forecast_artifact(options: Any) -> Path:
    """The spend forecaster's artifact the server loads: the one given, else the one shipped for
    the served model (a known short name), else the generic one; checked here.

    Raises:
        ForecastArtifactError: it does not load.
    """
    given = options.config.forecast_artifact
    known = known_model(options.model)
    path = Path(given).expanduser() if given else spend_forecast.artifact_for(
        known.name if known is not None else None)
    spend_forecast.load(path)
    return path.resolve()


CPU_THREADS = 1
"""OpenMP threads of a CPU server when ``OMP_NUM_THREADS`` is unset."""


def main(argv: list[str] | None = None) -> int:
    """Run the server; returns (or exits with) a non-zero status on a bad model path."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        # Our additions first; SGLang's parser then prints every SGLang flag and exits.
        print(__doc__, "\nOur knobs:\n" + knobs_help(), "\n\nSGLang's own flags follow.\n",
              flush=True)
    options = parse_launcher_args(argv)
    try:
        model_path = resolve_model_path(options.model)
    except ModelPathError as e:
        print(f"sglang-kvcmas-server: error: bad --model-path: {e}", file=sys.stderr)
        return EXIT_BAD_MODEL
    try:
        check_lora_paths(options.sglang_argv, model_path)
    except AdapterError as e:
        print(f"sglang-kvcmas-server: error: {e}", file=sys.stderr)
        return EXIT_BAD_MODEL

    try:
        forecaster = forecast_artifact(options)
    except ForecastArtifactError as e:
        print(f"sglang-kvcmas-server: error: bad --kvcmas-forecast-artifact: {e}",
              file=sys.stderr)
        return EXIT_BAD_MODEL

    os.environ.update(options.server_env())  # server processes inherit our serving options
    os.environ[knob("forecast_artifact").env] = str(forecaster)
    if options.on_cpu:
        # Threads are read once by the OpenMP runtime: set them before torch is imported.
        os.environ.setdefault("OMP_NUM_THREADS", str(CPU_THREADS))
        from sglang_kvcmas.integration.cpu_runtime import prepare_cpu_server_process

        kernel = prepare_cpu_server_process()
    from sglang_kvcmas.integration.serve import explicit_dests, serve

    sglang_argv = build_sglang_argv(options, str(model_path),
                                    explicit_dests(list(options.sglang_argv)))
    cpu_note = (f"\n[sglang-kvcmas] sgl_kernel: {kernel.source} ({kernel.location}); "
                f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}" if options.on_cpu else "")
    print("[sglang-kvcmas] launching SGLang: " + shlex.join(sglang_argv) + cpu_note,
          file=sys.stderr, flush=True)
    serve(sglang_argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
