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


# The fields that take one of several forms, and what those are: pydantic reports each
# form's failure, under the form's name (its loc goes on with "str", "list[str]"...).
FORMS = {
    "prompt": "a string, a list of strings, a list of token ids (integers) or a list of "
              "lists of token ids",
    "stop": "a string or a list of strings",
    "guided_json": "a JSON schema: an object, or its JSON text",
    "structured_outputs.json": "a JSON schema: an object, or its JSON text",
    "messages.*.content": "a string or a list of text parts",
    "tool_choice": "'none', 'auto', 'required' or a function to call by name",
}


def from_validation_error(error: ValidationError) -> APIError:
    """The first problem pydantic found, as a 400 naming the field."""
    first = _within_forms(error.errors())
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


def _within_forms(errors: list) -> dict:
    """The first error, where it is about a field of several forms (FORMS): the error
    of the one form the value went furthest into (a list's item, an object's field),
    named without the form; else the forms the field takes."""
    first = errors[0]
    loc = first["loc"]
    for k in range(len(loc) - 1, 0, -1):
        key = ".".join("*" if isinstance(p, int) else str(p) for p in loc[:k])
        if key not in FORMS or not isinstance(loc[k], str):
            continue
        tries = [e for e in errors if e["loc"][:k] == loc[:k] and len(e["loc"]) > k]
        deepest = max(len(e["loc"]) for e in tries)
        furthest = [e for e in tries if len(e["loc"]) == deepest]
        # Of those, the value's own fault (out of bounds) over another form's type.
        furthest = [e for e in furthest if not e["type"].endswith("_type")] or furthest
        if deepest > k + 1 and len(furthest) == 1:
            return {**furthest[0], "loc": loc[:k] + furthest[0]["loc"][k + 1:]}
        return {"loc": loc[:k], "type": "forms", "msg": f"must be {FORMS[key]}"}
    return first
