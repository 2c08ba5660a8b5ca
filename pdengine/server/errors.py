"""HTTP error mapping: every error leaves the server as JSON
``{"error": {"message", "type", "param", "code"}}`` with a meaningful status.

`pdengine.types` errors carry their own ``http_status``; `APIError` covers what
only the HTTP layer can see (malformed JSON, a body over the limit, auth).
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from pdengine.types import PDEngineError

log = logging.getLogger(__name__)

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "request_aborted",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the HTTP layer raises itself; `param` names the offending field, if any."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "internal_error" if status >= 500 else "error"),
            "param": param,
            "code": status,
        }
    }


def error_from_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, body) for any exception; unexpected ones become a 500 without internals."""
    if isinstance(exc, APIError):
        return exc.status, error_body(exc.status, exc.message, exc.param)
    if isinstance(exc, PDEngineError):
        param = getattr(exc, "field", None)
        return exc.http_status, error_body(exc.http_status, str(exc), param)
    if isinstance(exc, ClientDisconnect):  # nobody is listening; nothing worth a traceback
        return 499, error_body(499, "client disconnected")
    if isinstance(exc, HTTPException):
        return exc.status_code, error_body(exc.status_code, str(exc.detail))
    log.exception("unexpected error while serving a request", exc_info=exc)
    return 500, error_body(500, f"internal error: {type(exc).__name__}")


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_from_exception(exc)
    return JSONResponse(body, status_code=status)


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


# Passed to `Starlette(exception_handlers=...)` by every app factory.
EXCEPTION_HANDLERS = {
    APIError: _handle,
    PDEngineError: _handle,
    HTTPException: _handle,
    ClientDisconnect: _handle,
    Exception: _handle,
}
