"""The admin API, shaped like Kubernetes': ``/apis/specd.dev/v1alpha1/{plural}[/{name}]``.

Errors come back as a Kubernetes ``Status`` (reason, message, code, and the
offending field in ``details.causes``).  The admin API needs the bearer token
from ``--admin-token-file``; without one it answers loopback clients only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from typing import Any, Callable

import structlog
from aiohttp import web

from ..api.diff import manifest_diff
from ..api.manifest import ManifestError, ModelSpec, Resource, load_yaml, parse_resource
from ..api.paths import ADMIN_PREFIX as PREFIX, API_VERSION
from ..core.memory import gib
from ..engine.resources import memory_request
from ..store import Conflict, NotFound, Store
from .bodies import BodyError, json_body
from .errors import StatusError, status_error
from .keys import ADMIN_OVER_TLS_ONLY, ADMIN_TOKEN, CONTROL, STORE

KINDS = {"models": "Model", "draftpairings": "DraftPairing", "specpolicies": "SpecPolicy",
         "topologies": "Topology"}
PLURALS = {v: k for k, v in KINDS.items()}
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")
routes = web.RouteTableDef()
log = structlog.get_logger(__name__)


@web.middleware
async def admin_guard(request: web.Request, handler):
    """Bearer token (when configured) or loopback only, and Status-shaped errors."""
    if not request.path.startswith(PREFIX):
        return await handler(request)
    token: str | None = request.app.get(ADMIN_TOKEN)
    try:
        if request.app.get(ADMIN_OVER_TLS_ONLY) and not request.secure:
            raise StatusError(403, "Forbidden", "this worker's admin API is its head's: it answers on the worker's "
                              "cluster port, over TLS, never in clear text")
        if token is not None:
            sent = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(sent, f"Bearer {token}".encode()):
                raise StatusError(401, "Unauthorized", "a valid bearer token is required")
        elif not _loopback(request.remote):
            raise StatusError(403, "Forbidden", "the admin API accepts loopback clients only "
                              "(start the daemon with --admin-token-file to allow others)")
        return await handler(request)
    except StatusError as err:
        return err.response()
    except Exception:
        log.exception("admin request failed", path=request.path)
        return StatusError(500, "InternalError", "internal error").response()


def _loopback(remote: str | None) -> bool:
    try:
        return remote is not None and ipaddress.ip_address(remote).is_loopback
    except ValueError:
        return False


def _kind(request: web.Request) -> str:
    plural = request.match_info["plural"]
    if plural not in KINDS:
        raise StatusError(404, "NotFound", f'unknown resource type "{plural}" (known: {", ".join(KINDS)})')
    return KINDS[plural]


def _store(request: web.Request) -> Store:
    return request.app[STORE]


def _dry_run(request: web.Request) -> bool:
    value = request.query.get("dryRun")
    if value not in (None, "All"):
        raise StatusError(400, "BadRequest", 'dryRun must be "All"')
    return value == "All"


async def _json(request: web.Request) -> Any:
    try:
        return await json_body(request)
    except BodyError as err:
        raise status_error(err) from None


def _memory_warnings(resources: list[Resource], room: int, where: str) -> list[str]:
    """What ``apply`` warns of, as ``kubectl`` does, and refuses: a Model that could never fit
    any Node (``room`` bytes on the Node ``where``), and a ``resources.memory`` below what the
    weights alone take. Read from checkpoints already on this machine only (a hub checkpoint not
    yet downloaded is checked when it loads)."""
    warnings = []
    for i, resource in enumerate(resources):
        spec = resource.spec
        if resource.kind != "Model" or not isinstance(spec, ModelSpec) or spec.topology_ref is not None:
            continue
        try:
            request = memory_request(spec, None, room, local_only=True)
        except Exception:  # not on this machine yet, or not a checkpoint: the load says why
            continue
        if spec.memory is not None and spec.memory < request.weights:
            path = f"items[{i}].spec.resources.memory"
            raise StatusError(422, "Invalid", f"{path}: {gib(spec.memory)} is less than the weights alone take "
                                              f"({gib(request.weights)})", path)
        need = request.total
        if need > room:
            warnings.append(f'Model "{resource.name}" requests {gib(need)} but the node {where} has '
                            f"{gib(room)} allocatable: it will stay Unschedulable")
    return warnings


def _apply(request: web.Request, docs: list[Any], room: tuple[int, str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Validate every document, then store all of them in one transaction; also what to warn of."""
    resources = []
    seen: set[tuple[str, str]] = set()
    for i, doc in enumerate(docs):
        try:
            resource = parse_resource(doc)
        except ManifestError as err:
            path = f"items[{i}]" + (f".{err.path}" if err.path else "")
            raise status_error(err, f"{path}: {err.reason}", path) from None
        if (resource.kind, resource.name) in seen:
            raise StatusError(422, "Invalid", f'items[{i}]: duplicate {resource.kind} "{resource.name}"',
                              f"items[{i}].metadata.name")
        seen.add((resource.kind, resource.name))
        resources.append(resource)
    warnings = _memory_warnings(resources, *room)
    store, dry_run = _store(request), _dry_run(request)
    live = {(r.kind, r.name): _stored_manifest(store, r.kind, r.name) for r in resources} if dry_run else {}
    try:
        results = store.apply([r.store_item() for r in resources], dry_run=dry_run)
    except Conflict as err:
        raise status_error(err) from None
    items = []
    for o, action in results:
        item = {"kind": o.kind, "name": o.name, "action": action, "object": o.manifest(API_VERSION)}
        if dry_run:  # what it would change, as ``specd diff`` shows it
            item["diff"] = manifest_diff(live[o.kind, o.name], item["object"], o.kind, o.name)
        items.append(item)
    return items, warnings


