"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from aiohttp import web


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


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist", "invalid_request_error", "model",
                    "model_not_found")


def overloaded(message: str) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "queue_full")


def unavailable(message: str, retry_after: int | None = None) -> APIError:
    return APIError(503, message, "service_unavailable", None, "model_not_ready", retry_after)
