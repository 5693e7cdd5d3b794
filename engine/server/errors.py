"""The error every rejected request becomes: an HTTP status and an OpenAI-style body."""

from __future__ import annotations

from models.errors import HearthError


class ServeError(HearthError):
    """`hearth serve` cannot start as asked (unsafe binding, port taken, bad option)."""


class APIError(HearthError):
    """A request the server answers with an error status instead of a completion.

    Args:
        status: HTTP status (4xx for the client's mistakes, 5xx for the server's).
        message: what was wrong and what to send instead.
        type: OpenAI error type ("invalid_request_error", "authentication_error", ...).
        param: the request field at fault, if one is.
        code: a short machine-readable code ("model_not_found", "context_length_exceeded", ...).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        """The JSON body OpenAI's API (and its clients) use for errors."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for a malformed or out-of-range request field."""
    return APIError(400, message, "invalid_request_error", param, code)
