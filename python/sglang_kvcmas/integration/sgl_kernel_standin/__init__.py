"""Directory holding the raising ``sgl_kernel`` stand-in (see ``integration/cpu_runtime.py``).

This package is never imported as ``sglang_kvcmas.integration.sgl_kernel_standin.sgl_kernel`` by
SGLang: :func:`sglang_kvcmas.integration.cpu_runtime.install_sgl_kernel_standin` puts this
directory on ``sys.path`` (and ``PYTHONPATH`` for child processes) so that ``import sgl_kernel``
finds the stand-in, and only when no real ``sgl_kernel`` is installed.
"""
