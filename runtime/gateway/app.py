"""The FastAPI app: OpenAI's /v1/models, /v1/completions, /v1/chat/completions (and /v1/responses,
``responses.py``), plus /health, /metrics.

One long-lived ``runtime.client.Client`` per process, opened in the lifespan. Requests
become client streams (``fanout.py``); the scheduler applies chat templates and checks
every sampling parameter, and its refusals come back as OpenAI errors (``errors.py``).

The gateway starts with the service, before the worker has loaded the model (minutes on a
GPU's first start): until the scheduler first answers, ``/health`` says ``starting`` (503) at
once and the API answers 503 ``starting`` too, so no probe or request waits in the socket's
backlog for the model to load.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.client import Client, GenerationResult
from runtime.gateway import convert, sse
from runtime.gateway.chat import ChatReplies, open_think_end
from runtime.gateway.errors import ApiError
from runtime.gateway.fanout import Fanout, first_event, results_of
from runtime.gateway.metrics import Metrics
from runtime.gateway.openai_types import ChatCompletionRequest, CompletionRequest
from runtime.gateway.responses import add_responses_route
from runtime.gateway.settings import GatewaySettings
from runtime.gateway.streaming import (
    ChoiceBody,
    FanoutResponse,
    LogprobsFormat,
    stream_events,
)
from runtime.gateway.tokens import TokenText
from runtime.gateway.tool_choice import plan_tools
from runtime.gateway.upstream import Gateway

def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def create_app(settings: GatewaySettings) -> FastAPI:
    """The app for one gateway process."""
    model = settings.served_model_name or Path(settings.model_path).name
    gw = Gateway(settings, model, Metrics(model, settings.metrics_dir), TokenText(settings.model_path))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with Client(settings.scheduler_address, server_key=settings.server_key) as client:
            gw.client = client
            waiting = asyncio.create_task(gw.wait_for_scheduler())
            try:
                yield
            finally:
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
                gw.client = None

    app = FastAPI(title="runtime", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return ApiError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, str(exc.detail)).response()

    async def authorized(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.strip(), k) for k in settings.api_keys):
            raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        code, body = await gw.health()
        return JSONResponse(body, status_code=code)

    @app.get("/metrics")
    async def metrics() -> Response:
        status = await gw.status_or_none() if gw.limits is not None else None
        return Response(gw.metrics.render(status), media_type=CONTENT_TYPE_LATEST)

    async def model_card() -> dict:
        limits = await gw.ready_limits()
        return {"id": gw.model, "object": "model", "created": gw.created, "owned_by": "runtime",
                "root": settings.model_path, "max_model_len": limits.max_context}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [await model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str) -> dict:
        gw.check(model_id or "?")
        return await model_card()

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest) -> Response:
        gw.check(body.model)
        requests = convert.completion_requests(body, await gw.ready_limits())
        envelope = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                    "model": gw.model}

        def logprobs(entries, offset: int = 0):
            return convert.completion_logprobs(entries, gw.tokens, offset)

        # echo: a choice's text starts with its prompt's (streamed: in its first chunk)
        echoes = [t for t in convert.echo_texts(body, gw.tokens) for _ in range(body.n)] if body.echo else []
        echoed: set[int] = set()

        def choice(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
            if echoes and index not in echoed:
                echoed.add(index)
                text = echoes[index] + text
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        def choices(index: int, text: str, lp: dict | None, finish: str | None) -> list[dict]:
            return [choice(index, text, lp, finish)]

        per_prompt = convert.best_of(body)

        def whole_logprobs(r: GenerationResult) -> dict | None:
            return convert.echo_logprobs(r, gw.tokens) if body.echo else logprobs(r.logprobs)

        def whole(results: list[GenerationResult]) -> dict:
            if body.max_tokens == 0:
                results = [convert.prompt_only(r) for r in results]
            picked = results if per_prompt == body.n else convert.pick_best(results, per_prompt, body.n,
                                                                            body.logprobs is not None)
            return envelope | {
                "choices": [choice(i, r.text, whole_logprobs(r), convert.finish_reason(r)) for i, r in enumerate(picked)],
                "usage": convert.usage(results, per_prompt),  # every candidate's tokens count, as OpenAI bills them
            }

        return await _respond(gw, body.stream, body.include_usage, requests, body.n, envelope, choices, logprobs,
                              whole)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest) -> Response:
        gw.check(body.model)
        limits = await gw.ready_limits()
        markup = gw.markup()
        tools = plan_tools(body.tools, body.tool_choice, markup.tools)
        requests = convert.chat_requests(body, limits, tools)
        envelope = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": gw.model}
        think_end = open_think_end(markup, gw.tokens.tokenizer, body.messages, tools.tools, body.chat_template_kwargs)
        replies = ChatReplies(markup, len(requests), tools.tools, think_end)

        def logprobs(entries, offset: int = 0):
            return convert.chat_logprobs(entries, gw.tokens)

        def choices(index: int, text: str, lp: dict | None, finish: str | None) -> list[dict]:
            deltas = replies.deltas(index, text, finish) or ([{}] if lp is not None else [])
            bodies = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            if bodies:  # logprobs with the first, the finish reason with the last
                bodies[0]["logprobs"] = lp
                bodies[-1]["finish_reason"] = None if finish is None else replies.finish_reason(index, finish)
            return bodies

        def whole(results: list[GenerationResult]) -> dict:
            out = []
            for i, r in enumerate(results):
                message, reason = replies.message(i, r, convert.finish_reason(r))
                out.append({"index": i, "message": message, "logprobs": logprobs(r.logprobs), "finish_reason": reason})
            return envelope | {"object": "chat.completion", "choices": out, "usage": convert.usage(results, len(results))}

        opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(len(requests))]
        return await _respond(gw, body.stream, body.include_usage, requests, len(requests), envelope, choices,
                              logprobs, whole, opening)

    add_responses_route(app, gw, authorized)
    return app


async def _respond(gw: Gateway, stream: bool, include_usage: bool, requests: list[dict], per_prompt: int,
                   envelope: dict, choice: ChoiceBody, logprobs: LogprobsFormat,
                   whole: Callable[[list[GenerationResult]], dict], opening: Sequence[dict] = ()) -> Response:
    """Run the choices; a whole JSON response, or SSE once the first event shows the request was accepted."""
    assert gw.client is not None
    fanout = Fanout(gw.client, requests, gw.metrics)
    if not stream:
        return JSONResponse(whole(await results_of(fanout)))
    first = await first_event(fanout)
    events = stream_events(first, fanout, count=len(requests), per_prompt=per_prompt,
                           frames=sse.ChunkFrames(envelope, include_usage), choice_body=choice,
                           logprobs_format=logprobs, include_usage=include_usage, opening=opening)
    return FanoutResponse(events, fanout)
