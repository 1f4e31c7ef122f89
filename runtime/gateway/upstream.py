"""What every request handler shares: the gateway's view of the scheduler behind it.

``Gateway`` holds the one client, the served model's name, limits and reply markup, and
answers ``/health`` and the start-up question ("is the worker past loading the model?") from
the scheduler's status.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from runtime.client import Client, ServiceUnavailable
from runtime.gateway import convert
from runtime.gateway.errors import ApiError
from runtime.gateway.metrics import Metrics
from runtime.gateway.settings import GatewaySettings
from runtime.gateway.tokens import TokenText
from runtime.gateway.tool_calls import Markup, load_markup
from runtime.protocol.client import StatusReply

STATUS_TIMEOUT_S = 3.0
STARTUP_POLL_S = 0.5  # how long each start-up status query waits for the scheduler's first answer
STARTING = "the service is starting: the worker is still loading the model; retry shortly"


@dataclass
class Gateway:
    """Everything a request handler needs; ``client`` is set in the lifespan, ``limits`` once
    the scheduler first answers past its start-up (None before: the service is starting)."""

    settings: GatewaySettings
    model: str
    metrics: Metrics
    tokens: TokenText
    client: Client | None = None
    limits: convert.Limits | None = None
    created: int = 0
    _markup: Markup | None = None

    def markup(self) -> Markup:
        """The model's reply markup (thinking and tool-call markers), from its tokenizer on first use."""
        if self._markup is None:
            self._markup = load_markup(self.tokens.tokenizer)
        return self._markup

    async def ready_limits(self) -> convert.Limits:
        """The limits of the served model; ApiError 503 while the service is still starting.

        Before this process's start-up poll has seen the scheduler serve, the scheduler is
        asked once more now: with several gateway processes on one port, another may already
        have answered ``/health`` 200, and a client may rightly send its first request here."""
        if self.limits is None:
            await self.poll_scheduler()
        if self.limits is None:
            raise ApiError(503, STARTING, code="starting")
        return self.limits

    async def poll_scheduler(self) -> StatusReply | None:
        """One status query: take the model's limits if the scheduler is past its start-up
        (it answers "starting" until then); its status if it is, else None."""
        assert self.client is not None
        try:
            status = await self.client.status(timeout=STARTUP_POLL_S)
        except ServiceUnavailable:
            return None  # not listening yet
        if status.worker_state == "starting":
            return None
        if self.limits is None:
            self.limits, self.created = convert.Limits(status.max_context), int(time.time())
        return status

    async def status_or_none(self) -> StatusReply | None:
        """The scheduler's status, or None when it does not answer."""
        assert self.client is not None
        try:
            return await self.client.status(timeout=STATUS_TIMEOUT_S)
        except ServiceUnavailable:
            return None

    async def health(self) -> tuple[int, dict]:
        """``/health``'s status code and body, from one status query: 503 ``starting`` while
        the worker loads the model, 503 ``unavailable`` when the scheduler does not answer or
        its worker is not up, else 200."""
        if self.limits is None:  # the start-up poll's query also says whether the worker is up
            status = await self.poll_scheduler()
            if status is None:
                return 503, {"status": "starting", "scheduler": "starting"}
        else:
            status = await self.status_or_none()
        if status is None or status.worker_state != "up":
            return 503, {"status": "unavailable", "scheduler": "no answer" if status is None else status.worker_state}
        return 200, {"status": "ok"}

    async def wait_for_scheduler(self) -> None:
        """Ask for the scheduler's status until its worker is past its start-up."""
        while await self.poll_scheduler() is None:
            await asyncio.sleep(STARTUP_POLL_S)

    def check(self, model: str | None) -> None:
        if model and model != self.model:
            raise ApiError(404, f"the model {model!r} does not exist; this service serves {self.model!r}",
                           param="model", code="model_not_found")
