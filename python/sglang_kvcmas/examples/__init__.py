"""Runnable multi-agent workflows, written as SGLang frontend programs (``sgl.function``)."""