def _stored_manifest(store: Store, kind: str, name: str) -> dict[str, Any] | None:
    try:
        return store.get(kind, name).manifest(API_VERSION)
    except NotFound:
        return None


def _warned(body: Any, warnings: list[str], status: int = 200) -> web.Response:
    """A response with Kubernetes' ``Warning: 299`` headers."""
    response = web.json_response(body, status=status)
    for warning in warnings:
        response.headers.add("Warning", f'299 - "{warning}"')
    return response


@routes.post(PREFIX + "/apply")
async def apply(request: web.Request) -> web.Response:
    """specd's multi-object apply, all or nothing: ``{"items": [...]}``, or the manifests as a
    YAML stream (``Content-Type: application/yaml``, as the console sends what was typed)."""
    if request.content_type in YAML_TYPES:
        docs = await _yaml_documents(request)
    else:
        body = await _json(request)
        if not isinstance(body, dict) or not isinstance(body.get("items"), list):
            raise StatusError(400, "BadRequest", 'body must be {"items": [manifest, ...]}')
        docs = body["items"]
    # file reads and a commit: off the loop; the largest Node read on it (the loop changes the Nodes)
    items, warnings = await asyncio.to_thread(_apply, request, docs, request.app[CONTROL].largest_node())
    return _warned({"items": items, "warnings": warnings}, warnings)


async def _yaml_documents(request: web.Request) -> list[Any]:
    """The documents of a YAML body, read as ``specd apply -f`` reads a file."""
    try:
        text = (await request.read()).decode("utf-8")
        return load_yaml(text)
    except UnicodeDecodeError as err:
        raise StatusError(400, "BadRequest", f"the body is not UTF-8 text (byte {err.start})") from None
    except ManifestError as err:
        raise status_error(err, ": ".join(x for x in (err.path, err.reason) if x), err.path or None) from None


def _node_objects(request: web.Request) -> list[dict[str, Any]]:
    """This daemon's node and, on a head, the Nodes that joined it, as ``get nodes`` shows them."""
    return request.app[CONTROL].nodes()




