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


def from_scheduler(message: str) -> ApiError:
    """Map a failed request's error message to a status: validation errors are the client's (400)."""
    lowered = message.lower()
    if lowered.startswith("overloaded"):
        return ApiError(429, message, code="overloaded")
    if "worker unavailable" in lowered or "no reply from" in lowered or "not taking requests" in lowered:
        return ApiError(503, message, code="unavailable")
    if "worker died" in lowered or "stopped responding" in lowered:
        return ApiError(500, message, code="worker_failed")
    return ApiError(400, message)


def failure(exc: BaseException) -> ApiError:
    """The OpenAI error for an exception that ended a choice."""
    from runtime.client import RequestFailed, ServiceUnavailable

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestFailed):
        return from_scheduler(exc.result.error or "the request failed")
    if isinstance(exc, ServiceUnavailable):
        return ApiError(503, f"the scheduler does not answer: {exc}", code="unavailable")
    return ApiError(500, f"internal error: {exc!r}")
