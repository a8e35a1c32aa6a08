"""The head's cluster API: Nodes join and heartbeat here, with the cluster token.

It is not the admin API: a worker holds the cluster token, not the admin one.
"""

from __future__ import annotations

from aiohttp import web

from ..serving.cluster import Refused
from .bodies import BodyError, json_body
from .errors import status_error
from .keys import CLUSTER

routes = web.RouteTableDef()


async def _body(request: web.Request) -> dict:
    try:
        body = await json_body(request)
    except BodyError as err:
        raise Refused(err.status, "BadRequest", err.message) from None
    if not isinstance(body, dict):
        raise Refused(400, "BadRequest", "the body must be an object")
    return body


def _refusal(refused: Refused) -> web.Response:
    return status_error(refused).response()


def _cluster(request: web.Request):
    cluster = request.app.get(CLUSTER)
    if cluster is None:
        raise Refused(404, "NotAHead", "this daemon takes no Nodes (start it with --cluster-token-file)")
    return cluster


@routes.post("/cluster/v1/nodes/{name}/join")
async def join(request: web.Request) -> web.Response:
    try:
        _cluster(request).join(request.match_info["name"], request.headers.get("Authorization", ""),
                               await _body(request))
    except (Refused, KeyError, TypeError, ValueError) as err:
        return _refusal(err if isinstance(err, Refused) else Refused(400, "BadRequest", f"bad join: {err}"))
    return web.json_response({"joined": request.match_info["name"]})


@routes.post("/cluster/v1/nodes/{name}/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        cluster = _cluster(request)
        cluster.heartbeat(name, request.headers.get("Authorization", ""), await _body(request))
    except Refused as refused:
        return _refusal(refused)
    return web.json_response({"reserved": cluster.reserved.get(name, {})})  # ranks the head started there
