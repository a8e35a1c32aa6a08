"""The application's shared state, under typed aiohttp keys."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web

from ..serving.cluster import Cluster
from ..serving.fence import PlacementFence
from ..serving.registry import ModelRegistry
from ..store import Store
from .response_store import ResponseStore


class ControlView(Protocol):
    """What the admin routes ask of the control plane (the daemon hands them its ``ControlPlane``):
    the routes read and write desired state in the store and never reach into reconcilers."""

    node_name: str
    allocatable: int  # bytes of this node's memory Models may request

    def nodes(self) -> list[dict[str, Any]]:
        """This node and, on a head, the Nodes that joined it, as ``get nodes`` shows them."""

    def largest_node(self) -> tuple[int, str]:
        """The most memory a replica could take on one Node (its allocatable bytes), and that Node."""

    def restart(self, model: str) -> None:
        """``rollout restart``: load the Model again now (KeyError: no such Model runs)."""


REGISTRY = web.AppKey("registry", ModelRegistry)
STORE = web.AppKey("store", Store)
CONTROL = web.AppKey("control", ControlView)
CLUSTER = web.AppKey("cluster", Cluster)  # absent: this daemon is no head
ADMIN_TOKEN = web.AppKey("admin_token", str)  # absent: no admin token configured
# a worker's: its admin API is its head's, and answers only on its cluster port (TLS)
ADMIN_OVER_TLS_ONLY = web.AppKey("admin_over_tls_only", bool)
PLACEMENT_FENCE = web.AppKey("placement_fence", PlacementFence)  # a worker's: which head calls its replicas refuse
API_KEYS = web.AppKey("api_keys", tuple)  # absent or empty: the inference routes are open
CORS_ORIGINS = web.AppKey("cors_origins", tuple)  # origins browsers may call the inference routes from
STARTED = web.AppKey("started", asyncio.Event)
RESPONSES = web.AppKey("responses", ResponseStore)  # stored Responses (previous_response_id)
DROP_HOSTED_TOOLS = web.AppKey("drop_hosted_tools", bool)  # leave hosted tools out of Responses requests
FETCH_IMAGE_URLS = web.AppKey("fetch_image_urls", bool)  # fetch the http(s) image URLs requests send
