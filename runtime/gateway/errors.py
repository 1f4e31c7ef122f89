"""Errors in OpenAI's JSON shape, and the HTTP status for a scheduler's error message."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class ApiError(Exception):
    """A request the gateway answers with ``{"error": {...}}`` and ``status``."""

    def __init__(self, status: int, message: str, *, type_: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_ or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


# How the scheduler's messages for failures that are the service's, not the client's, begin
# (runtime/scheduler/server.py, core.py, step_results.py): prefix, status, code. Prefixes, so a
# validation message that quotes the client's text cannot pass for one of these.
_SERVICE_FAILURES = (
    ("overloaded", 429, "overloaded"),
    ("worker unavailable", 503, "unavailable"),
    ("the service is shutting down", 503, "unavailable"),
    ("the worker failed a step", 500, "worker_failed"),
    ("worker died", 500, "worker_failed"),
    ("worker disconnected", 500, "worker_failed"),
    ("worker stopped responding", 500, "worker_failed"),
    ("the grammar refused token", 500, "worker_failed"),
    ("internal error", 500, "internal_error"),
)


def from_scheduler(message: str) -> ApiError:
    """Map a failed request's error message to a status.

    429 when the waiting queue is full, 503 while no worker serves (restarting, shutting down),
    500 when the request failed in the worker or the scheduler; anything else is a validation
    error of the client's (400).
    """
    lowered = message.lower()
    for prefix, status, code in _SERVICE_FAILURES:
        if lowered.startswith(prefix):
            return ApiError(status, message, code=code)
    return ApiError(400, message)


def failure(exc: BaseException) -> ApiError:
    """The OpenAI error for an exception that ended a choice."""
    from runtime.client import RequestFailed, ServiceUnavailable

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestFailed):
        return from_scheduler(exc.result.error or "internal error: the request failed without a reason")
    if isinstance(exc, ServiceUnavailable):
        return ApiError(503, f"the scheduler does not answer: {exc}", code="unavailable")
    return ApiError(500, f"internal error: {exc!r}")
