"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, with the HTTP status.

Types follow OpenAI and llama.cpp: invalid_request_error 400, authentication_error 401,
not_found_error 404, request_too_large 413, rate_limit_error 429 (the queue is full),
server_error 500, unavailable_error 503 (loading, draining, or a peer rank is lost).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error", 500: "server_error",
         503: "unavailable_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | int | None = None,
                 **extra):
        self.status, self.message, self.param = status, message, param
        self.code = code if code is not None else status
        self.extra = extra
        super().__init__(message)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code, **self.extra}}

    def response(self, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, **extra) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param, **extra)


def unavailable(message: str) -> APIError:
    return APIError(503, message)
