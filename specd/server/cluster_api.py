"""The head's cluster API: Nodes join and heartbeat here, with the cluster token, on the head's
cluster port (TLS) only; its CA certificate is public, for a joining Node to check against the hash
its join token pins.

It is not the admin API: a worker holds the cluster token, not the admin one.
"""

from __future__ import annotations

from aiohttp import web

from ..serving.cluster import Refused
from ..serving.tls import CA_PATH
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


def _cluster(request: web.Request, tls: bool = True):
    cluster = request.app.get(CLUSTER)
    if cluster is None:
        raise Refused(404, "NotAHead", "this daemon takes no Nodes (start it with --cluster-token-file)")
    if tls and not request.secure:
        raise Refused(403, "TLSRequired", "Nodes join and heartbeat on the head's cluster port, over TLS "
                                          "(https://HEAD:CLUSTER_PORT), never in clear text")
    return cluster


@routes.get(CA_PATH)
async def certificate_authority(request: web.Request) -> web.Response:
    try:
        cluster = _cluster(request, tls=False)
    except Refused as refused:
        return _refusal(refused)
    return web.Response(body=cluster.ca.pem, content_type="application/x-pem-file")


@routes.post("/cluster/v1/nodes/{name}/join")
async def join(request: web.Request) -> web.Response:
    try:
        _, certificate = _cluster(request).join(request.match_info["name"], request.headers.get("Authorization", ""),
                                                await _body(request))
    except (Refused, KeyError, TypeError, ValueError) as err:
        return _refusal(err if isinstance(err, Refused) else Refused(400, "BadRequest", f"bad join: {err}"))
    return web.json_response({"joined": request.match_info["name"], "certificate": certificate.decode(),
                              "placements": request.app[CLUSTER].placements_for(request.match_info["name"])})


@routes.post("/cluster/v1/nodes/{name}/heartbeat")
async def heartbeat(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    try:
        cluster = _cluster(request)
        cluster.heartbeat(name, request.headers.get("Authorization", ""), await _body(request))
    except Refused as refused:
        return _refusal(refused)
    return web.json_response({"reserved": cluster.reserved.get(name, {}),  # ranks the head started there
                              "placements": cluster.placements_for(name)})
