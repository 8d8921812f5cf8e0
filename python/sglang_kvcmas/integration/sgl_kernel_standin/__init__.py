"""Directory holding the raising ``sgl_kernel`` stand-in, put on ``sys.path`` so that ``import
sgl_kernel`` finds it, only where no real ``sgl_kernel`` is installed (``cpu_runtime.py``).
"""
