"""The application's shared state, under typed aiohttp keys."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..control.cluster import Cluster
from ..control.reconcilers.model import ModelReconciler
from ..control.registry import ModelRegistry
from ..control.store import Store
from .response_store import ResponseStore

REGISTRY = web.AppKey("registry", ModelRegistry)
STORE = web.AppKey("store", Store)
MODELS = web.AppKey("models", ModelReconciler)  # where each Model runs: its engine, replicas, memory
CLUSTER = web.AppKey("cluster", Cluster)  # absent: this daemon is no head
ADMIN_TOKEN = web.AppKey("admin_token", str)  # absent: no admin token configured
API_KEYS = web.AppKey("api_keys", tuple)  # absent or empty: the inference routes are open
CORS_ORIGINS = web.AppKey("cors_origins", tuple)  # origins browsers may call the inference routes from
STARTED = web.AppKey("started", asyncio.Event)
RESPONSES = web.AppKey("responses", ResponseStore)  # stored Responses (previous_response_id)
DROP_HOSTED_TOOLS = web.AppKey("drop_hosted_tools", bool)  # leave hosted tools out of Responses requests
