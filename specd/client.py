"""kubectl-style commands against a running daemon: apply, diff, get, describe, delete."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .api.diff import manifest_diff
from .api.manifest import SOURCE_ANNOTATION, ManifestError, parse_documents, read_manifest_file
from .api.paths import ADMIN_PREFIX as PREFIX, GROUP

KIND_NAMES = {
    "Model": ("model", "models", "mo"),
    "DraftPairing": ("draftpairing", "draftpairings", "dp"),
    "SpecPolicy": ("specpolicy", "specpolicies", "sp"),
    "Topology": ("topology", "topologies", "topo"),
    "Node": ("node", "nodes", "no"),
}
PLURAL = {kind: names[1] for kind, names in KIND_NAMES.items()}


class CommandError(Exception):
    """A failure the command reports as one line and a non-zero exit."""


def resolve_kind(word: str) -> str:
    for kind, names in KIND_NAMES.items():
        if word.lower() in names or word == kind:
            return kind
    known = ", ".join(n for names in KIND_NAMES.values() for n in names[:2])
    raise CommandError(f'unknown resource type "{word}" (known: {known})')


class Client:
    def __init__(self, server: str, token: str | None):
        self.server = server.rstrip("/")
        self.token = token

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raw = err.read()
            try:
                message = json.loads(raw).get("message") or raw.decode()
            except ValueError:
                message = raw.decode(errors="replace")
            raise CommandError(f"{err.code}: {message}") from None
        except urllib.error.URLError as err:
            raise CommandError(f"cannot reach {self.server}: {err.reason}") from None


def read_documents(sources: list[str]) -> list[dict[str, Any]]:
    """Manifests from files, directories (their *.yaml/*.yml) or ``-`` (stdin),
    validated here first so a bad file is named before anything is sent."""
    docs: list[dict[str, Any]] = []
    for source in sources:
        if source == "-":
            try:
                # relative sources are taken from where the command runs
                files = [("-", sys.stdin.buffer.read().decode("utf-8"), str(Path.cwd() / "-"))]
            except UnicodeDecodeError as err:
                raise CommandError(f"-: not UTF-8 text (byte {err.start})") from None
        else:
            path = Path(source)
            if path.is_dir():
                paths = sorted(p for p in path.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
            elif path.exists():
                paths = [path]
            else:
                raise CommandError(f"{source}: no such file or directory")
            try:
                files = [(str(p), read_manifest_file(p), str(p.resolve())) for p in paths]
            except ManifestError as err:
                raise CommandError(str(err)) from None
        for name, text, origin in files:
            try:
                resources = parse_documents(text, origin)
            except ManifestError as err:
                where = ":".join(x for x in (name, err.path) if x)
                raise CommandError(f"{where}: {err.reason}") from None
            for r in resources:
                metadata: dict[str, Any] = {"name": r.name}
                if r.labels:
                    metadata["labels"] = r.labels
                if r.annotations:
                    metadata["annotations"] = r.annotations
                if r.resource_version is not None:
                    metadata["resourceVersion"] = r.resource_version
                docs.append({"apiVersion": r.api_version, "kind": r.kind, "metadata": metadata,
                             "spec": r.raw_spec})
    return docs


def cmd_apply(client: Client, args) -> int:
    docs = read_documents(args.filename)
    dry = args.dry_run == "server"
    result = client.request("POST", f"{PREFIX}/apply" + ("?dryRun=All" if dry else ""), {"items": docs})
    suffix = " (server dry run)" if dry else ""
    for warning in result.get("warnings", []):
        print(f"Warning: {warning}", file=sys.stderr)
    for item in result["items"]:
        print(f"{item['kind'].lower()}.{GROUP}/{item['name']} {item['action']}{suffix}")
        owner = item["object"]["metadata"].get("annotations", {}).get(SOURCE_ANNOTATION)
        if owner and item["action"] == "configured":
            print(f"warning: {item['kind'].lower()}.{GROUP}/{item['name']} comes from the watched file "
                  f"{owner}; the daemon applies that file again when it changes or the daemon restarts",
                  file=sys.stderr)
    return 0


def cmd_diff(client: Client, args) -> int:
    changed = False
    for doc in read_documents(args.filename):
        name, kind = doc["metadata"]["name"], doc["kind"]
        try:
            live = client.request("GET", f"{PREFIX}/{PLURAL[kind]}/{name}")
        except CommandError as err:
            if not str(err).startswith("404"):
                raise
            live = None
        diff = manifest_diff(live, doc, kind, name)
        if diff:
            changed = True
            sys.stdout.write(diff)
    return 1 if changed else 0


def _ready(obj: dict[str, Any]) -> tuple[str, str]:
    for c in obj.get("status", {}).get("conditions", []):
        if c.get("type") == "Ready":
            return c.get("status", "Unknown"), c.get("reason", "")
    return "Unknown", ""


def _age(created: str) -> str:
    try:
        seconds = int(time.time() - time.mktime(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ")) + time.timezone)
    except (ValueError, TypeError):
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _columns(kind: str, obj: dict[str, Any], wide: bool) -> list[str]:
    spec, status = obj.get("spec", {}), obj.get("status", {})
    ready, reason = _ready(obj)
    row = [obj["metadata"]["name"], ready, reason]
    if kind == "Model":
        row.append(spec.get("source", ""))
        if wide:
            replicas = f"{status['readyReplicas']}/{spec.get('replicas', 1)}" if "readyReplicas" in status else ""
            row += [str(obj["metadata"].get("generation")), str(status.get("observedGeneration", "")),
                    str(status.get("loadSeconds", "")), status.get("draftPairing", ""), replicas]
    elif kind == "DraftPairing":
        row += [spec.get("targetRef", ""), spec.get("method", ""), str(spec.get("numSpeculativeTokens", 3))]
        if wide:
            row += [str(status.get("acceptanceRate", "")), spec.get("source", "")]
    elif kind == "SpecPolicy":
        row += [",".join(status.get("selectedModels", [])), str(spec.get("maxSpeculativeTokens", ""))]
        if wide:
            row += [str(spec.get("enabled", True)), str(spec.get("disableByBatchSize", ""))]
    elif kind == "Node":
        row += [_gib(status.get("allocatable")), _gib(status.get("requested")), _gib(status.get("inUse")),
                ",".join(m["name"] for m in status.get("models", [])) or "<none>"]
        if wide:
            row += [_gib(status.get("capacity")), status.get("chip", "")]
    elif kind == "Topology":
        row += [spec.get("backend", ""), str(spec.get("tensorParallelSize", len(spec.get("hosts", []))))]
        if wide:
            row.append(",".join(h.get("address", "") for h in spec.get("hosts", [])))
    row.append(_age(obj["metadata"].get("creationTimestamp", "")))
    return row


HEADERS = {
    "Model": (["NAME", "READY", "REASON", "SOURCE"], ["GENERATION", "OBSERVED", "LOAD-S", "PAIRING", "REPLICAS"]),
    "DraftPairing": (["NAME", "READY", "REASON", "TARGET", "METHOD", "K"], ["ACCEPTANCE", "SOURCE"]),
    "SpecPolicy": (["NAME", "READY", "REASON", "MODELS", "MAX-K"], ["ENABLED", "DISABLE-AT-BATCH"]),
    "Topology": (["NAME", "READY", "REASON", "BACKEND", "TP"], ["ADDRESSES"]),
    "Node": (["NAME", "READY", "REASON", "ALLOCATABLE", "REQUESTED", "IN-USE", "MODELS"], ["CAPACITY", "CHIP"]),
}


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / 2**30:.2f}Gi"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_get(client: Client, args) -> int:
    kind = resolve_kind(args.kind)
    if args.name:
        items = [client.request("GET", f"{PREFIX}/{PLURAL[kind]}/{args.name}")]
    else:
        items = client.request("GET", f"{PREFIX}/{PLURAL[kind]}")["items"]
    if args.output in ("yaml", "json"):
        payload: Any = items[0] if args.name else {"apiVersion": "v1", "kind": "List", "items": items}
        if args.output == "json":
            print(json.dumps(payload, indent=2))
        else:
            print(yaml.safe_dump(payload, sort_keys=False), end="")
        return 0
    if not items:
        print(f"No {PLURAL[kind]} found.", file=sys.stderr)
        return 0
    head, extra = HEADERS[kind]
    header = head + (extra if args.output == "wide" else []) + ["AGE"]
    print(_table([header] + [_columns(kind, o, args.output == "wide") for o in items]))
    return 0


def cmd_describe(client: Client, args) -> int:
    kind = resolve_kind(args.kind)
    obj = client.request("GET", f"{PREFIX}/{PLURAL[kind]}/{args.name}")
    events = client.request("GET", f"{PREFIX}/{PLURAL[kind]}/{args.name}/events")["items"]
    meta, status = obj["metadata"], dict(obj.get("status", {}))
    print(f"Name:         {meta['name']}")
    print(f"Kind:         {kind}")
    for key in ("labels", "annotations"):
        values = meta.get(key) or {}
        print(f"{key.capitalize() + ':':<14}" + (", ".join(f"{k}={v}" for k, v in values.items()) or "<none>"))
    if "generation" in meta:  # a stored object's (a Node's record has none)
        print(f"Generation:   {meta['generation']}   ResourceVersion: {meta.get('resourceVersion')}")
    print(f"Created:      {meta.get('creationTimestamp')}")
    print("Spec:")
    print("  " + yaml.safe_dump(obj.get("spec"), sort_keys=False).replace("\n", "\n  ").rstrip())
    conditions = status.pop("conditions", [])
    if status:
        print("Status:")
        print("  " + yaml.safe_dump(status, sort_keys=False).replace("\n", "\n  ").rstrip())
    print("Conditions:")
    rows = [["TYPE", "STATUS", "REASON", "OBSERVED-GEN", "SINCE", "MESSAGE"]]
    rows += [[c["type"], c["status"], c["reason"], str(c.get("observedGeneration", "")),
              c.get("lastTransitionTime", ""), c.get("message", "")] for c in conditions]
    print("  " + _table(rows).replace("\n", "\n  ") if conditions else "  <none>")
    print("Events:")
    rows = [["TYPE", "REASON", "TIME", "MESSAGE"]] + [[e["type"], e["reason"], e["time"], e["message"]]
                                                      for e in events[-10:]]
    print("  " + _table(rows).replace("\n", "\n  ") if events else "  <none>")
    return 0


def cmd_rollout(client: Client, args) -> int:
    if resolve_kind(args.kind) != "Model":
        raise CommandError("rollout restart applies to models")
    client.request("POST", f"{PREFIX}/models/{args.name}/restart")
    print(f"model.{GROUP}/{args.name} restarted")
    return 0


def cmd_delete(client: Client, args) -> int:
    if args.filename:
        targets = [(d["kind"], d["metadata"]["name"]) for d in read_documents(args.filename)]
    elif args.kind and args.name:
        targets = [(resolve_kind(args.kind), args.name)]
    else:
        raise CommandError("give -f FILE or KIND NAME")
    failed = 0
    for kind, name in targets:  # like kubectl: go on past a failure, report it, exit 1
        try:
            client.request("DELETE", f"{PREFIX}/{PLURAL[kind]}/{name}")
        except CommandError as err:
            if args.ignore_not_found and str(err).startswith("404"):
                continue
            print(f"error: {err}", file=sys.stderr)
            failed += 1
            continue
        print(f"{kind.lower()}.{GROUP}/{name} deleted")
    return 1 if failed else 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--server", default=os.environ.get("SPECD_SERVER", "http://127.0.0.1:8000"),
                       help="daemon address (default $SPECD_SERVER or http://127.0.0.1:8000)")
        p.add_argument("--token-file", type=Path, default=None, help="admin token (default $SPECD_TOKEN)")
        p.set_defaults(func=run)

    p = sub.add_parser("apply", help="create or update objects from manifests")
    p.add_argument("-f", "--filename", action="append", required=True, help="FILE, DIR or - (stdin)")
    p.add_argument("--dry-run", choices=["none", "server"], default="none")
    p.set_defaults(command_func=cmd_apply)
    common(p)
    p = sub.add_parser("diff", help="show what apply would change (exit 1 when something would)")
    p.add_argument("-f", "--filename", action="append", required=True)
    p.set_defaults(command_func=cmd_diff)
    common(p)
    p = sub.add_parser("get", help="list objects or show one")
    p.add_argument("kind")
    p.add_argument("name", nargs="?")
    p.add_argument("-o", "--output", choices=["yaml", "json", "wide"], default=None)
    p.set_defaults(command_func=cmd_get)
    common(p)
    p = sub.add_parser("describe", help="an object's spec, status conditions and recent events")
    p.add_argument("kind")
    p.add_argument("name")
    p.set_defaults(command_func=cmd_describe)
    common(p)
    p = sub.add_parser("delete", help="delete objects named in manifests, or KIND NAME")
    p.add_argument("kind", nargs="?")
    p.add_argument("name", nargs="?")
    p.add_argument("-f", "--filename", action="append")
    p.add_argument("--ignore-not-found", action="store_true")
    p.set_defaults(command_func=cmd_delete)
    common(p)
    p = sub.add_parser("rollout", help="rollout restart model NAME: load a Model again now (skips a backoff)")
    p.add_argument("action", choices=["restart"])
    p.add_argument("kind")
    p.add_argument("name")
    p.set_defaults(command_func=cmd_rollout)
    common(p)


def run(args: argparse.Namespace) -> int:
    token = os.environ.get("SPECD_TOKEN")
    if args.token_file is not None:
        token = args.token_file.read_text().strip()
    try:
        return args.command_func(Client(args.server, token), args)
    except CommandError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
