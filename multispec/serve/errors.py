"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, for every refusal.

Clients (the official ``openai`` package, evaluation harnesses) read ``param`` to tell which
field was wrong, so each error names the request field it is about, whichever layer found it:
pydantic (a wrong type), the server (a limit) or ``SamplingParams`` / ``SpecConfig`` / the engine
(a bad value, whose ``ValueError`` names the field as ``field=value: why``).
"""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from multispec.async_llm import EngineDeadError


class APIError(Exception):
    """A refusal with its HTTP status, the field it is about (``param``) and a short ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(param: str | None, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


_FIELD = re.compile(r"^(\w+)(?:\.\w+)*(?:=|: )")


def from_value_error(error: ValueError, params: dict[str, str], prompt_param: str) -> APIError:
    """A 400 for a ``ValueError`` from the sampling or speculation settings or the engine's checks.

    ``params`` maps the field names those messages start with (``max_tokens=...``) to the request
    field that set them; a message about no field is about the prompt (its length, its ids), or,
    for the KV cache check, about the number of tokens asked for."""
    message = str(error)
    match = _FIELD.match(message)
    if match:
        return invalid(params.get(match.group(1), match.group(1)), message)
    if "KV cache" in message:
        return invalid(params.get("max_tokens", "max_tokens"), message)
    return invalid(prompt_param, message)


def from_validation_error(error: RequestValidationError) -> APIError:
    """A 400 (never FastAPI's 422 with pydantic's details) naming the top-level field at fault."""
    first = error.errors()[0]
    location = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return invalid(None, f"the request body is not valid JSON: {first.get('msg', '')}")
    if not location:
        return invalid(None, f"the request body must be a JSON object: {first.get('msg', '')}")
    param = str(location[0])
    where = param + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in location[1:])
    return invalid(param, f"{where}: {first.get('msg', 'invalid value')}")


def from_exception(error: BaseException) -> APIError:
    """What a request that failed while it ran reports (in a response or as a stream's error chunk)."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), code="engine_dead")
    return APIError(500, f"{type(error).__name__}: {error}", code="internal_error")
