"""One table maps every failure the routes meet to its status: the OpenAI shape,
Anthropic's, and the admin API's Status all come from it."""

from __future__ import annotations

import pytest

from specd.api.manifest import ManifestError
from specd.engine.embedder import EmbeddingFailed
from specd.engine.engine import EngineOverloaded, EngineUnavailable
from specd.engine.scheduler import RequestRejected
from specd.server.bodies import BodyError
from specd.server.errors import ERRORS, StatusError, api_error, model_not_found, status_error
from specd.serving.cluster import Refused
from specd.serving.registry import ModelNotFound, ModelNotReady, WrongTask
from specd.store import Conflict, NotFound


@pytest.mark.parametrize("err,status,type_,code,param,reason", [
    (RequestRejected("prompt is empty", "prompt"), 400, "invalid_request_error", "invalid_value", "prompt",
     "BadRequest"),
    (WrongTask("model 'e' serves spec.task embed, not generate"), 400, "invalid_request_error", "invalid_value",
     "model", "BadRequest"),
    (ModelNotReady("model 'm' is Failed: x", 7), 503, "service_unavailable", "model_not_ready", None,
     "ServiceUnavailable"),
    (EngineOverloaded("full"), 429, "rate_limit_error", "queue_full", None, "TooManyRequests"),
    (EngineUnavailable("draining"), 503, "service_unavailable", "model_not_ready", None, "ServiceUnavailable"),
    (EmbeddingFailed("engine error"), 500, "server_error", "engine_error", None, "InternalError"),
    (BodyError(413, "too large"), 413, "invalid_request_error", None, None, "RequestEntityTooLarge"),
    (BodyError(400, "lone surrogate", "messages[0]"), 400, "invalid_request_error", "invalid_value", "messages[0]",
     "BadRequest"),
    (Conflict("changed"), 409, "invalid_request_error", None, None, "Conflict"),
    (NotFound('Model "m" not found'), 404, "invalid_request_error", None, None, "NotFound"),
    (Refused(409, "NameInUse", "taken"), 409, "invalid_request_error", None, None, "NameInUse"),
])
def test_each_failure_answers_one_status_in_every_shape(err, status, type_, code, param, reason):
    api = api_error(err)
    assert (api.status, api.type, api.code, api.param) == (status, type_, code, param)
    assert api.message == (err.args[0] if isinstance(err, KeyError) else str(err))  # a KeyError unquoted
    body = status_error(err).body()
    assert (body["code"], body["reason"], body["message"]) == (status, reason, api.message)
    assert body.get("details", {}).get("causes", [{}])[0].get("field") == param
    assert api.anthropic_body()["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error",
                                                      409: "invalid_request_error", 413: "request_too_large",
                                                      429: "rate_limit_error", 503: "overloaded_error",
                                                      500: "api_error"}[status]


def test_the_table_covers_what_it_is_asked_and_refuses_the_rest():
    assert api_error(ModelNotReady("loading", 7)).headers == {"Retry-After": "7"}
    assert model_not_found("x").body() == {"error": {"message": "The model 'x' does not exist",
                                                     "type": "invalid_request_error", "param": "model",
                                                     "code": "model_not_found"}}
    manifest = status_error(ManifestError("must be a string", "spec.source"), "items[0].spec.source: must be",
                            "items[0].spec.source")
    assert (manifest.code, manifest.reason, manifest.field) == (422, "Invalid", "items[0].spec.source")
    assert StatusError.of(api_error(ModelNotFound("m")), "Gone").reason == "Gone"
    assert all(issubclass(cls, Exception) for cls in ERRORS)
    with pytest.raises(TypeError, match="ValueError"):
        api_error(ValueError("not in the table"))
