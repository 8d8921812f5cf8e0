"""Order the tree cache's row writes after the forward batch still in flight.

Under SGLang's overlap scheduler on an accelerator, the scheduler processes batch N's results
while batch N+1, already launched, runs on the model runner's forward stream. N+1's Python (our
per-layer reads included) has run by then, in the same thread; its kernels may still be reading
a reader's row and the slots it points at. SGLang's write-after-read fence covers the batch's
metadata reads only, not ours during the layers. So before the tree cache re-points a factored
reader's row at its owners' slots and frees its recomputed ones (``shared_tree_cache``), it makes
the current stream wait for everything queued on the forward stream (:func:`fence`): the write,
and any later batch's use of the freed slots, then follow N+1 on the device. The host does not
wait.

Our attention backend registers the forward stream when it is built (:func:`register`); where
none is registered (unit tests, a backend of SGLang's own) :func:`fence` says it cannot, and the
row keeps its slots until the request is released.
"""

from __future__ import annotations

from typing import Any

_STREAMS: dict[str, Any] = {}
"""device type -> the model runner's forward stream (one model runner per scheduler process)."""


def register(model_runner: Any) -> None:
    """Keep ``model_runner.forward_stream`` (absent on CPU builds: nothing kept)."""
    stream = getattr(model_runner, "forward_stream", None)
    device = str(getattr(model_runner, "device", "cpu")).split(":")[0]
    if stream is not None and device != "cpu":
        _STREAMS[device] = stream


def fence(device: Any) -> bool:
    """Make ``device``'s current stream wait for its forward stream's queued work; False when
    no forward stream is known (the caller must then not write what the batch in flight
    reads)."""
    import torch

    kind = torch.device(device).type
    stream = _STREAMS.get(kind)
    if stream is None:
        return False
    torch.get_device_module(kind).current_stream().wait_stream(stream)
    return True
