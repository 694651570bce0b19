"""A local stand-in for the Hugging Face Hub, at the HTTP level.

The real Hub is unreachable from the machines the tests run on (no network but package registries),
so a small `ThreadingHTTPServer` on 127.0.0.1 implements the routes huggingface_hub calls to publish
(create_repo, create_branch, the model card's metadata check, preupload and a commit of small files
with xet disabled, every file "regular" upload mode) and to download (model info at a revision, the
recursive tree of a commit, HEAD and GET of `resolve` URLs, which snapshot_download and
hf_hub_download use). It records each request and keeps repos, branches and the files of every
commit, so a commit to a missing repo or branch fails as on the Hub and a download at a commit sees
that commit's files. Like the Hub, the metadata check refuses a card whose `base_model` is not a
model repo it knows.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

import yaml

_REPO_OP = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+|[^/]+)/(?P<op>preupload|commit|branch)/(?P<rev>[^/]+)")
_INFO = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/.*)?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
# model repos the stand-in's metadata check accepts as a card's base_model, as if they were on the
# Hub
KNOWN_MODELS = frozenset({"HuggingFaceTB/SmolLM2-135M-Instruct", "my-org/local-base"})


@dataclass
class Request:
    """One request the stand-in received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[dict]:
        return [json.loads(line) for line in self.body.splitlines() if line.strip()]


@dataclass
class StandInRepo:
    """A model repo: branch heads and the files of every commit."""

    branches: dict[str, str]
    commits: dict[str, dict[str, bytes]]

    @classmethod
    def empty(cls, repo_id: str) -> StandInRepo:
        first = hashlib.sha1(repo_id.encode()).hexdigest()
        return cls({"main": first}, {first: {}})

    def commit_of(self, revision: str) -> str | None:
        """The commit a branch name or commit sha names, or None."""
        return self.branches.get(revision) or (revision if revision in self.commits else None)


