"""The application's shared state, under typed aiohttp keys."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..control.registry import ModelRegistry
from ..control.store import Store

REGISTRY = web.AppKey("registry", ModelRegistry)
STORE = web.AppKey("store", Store)
ADMIN_TOKEN = web.AppKey("admin_token", str)  # absent: no admin token configured
STARTED = web.AppKey("started", asyncio.Event)