@routes.get(PREFIX + "/nodes")
async def list_nodes(request: web.Request) -> web.Response:
    return web.json_response({"apiVersion": API_VERSION, "kind": "NodeList", "items": _node_objects(request)})


@routes.get(PREFIX + "/nodes/{name}")
async def get_node(request: web.Request) -> web.Response:
    for node in _node_objects(request):
        if node["metadata"]["name"] == request.match_info["name"]:
            return web.json_response(node)
    raise StatusError(404, "NotFound", f'Node "{request.match_info["name"]}" not found')


@routes.post(PREFIX + "/models/{name}/restart")
async def restart_model(request: web.Request) -> web.Response:
    """``specd rollout restart model NAME``: load again now."""
    name = request.match_info["name"]
    try:
        _store(request).get("Model", name)
        request.app[CONTROL].restart(name)
    except (NotFound, KeyError):
        raise status_error(NotFound(name), f'Model "{name}" not found') from None
    return web.json_response({"kind": "Model", "name": name, "action": "restarted"})


async def _stored(build: Callable[[], Any]) -> web.Response:
    """``build()``'s object as JSON, read from the store and encoded off the event loop: a list of
    hundreds of objects, or a delete's commit, holds up no stream."""
    body = await asyncio.to_thread(lambda: _encoded(build()))
    return web.Response(text=body, content_type="application/json")


def _encoded(body: Any) -> str:
    """JSON, a list's ``items`` one ``json.dumps`` each: the C encoder holds the GIL for a whole
    call, and one call over hundreds of objects would stop the engines' threads for
    milliseconds (a token's time) however far from the event loop it runs."""
    items = body.get("items") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return json.dumps(body)
    rest = json.dumps({k: v for k, v in body.items() if k != "items"})
    return rest[:-1] + (", " if len(rest) > 2 else "") + '"items": [' + ", ".join(map(json.dumps, items)) + "]}"


@routes.get(PREFIX + "/{plural}")
async def list_objects(request: web.Request) -> web.Response:
    kind = _kind(request)
    return await _stored(lambda: {"apiVersion": API_VERSION, "kind": f"{kind}List",
                                  "items": [o.manifest(API_VERSION) for o in _store(request).list(kind)]})


@routes.get(PREFIX + "/{plural}/{name}")
async def get_object(request: web.Request) -> web.Response:
    kind = _kind(request)
    try:
        return await _stored(lambda: _store(request).get(kind, request.match_info["name"]).manifest(API_VERSION))
    except NotFound as err:
        raise status_error(err) from None


@routes.get(PREFIX + "/{plural}/{name}/events")
async def get_events(request: web.Request) -> web.Response:
    kind = "Node" if request.match_info["plural"] == "nodes" else _kind(request)
    return await _stored(lambda: {"items": _store(request).events(kind, request.match_info["name"])})


@routes.put(PREFIX + "/{plural}/{name}")
async def put_object(request: web.Request) -> web.Response:
    kind, name = _kind(request), request.match_info["name"]
    body = await _json(request)
    if not isinstance(body, dict) or body.get("kind") != kind or \
            not isinstance(body.get("metadata"), dict) or body["metadata"].get("name") != name:
        raise StatusError(400, "BadRequest", f'body must be a {kind} named "{name}"')
    results, warnings = await asyncio.to_thread(_apply, request, [body], request.app[CONTROL].largest_node())
    return _warned(results[0]["object"], warnings, 201 if results[0]["action"] == "created" else 200)


@routes.delete(PREFIX + "/{plural}/{name}")
async def delete_object(request: web.Request) -> web.Response:
    kind, dry_run = _kind(request), _dry_run(request)
    try:
        return await _stored(lambda: _store(request).delete(kind, request.match_info["name"], dry_run=dry_run)
                             .manifest(API_VERSION))
    except NotFound as err:
        raise status_error(err) from None
