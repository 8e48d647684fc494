"""Typed serving errors; the HTTP layer maps each to one OpenAI-style error object and status."""

from __future__ import annotations

from phalanx.core.errors import PhalanxError


class ServeError(PhalanxError):
    """Root of expected serving errors."""

    status = 500
    code = "internal_error"
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class BadRequest(ServeError):
    status, code, kind = 400, "invalid_request", "invalid_request_error"


class UnknownModel(ServeError):
    status, code, kind = 404, "model_not_found", "invalid_request_error"


class Overloaded(ServeError):
    """The bounded waiting queue is full: the client should retry after a short wait (429)."""

    status, code, kind = 429, "overloaded", "rate_limit_error"


class Draining(ServeError):
    """The replica got SIGTERM: it finishes what it has and admits nothing new (the router retries elsewhere)."""

    status, code, kind = 503, "draining", "server_error"


class NoCheckpoint(ServeError):
    status, code, kind = 500, "no_checkpoint", "server_error"
