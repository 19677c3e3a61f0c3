"""What stands between the network and the router's routes: the request guard (ASGI middleware: the
API key, the body-size limit, a body that must be JSON), and the handlers that answer FastAPI's and
Starlette's own errors with OpenAI's error body (`deployments/errors.py`).

    guard(app, api_key="sk-...", max_bytes=4 * 1024 * 1024)   # called by `OpenAIRouter.build_app`

401 for a missing or wrong key (every route but /health, compared in constant time), 413 for a body
over the limit (declared or read), 415 for a body that is not JSON by its Content-Type, 400 for a
body that is not UTF-8 JSON or that FastAPI's validation refuses (never 422), 404 and 405 for an
unknown route or method. All of it is decided before a route reads the body.
"""

from __future__ import annotations

import hmac
import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.errors import APIError, validation_error


def guard(app: FastAPI, api_key: str | None, max_bytes: int) -> None:
    """Answer every error of `app` with OpenAI's body, and check each request with `RequestGuard`."""
    app.openapi = _without_422(app.openapi)
    app.add_exception_handler(RequestValidationError, lambda request, exc: validation_error(exc.errors()).response())
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_middleware(RequestGuard, api_key=api_key, max_bytes=max_bytes)


class RequestGuard:
    """ASGI middleware: the API key (every route but /health) and the body-size limit, checked
    before anything reads the body. Keys are compared in constant time."""

    def __init__(self, app, api_key: str | None, max_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        path = scope.get("path", "")
        if self.api_key is not None and not path.endswith("/health"):
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                message = ("missing API key: send 'Authorization: Bearer <key>'" if not given else
                           "malformed Authorization header: send 'Authorization: Bearer <key>'"
                           if scheme.lower() != b"bearer" else "incorrect API key")
                return await APIError(401, message, code="invalid_api_key")(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _too_large(self.max_bytes)(scope, receive, send)
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        # Read the body here (it is small by then), so a body without Content-Length is bounded too.
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await _too_large(self.max_bytes)(scope, receive, send)
        problem = _body_problem(headers.get(b"content-type"), body)
        if problem is not None:
            return await problem(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        await self.app(scope, replay, send)


def _body_problem(content_type: bytes | None, body: bytes) -> APIError | None:
    """What is wrong with a request body before FastAPI sees it: not JSON by its Content-Type (415),
    not UTF-8, not JSON, nested deeper than the parser goes, or holding text that is not Unicode (a
    lone surrogate escape). An absent Content-Type is read as JSON, as FastAPI does."""
    if not body:
        return None
    media = (content_type or b"").split(b";")[0].strip().lower()
    if media and media != b"application/json" and not media.endswith(b"+json"):
        return APIError(415, f"unsupported Content-Type {media.decode('latin-1')!r}: send the body as JSON with "
                             "'Content-Type: application/json'", code="unsupported_media_type")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return APIError(400, f"request body is not valid UTF-8 (byte {body[e.start]:#04x} at offset {e.start})",
                        code="invalid_json")
    try:
        parsed = json.loads(text)
    except RecursionError:
        return APIError(400, "request body is nested too deeply to parse", code="invalid_json")
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        return APIError(400, f"request body is not valid JSON: {e}", code="invalid_json")
    try:
        json.dumps(parsed, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return APIError(400, f"request body holds a lone UTF-16 surrogate ({e.object[e.start]!r}), which is not "
                             "valid Unicode text", code="invalid_json")
    except RecursionError:
        return APIError(400, "request body is nested too deeply to parse", code="invalid_json")
    return None


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        return APIError(404, f"no route {request.method} {request.url.path}; see /docs for the API",
                        code="not_found").response()
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                        code="method_not_allowed").response()
    return APIError(exc.status_code, str(exc.detail)).response()


def _without_422(openapi):
    """FastAPI documents a 422 for every body; this app answers 400 instead (see `validation_error`)."""
    def schema() -> dict:
        document = openapi()
        for operations in document.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
        return document

    return schema
