"""OpenAI's error body and the one place where exceptions become HTTP statuses.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Classification at the boundary: a bad value is the request's fault (400, only that request fails);
an overloaded, loading or broken engine is the service's state (503 with Retry-After: try again);
a timeout is 408; anything else is a server bug (500, logged with its traceback).
"""

from __future__ import annotations

import logging
import re

from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          415: "invalid_request_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    """An error answer: raised anywhere in the router, or sent by the middleware (it is an ASGI app)."""

    def __init__(self, status: int, message: str, type: str | None = None, param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after = retry_after

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(error_body(self), status_code=self.status, headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        await self.response()(scope, receive, send)


def error_body(error: APIError) -> dict:
    return {"error": {"message": error.message, "type": error.type, "param": error.param, "code": error.code}}


def error_from_exception(exc: BaseException, retry_after: int = 1) -> APIError:
    """Map what a request can fail with to its OpenAI error."""
    from ray import exceptions as ray_exceptions
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    from actors.coordinator import TargetShardError

    if isinstance(exc, APIError):
        return exc
    cause = _cause(exc)
    if isinstance(cause, BackPressureError):
        return APIError(503, "the server is overloaded (all replicas busy and their queues full); retry later",
                        code="overloaded", retry_after=retry_after)
    if isinstance(cause, TargetShardError):
        return APIError(503, str(cause), code="engine_unavailable", retry_after=retry_after)
    if isinstance(cause, (DeploymentUnavailableError, ray_exceptions.RayActorError)):
        return APIError(503, f"the model replica is unavailable ({cause.__class__.__name__}); retry later",
                        code="engine_unavailable", retry_after=retry_after)
    if isinstance(cause, TimeoutError):
        return APIError(408, "the request ran past this server's request timeout and was cancelled",
                        type="timeout_error", code="request_timeout")
    if isinstance(cause, ValueError):
        message = str(cause)
        return APIError(400, message, param=_param_of(message))
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal error ({cause.__class__.__name__}): {_first_line(cause)}")


def validation_error(errors: list[dict]) -> APIError:
    """pydantic/FastAPI validation errors -> one 400 naming the first offending parameter."""
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    if first.get("type") == "missing" and not loc:
        return APIError(400, "request body is required (a JSON object)")
    if first.get("type") == "model_attributes_type" or (first.get("type") == "dict_type" and not loc):
        return APIError(400, "request body must be a JSON object")
    param = _dotted(loc)
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unknown parameter '{param}'", param=param)
    if first.get("type") == "value_error" and msg.startswith(f"'{loc[-1] if loc else ''}' is not supported"):
        return APIError(400, msg, param=param, code="unsupported_parameter")
    if not param:  # a model-level check: "name: why"
        head = msg.split(":", 1)[0]
        param = head if re.fullmatch(r"[a-z_][a-z0-9_.]*", head) else None
        return APIError(400, msg, param=param)
    # A union reports one error per alternative: say them together.
    same = [e.get("msg", "").removeprefix("Value error, ") for e in errors if _dotted(
        [p for p in e.get("loc", ()) if p != "body"]) == param]
    alternatives = " or ".join(dict.fromkeys(same))
    return APIError(400, f"{param}: {alternatives}; got {first.get('input')!r:.100}", param=param)


def _dotted(loc) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union branch tags (str, list[int], ...) dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) and part not in _BRANCH_TAGS:
            out += ("." if out else "") + part
    return out


_BRANCH_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart"}


def _param_of(message: str) -> str | None:
    if message.startswith(("structured output", "cannot compile the")):
        return "response_format"
    for name in ("min_tokens", "stop_token_ids", "tools", "logit_bias", "logprobs", "max_tokens", "temperature", "top_p", "top_k", "prompt", "messages", "seed",
                 "stop"):
        if name in message:
            return name
    return None


def _cause(exc: BaseException) -> BaseException:
    """The user-level exception inside Ray's wrappers (a RayTaskError carries the original)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else ""
