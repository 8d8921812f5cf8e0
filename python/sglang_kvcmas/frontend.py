"""Frontend helpers: an SGLang frontend backend whose every request names one workflow.

SGLang frontend programs (``sgl.function``) talk to a server through ``sgl.RuntimeEndpoint``,
which sends no headers and no ``custom_params``. :class:`KvcmasEndpoint` is that endpoint with
one extra argument per program run, ``workflow``: every request it sends (``gen``, streamed or
not, and ``select``'s scoring requests) carries ``custom_params.kvcmas_workflow``, so the server
counts the run in its per-workflow ledger (``GET /kvcmas/workflows/{workflow}``: tokens, KV
bytes, the spend forecast) and applies the workflow's budget. Other ``kvcmas_*`` request fields
(``custom``) ride along the same way::

    backend = KvcmasEndpoint("http://127.0.0.1:30000", workflow="debate-42")
    state = my_program.run(..., backend=backend)
    other_run = backend.for_workflow("debate-43")   # same server, no new connection check

Against a server without sglang-kvcmas the fields are ignored (SGLang passes ``custom_params``
to custom logit processors only).
"""

from __future__ import annotations

import copy
from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

WORKFLOW_FIELD = "kvcmas_workflow"


class _WithCustomParams:
    """A frontend ``SglSamplingParams`` whose server-side keyword arguments also carry
    ``custom_params`` (attribute reads and writes go to the wrapped object)."""

    def __init__(self, inner: Any, custom: dict[str, Any]) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_custom", custom)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)

    def to_srt_kwargs(self) -> dict[str, Any]:
        return {**self._inner.to_srt_kwargs(), "custom_params": dict(self._custom)}


class KvcmasEndpoint(RuntimeEndpoint):
    """``sgl.RuntimeEndpoint`` that names a workflow (and other ``kvcmas_*`` fields) on every
    request.

    Args:
        base_url, api_key, verify, chat_template_name: as for ``sgl.RuntimeEndpoint``.
        workflow: the program run's workflow id (None: requests name none).
        custom: other ``kvcmas_*`` request fields for every request (e.g.
            ``{"kvcmas_budget_tokens": 20000}``).

    Raises:
        ValueError: an empty workflow id, or a ``custom`` key that is not a ``kvcmas_*`` field.
    """

    def __init__(self, base_url: str, api_key: str | None = None, verify: str | None = None,
                 chat_template_name: str | None = None, *, workflow: str | None = None,
                 custom: dict[str, Any] | None = None) -> None:
        self.custom_params = self._checked(workflow, custom)
        super().__init__(base_url, api_key=api_key, verify=verify,
                         chat_template_name=chat_template_name)

    @staticmethod
    def _checked(workflow: str | None, custom: dict[str, Any] | None) -> dict[str, Any]:
        out = dict(custom or {})
        bad = sorted(k for k in out if not str(k).startswith("kvcmas_"))
        if bad:
            raise ValueError(f"custom holds non-kvcmas fields {bad}: only kvcmas_* request "
                             "fields go to the server this way")
        if workflow is not None:
            if not isinstance(workflow, str) or not workflow:
                raise ValueError(f"workflow must be a non-empty string, not {workflow!r}")
            out[WORKFLOW_FIELD] = workflow
        return out

    @property
    def workflow(self) -> str | None:
        return self.custom_params.get(WORKFLOW_FIELD)

    def for_workflow(self, workflow: str | None,
                     custom: dict[str, Any] | None = None) -> KvcmasEndpoint:
        """The same endpoint (same server, chat template, other fields unless ``custom`` is
        given) naming another workflow; no request is sent."""
        other = copy.copy(self)
        base = {k: v for k, v in self.custom_params.items() if k != WORKFLOW_FIELD}
        other.custom_params = self._checked(workflow, base if custom is None else custom)
        return other

    def generate(self, s: Any, sampling_params: Any) -> Any:
        return super().generate(s, self._wrap(sampling_params))

    def generate_stream(self, s: Any, sampling_params: Any) -> Any:
        return super().generate_stream(s, self._wrap(sampling_params))

    def _generate_http_request(self, s: Any, data: dict[str, Any]) -> Any:
        if self.custom_params:  # select's scoring requests build their own body
            params = data.setdefault("sampling_params", {})
            params["custom_params"] = {**(params.get("custom_params") or {}),
                                       **self.custom_params}
        return super()._generate_http_request(s, data)

    def _wrap(self, sampling_params: Any) -> Any:
        return _WithCustomParams(sampling_params, self.custom_params) if self.custom_params \
            else sampling_params
