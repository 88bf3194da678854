"""Errors shaped like OpenAI's: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Optional

import msgspec
from fastapi.responses import Response
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(msgspec.json.encode(self.body()), status_code=self.status,
                        media_type="application/json", headers=self.headers)


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "union[")))
    # pydantic prefixes what a validator raised with "Value error, ".
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = f"'{param}' is not a supported parameter"
    elif first["type"] == "missing":
        message = f"'{param}' is required"
    else:
        message = f"{param}: {message}" if param else message
    return APIError(400, message, param=param or None, code="invalid_value")
