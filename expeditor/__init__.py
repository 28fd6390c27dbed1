"""expeditor's public API, and what sits on top of the services (the ``expeditor``
command line, the bench harness, the HTTP gateway and the in-process engine)::

    from expeditor import LLM, SamplingParams, Client, AsyncClient

``LLM`` (:mod:`expeditor.llm`) runs the scheduler core and one model runner in this
process; ``Client`` (:mod:`ipc.client`) and ``AsyncClient`` (:mod:`ipc.async_client`)
talk to a running scheduler daemon; ``SamplingParams`` (:mod:`shared.sampling`) is what
both take. ``LLM`` is imported on first use, so ``import expeditor`` (and the command
line) does not load torch.

Nothing below this package (``shared``, ``ipc``, ``scheduler_svc``, ``gpu_worker``)
imports it; see the dependency rules in docs/architecture.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ipc.async_client import AsyncClient
from ipc.client import Client
from shared.sampling import SamplingParams

if TYPE_CHECKING:
    from expeditor.llm import LLM

__all__ = ["LLM", "AsyncClient", "Client", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from expeditor.llm import LLM

        return LLM
    raise AttributeError(f"module 'expeditor' has no attribute {name!r}")
