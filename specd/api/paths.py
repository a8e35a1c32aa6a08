"""specd's API group and version, and the admin API's paths: what the daemon
serves and what its clients (the CLI, a cluster head) ask for, spelled once.

The admin API is shaped like Kubernetes': ``{ADMIN_PREFIX}/{plural}[/{name}]``;
a Model's subresources (``models/{name}/generate|embed|engine``) are what a
cluster head asks of a worker's engine.  No other specd import.
"""

from __future__ import annotations

GROUP = "specd.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"  # a manifest's (and every admin API object's) apiVersion
ADMIN_PREFIX = f"/apis/{GROUP}/{VERSION}"

# A Model's subresources, "{}" its name: run one tokenized request, embed token rows, and what
# the head checks requests against (the worker's engine_report, once the Model is loaded)
MODEL_GENERATE = ADMIN_PREFIX + "/models/{}/generate"
MODEL_EMBED = ADMIN_PREFIX + "/models/{}/embed"
MODEL_ENGINE = ADMIN_PREFIX + "/models/{}/engine"