@dataclass
class StandInHub:
    """State of the stand-in: requests seen, repos, and injected failures."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)
    repos: dict[str, StandInRepo] = field(default_factory=dict)
    fail: dict[str, int] = field(default_factory=dict)  # route name -> HTTP status to answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def routes(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def answer(self, request: Request) -> tuple[int, Any, dict[str, str]]:
        """(status, JSON-able body or raw bytes, extra headers) for a request; records it first."""
        with self.lock:
            self.requests.append(request)
            route, found = self._route(request)
            if route in self.fail:
                # Echo the credentials, as a careless server might: the client must redact them.
                auth = request.headers.get("authorization")
                message = f"stand-in failure on {route} (Authorization: {auth})"
                return self.fail[route], {"error": message, "errors": [{"message": message}]}, {}
            return found()

    def _route(self, request: Request) -> tuple[str, Any]:
        method, path = request.method, request.path
        if method == "POST" and path == "/api/repos/create":
            return "create", lambda: self._create(request.json())
        if method == "POST" and path == "/api/validate-yaml":
            return "validate-yaml", lambda: self._validate_yaml(request.json())
        match = _REPO_OP.fullmatch(path)
        if method == "POST" and match:
            repo, op, rev = match["repo"], match["op"], match["rev"]
            return op, lambda: self._repo_op(repo, op, rev, request)
        if method == "GET" and (match := _TREE.fullmatch(path)):
            return "tree", lambda: self._tree(match["repo"], match["rev"])
        if method == "GET" and (match := _INFO.fullmatch(path)):
            return "info", lambda: self._info(match["repo"], match["rev"] or "main")
        if method in ("GET", "HEAD") and (match := _RESOLVE.fullmatch(path)):
            return "resolve", lambda: self._resolve(match["repo"], match["rev"], match["path"])
        return "unknown", lambda: (404, {"error": f"no route {method} {path}"}, {})

    def _create(self, payload: dict) -> tuple[int, dict, dict[str, str]]:
        repo = "/".join(p for p in (payload.get("organization"), payload["name"]) if p)
        if repo in self.repos:
            return (
                409,
                {"error": "You already created this model repo", "url": f"{self.url}/{repo}"},
                {},
            )
        self.repos[repo] = StandInRepo.empty(repo)
        return 200, {"url": f"{self.url}/{repo}"}, {}

    def _validate_yaml(self, payload: dict) -> tuple[int, dict, dict[str, str]]:
        text = payload["content"]
        header = yaml.safe_load(text.split("---")[1]) if text.startswith("---") else {}
        base = (header or {}).get("base_model")
        if base is not None and base not in KNOWN_MODELS:
            message = f'"base_model" with value "{base}" is not a valid model id'
            return 400, {"errors": [{"message": message}], "warnings": []}, {}
        return 200, {"errors": [], "warnings": []}, {}

    def _repo(self, repo: str) -> StandInRepo | None:
        return self.repos.get(repo)

    def _repo_op(self, repo: str, op: str, rev: str, request: Request) -> tuple[int, dict, dict[str, str]]:
        state = self._repo(repo)
        if state is None:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        if op == "branch":
            if rev in state.branches:
                return 409, {"error": "Reference already exists"}, {}
            state.branches[rev] = state.branches["main"]
            return 200, {}, {}
        if rev not in state.branches:
            return 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}
        if op == "preupload":
            paths = [f["path"] for f in request.json()["files"]]
            files = [{"path": path, "uploadMode": "regular", "shouldIgnore": False} for path in paths]
            return 200, {"files": files}, {}
        lines = request.ndjson()
        added = {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines[1:]}
        oid = hashlib.sha1(request.body).hexdigest()
        state.commits[oid] = {**state.commits[state.branches[rev]], **added}
        state.branches[rev] = oid
        return (
            200,
            {
                "commitUrl": f"{self.url}/{repo}/commit/{oid}",
                "commitOid": oid,
                "pullRequestUrl": None,
            },
            {},
        )

    def _not_found(self, repo: str) -> tuple[int, dict, dict[str, str]]:
        if repo not in self.repos:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        return 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}

    def _info(self, repo: str, rev: str) -> tuple[int, dict, dict[str, str]]:
        state = self._repo(repo)
        commit = state.commit_of(rev) if state else None
        if commit is None:
            return self._not_found(repo)
        siblings = [{"rfilename": path} for path in sorted(state.commits[commit])]
        return (
            200,
            {"id": repo, "modelId": repo, "sha": commit, "private": False, "siblings": siblings},
            {},
        )

    def _tree(self, repo: str, rev: str) -> tuple[int, list | dict, dict[str, str]]:
        state = self._repo(repo)
        commit = state.commit_of(rev) if state else None
        if commit is None:
            return self._not_found(repo)
        return (
            200,
            [
                {"type": "file", "path": path, "size": len(data), "oid": _blob_id(data)}
                for path, data in sorted(state.commits[commit].items())
            ],
            {},
        )

    def _resolve(self, repo: str, rev: str, path: str) -> tuple[int, bytes | dict, dict[str, str]]:
        state = self._repo(repo)
        commit = state.commit_of(rev) if state else None
        if commit is None:
            return self._not_found(repo)
        data = state.commits[commit].get(path)
        if data is None:
            return 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"}
        return 200, data, {"X-Repo-Commit": commit, "ETag": f'"{_blob_id(data)}"'}


def _blob_id(data: bytes) -> str:
    """git's blob id of `data`, as the Hub gives a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # seconds a connection may idle: a stuck client cannot hold the server

    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = Request(
            self.command,
            unquote(urlsplit(self.path).path),
            {k.lower(): v for k, v in self.headers.items()},
            body,
        )
        status, payload, headers = self.server.hub.answer(request)  # type: ignore[attr-defined]
        raw = isinstance(payload, bytes)
        data = payload if raw else json.dumps(payload).encode()
        kind = "application/octet-stream" if raw else "application/json"
        self.send_response(status)
        for key, value in {
            "Content-Type": kind,
            "Content-Length": str(len(data)),
            **headers,
        }.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = _serve

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass


@contextmanager
def serve_stand_in() -> Iterator[StandInHub]:
    """The stand-in Hub on a free port of 127.0.0.1, shut down on exit."""
    state = StandInHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.hub = state  # type: ignore[attr-defined]
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
