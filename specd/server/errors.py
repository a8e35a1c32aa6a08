"""Errors as the APIs answer them, and the one table of what each failure answers.

``APIError`` is OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``),
which the Anthropic routes reshape (``anthropic_body``); ``StatusError`` is the
admin API's (a Kubernetes ``Status``), built from an APIError (``StatusError.of``).
``ERRORS`` says, for each exception the routes meet, the status, type and code it
answers with, and ``api_error`` turns one into its APIError (``status_error`` into
its Status), so a failure means the same status under every API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..api.manifest import ManifestError
from ..engine.embedder import EmbeddingFailed
from ..core.request import StepOutput
from ..engine.engine import EngineOverloaded, EngineUnavailable
from ..engine.memory_guard import OUT_OF_MEMORY
from ..engine.scheduler import RequestRejected
from ..serving.cluster import Refused
from ..serving.registry import ModelNotFound, ModelNotReady, WrongTask
from ..serving.remote import ReplicaUnreachable
from ..store import Conflict, NotFound
from .bodies import BodyError


class APIError(Exception):
    """An error a handler raises to answer the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After

    @property
    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def anthropic_body(self) -> dict:
        """The same error as Anthropic's API shapes it (``{"type": "error", "error": {type, message}}``)."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        message = f"{self.param}: {self.message}" if self.param and self.param not in self.message else self.message
        return {"type": "error", "error": {"type": kind, "message": message}}

    def anthropic_response(self) -> web.Response:
        return web.json_response(self.anthropic_body(), status=self.status, headers=self.headers)


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}


INVALID_VALUE = "invalid_value"  # the code of a 400 that names its field (none without one)


@dataclass(frozen=True)
class ErrorKind:
    status: int | None  # None: the exception's own (``status``)
    type: str = "invalid_request_error"  # OpenAI's error type
    code: str | None = None  # OpenAI's error code
    param: str | None = None  # the field at fault, unless the exception names one


# What each failure answers, under every API (the admin API's reason follows the status: REASONS)
ERRORS: dict[type[Exception], ErrorKind] = {
    BodyError: ErrorKind(None, code=INVALID_VALUE),  # 400, 413 or 415
    ModelNotFound: ErrorKind(404, code="model_not_found"),
    WrongTask: ErrorKind(400, code=INVALID_VALUE, param="model"),
    ModelNotReady: ErrorKind(503, "service_unavailable", "model_not_ready"),  # with its Retry-After
    RequestRejected: ErrorKind(400, code=INVALID_VALUE),
    EngineOverloaded: ErrorKind(429, "rate_limit_error", "queue_full"),
    ReplicaUnreachable: ErrorKind(503, "service_unavailable", "replica_unreachable"),  # before EngineUnavailable: a kind of it
    EngineUnavailable: ErrorKind(503, "service_unavailable", "model_not_ready"),
    EmbeddingFailed: ErrorKind(500, "server_error", "engine_error"),
    ManifestError: ErrorKind(422, code=INVALID_VALUE),
    NotFound: ErrorKind(404),  # a stored object
    Conflict: ErrorKind(409),
    Refused: ErrorKind(None),  # by the cluster API, with its own reason
}
# The admin API's Status reason for each status
REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 409: "Conflict",
           413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 422: "Invalid", 429: "TooManyRequests",
           500: "InternalError", 503: "ServiceUnavailable"}


def api_error(err: Exception, message: str | None = None, param: str | None = None) -> APIError:
    """``err`` as the APIError that answers it (``ERRORS`` gives its status, type and code):
    ``message`` if given, else the exception's; ``param`` if given, else the field it names."""
    kind = next((k for cls, k in ERRORS.items() if isinstance(err, cls)), None)
    if kind is None:
        raise TypeError(f"ERRORS does not say what {type(err).__name__} answers") from err
    status = kind.status if kind.status is not None else err.status
    if message is None:  # a KeyError's str() quotes it
        message = err.args[0] if isinstance(err, KeyError) and err.args else str(err)
    param = param or getattr(err, "field", None) or getattr(err, "param", None) or kind.param
    code = None if kind.code == INVALID_VALUE and not param else kind.code
    return APIError(status, message, kind.type, param, code, getattr(err, "retry_after", None))


def engine_failure(out: StepOutput) -> APIError:
    """A request its engine ended with an error: refused for MLX's memory limit (503: it may
    fit once other requests have finished), or failed (500)."""
    if out.error_code == OUT_OF_MEMORY:
        return APIError(503, out.error or OUT_OF_MEMORY, "service_unavailable", None, OUT_OF_MEMORY, retry_after=1)
    return APIError(500, out.error or "engine error", "server_error", None, "engine_error")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, INVALID_VALUE if param else None)


def model_not_found(name: str) -> APIError:
    return api_error(ModelNotFound(name), f"The model '{name}' does not exist", "model")


class StatusError(Exception):
    """An error the admin API answers with: a Kubernetes ``Status`` (the field at fault in ``details.causes``)."""

    def __init__(self, code: int, reason: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.field = code, reason, message, field

    @classmethod
    def of(cls, err: APIError, reason: str | None = None) -> StatusError:
        """The same error as the admin API shapes it (``reason``: else the status's)."""
        return cls(err.status, reason or REASONS.get(err.status, "InternalError"), err.message, err.param)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "Status", "status": "Failure",
                                "message": self.message, "reason": self.reason, "code": self.code}
        if self.field:
            body["details"] = {"causes": [{"field": self.field, "message": self.message}]}
        return body

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.code)


def status_error(err: Exception, message: str | None = None, field: str | None = None) -> StatusError:
    """``err`` as the admin API's Status (``api_error``, then ``StatusError.of``; a cluster
    API refusal keeps its own reason)."""
    return StatusError.of(api_error(err, message, field), err.reason if isinstance(err, Refused) else None)
