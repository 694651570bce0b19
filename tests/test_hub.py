"""`publish_export` against a local stand-in for the Hugging Face Hub, at the HTTP level.

The real Hub is unreachable from the machines these tests run on (no network but package
registries), so a small `ThreadingHTTPServer` on 127.0.0.1 implements the routes huggingface_hub
calls for create_repo, create_branch and an upload_folder of small files (xet disabled, every file
"regular" upload mode): it records each request and keeps repos and branches, so a commit to a
missing repo or branch fails as on the Hub. Tests check the exact request sequence and payloads,
that nothing is sent when a local check fails, and that the token never shows in errors or logs.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re
import shutil
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
from huggingface_hub import constants

from gsm_train import cli
from gsm_train.config import GSMConfig
from gsm_train.export import export_adapter
from gsm_train.hub import DEFAULT_COMMIT_MESSAGE, PublishError, publish_export
from gsm_train.model_zoo import tiny_model
from gsm_train.modules import inject_gsm

TOKEN = "hf_standInSecretToken0123456789"
REPO = "my-org/gsm-adapter"
_REPO_OP = re.compile(r"/api/models/(?P<repo>.+)/(?P<op>preupload|commit|branch)/(?P<rev>[^/]+)")


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
class StandInHub:
    """State of the stand-in: requests seen, repos with their branches, and injected failures."""

    url: str = ""
    requests: list[Request] = field(default_factory=list)
    repos: dict[str, set[str]] = field(default_factory=dict)
    fail: dict[str, int] = field(default_factory=dict)  # route name -> HTTP status to answer
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def routes(self) -> list[tuple[str, str]]:
        return [(r.method, r.path) for r in self.requests]

    def answer(self, request: Request) -> tuple[int, dict, dict[str, str]]:
        """(status, JSON body, extra headers) for a request; records it first."""
        with self.lock:
            self.requests.append(request)
            route, found = self._route(request)
            if route in self.fail:
                # Echo the credentials, as a careless server might: the client must redact them.
                message = f"stand-in failure on {route} (Authorization: {request.headers.get('authorization')})"
                return self.fail[route], {"error": message, "errors": [{"message": message}]}, {}
            return found()

    def _route(self, request: Request) -> tuple[str, Any]:
        if request.method == "POST" and request.path == "/api/repos/create":
            return "create", lambda: self._create(request.json())
        if request.method == "POST" and request.path == "/api/validate-yaml":
            return "validate-yaml", lambda: (200, {"errors": [], "warnings": []}, {})
        match = _REPO_OP.fullmatch(request.path)
        if request.method == "POST" and match:
            repo, op, rev = match["repo"], match["op"], match["rev"]
            return op, lambda: self._repo_op(repo, op, rev, request)
        return "unknown", lambda: (404, {"error": f"no route {request.method} {request.path}"}, {})

    def _create(self, payload: dict) -> tuple[int, dict, dict[str, str]]:
        repo = "/".join(p for p in (payload.get("organization"), payload["name"]) if p)
        if repo in self.repos:
            return 409, {"error": "You already created this model repo", "url": f"{self.url}/{repo}"}, {}
        self.repos[repo] = {"main"}
        return 200, {"url": f"{self.url}/{repo}"}, {}

    def _repo_op(self, repo: str, op: str, rev: str, request: Request) -> tuple[int, dict, dict[str, str]]:
        if repo not in self.repos:
            return 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"}
        branches = self.repos[repo]
        if op == "branch":
            if rev in branches:
                return 409, {"error": "Reference already exists"}, {}
            branches.add(rev)
            return 200, {}, {}
        if rev not in branches:
            return 404, {"error": "Invalid rev id"}, {"X-Error-Code": "RevisionNotFound"}
        if op == "preupload":
            paths = [f["path"] for f in request.json()["files"]]
            files = [{"path": path, "uploadMode": "regular", "shouldIgnore": False} for path in paths]
            return 200, {"files": files}, {}
        oid = hashlib.sha1(request.body).hexdigest()
        return 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}, {}


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # seconds a connection may idle: a stuck client cannot hold the server

    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        request = Request(self.command, unquote(urlsplit(self.path).path),
                          {k.lower(): v for k, v in self.headers.items()}, body)
        status, payload, headers = self.server.hub.answer(request)  # type: ignore[attr-defined]
        data = json.dumps(payload).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_HEAD = _serve

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest output clean
        pass


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Online, no xet, no telemetry, and no token anywhere unless a test sets one."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    # huggingface_hub reads these at import time: patch the resolved values too.
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    """The stand-in Hub on a free port of 127.0.0.1, shut down at teardown."""
    state = StandInHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.hub = state  # type: ignore[attr-defined]
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def built_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig())
    return export_adapter(model, tmp_path_factory.mktemp("built") / "export", base_name="tiny-llama")


@pytest.fixture
def export(built_export: Path, tmp_path: Path) -> Path:
    """A fresh copy of a valid export that a test may damage."""
    return Path(shutil.copytree(built_export, tmp_path / "export"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _committed(request: Request) -> tuple[dict, dict[str, bytes]]:
    """The commit header and {path: bytes} of the files a commit request carries."""
    lines = request.ndjson()
    assert lines[0]["key"] == "header"
    assert all(line["key"] == "file" and line["value"]["encoding"] == "base64" for line in lines[1:])
    return lines[0]["value"], {line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in lines[1:]}


def _assert_secret(err: BaseException) -> None:
    text = "".join(traceback.format_exception(err))
    assert TOKEN not in text and TOKEN not in repr(err)


def test_publish_creates_repo_and_commits_export_once(hub: StandInHub, export: Path) -> None:
    url = publish_export(export, REPO, private=True, token=TOKEN, endpoint=hub.url)

    models = f"/api/models/{REPO}"
    # huggingface_hub checks the model card's YAML twice (upload_folder, then create_commit)
    assert hub.routes == [("POST", "/api/repos/create"), ("POST", "/api/validate-yaml"), ("POST", "/api/validate-yaml"),
                          ("POST", f"{models}/preupload/main"), ("POST", f"{models}/commit/main")]
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub.requests)
    create = hub.requests[0].json()
    assert (create["organization"], create["name"], create["visibility"], create["type"]) == (
        "my-org", "gsm-adapter", "private", "model")
    assert hub.requests[1].json()["content"] == (export / "README.md").read_text()
    assert {f["path"] for f in hub.requests[3].json()["files"]} == set(_files(export))
    commit = hub.requests[4]
    assert commit.headers["content-type"] == "application/x-ndjson"
    header, files = _committed(commit)
    assert header["summary"] == DEFAULT_COMMIT_MESSAGE
    assert files == _files(export)
    assert set(files) == {"adapter_model.safetensors", "gsm_config.json", "README.md", "training_args.json"}
    assert url == f"{hub.url}/{REPO}/commit/{hashlib.sha1(commit.body).hexdigest()}"


def test_publish_again_to_existing_public_repo(hub: StandInHub, export: Path) -> None:
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url, commit_message="second stage")

    assert hub.requests[0].json()["visibility"] == "public"
    assert [r.path for r in hub.requests].count(f"/api/models/{REPO}/commit/main") == 2
    assert _committed(hub.requests[-1])[0]["summary"] == "second stage"


def test_revision_creates_branch_then_commits_to_it(hub: StandInHub, export: Path) -> None:
    publish_export(export, REPO, revision="dev", token=TOKEN, endpoint=hub.url)

    models = f"/api/models/{REPO}"
    assert hub.routes == [("POST", "/api/repos/create"), ("POST", f"{models}/branch/dev"),
                          ("POST", "/api/validate-yaml"), ("POST", "/api/validate-yaml"),
                          ("POST", f"{models}/preupload/dev"),
                          ("POST", f"{models}/commit/dev")]
    assert hub.repos[REPO] == {"main", "dev"}
    assert _committed(hub.requests[-1])[1] == _files(export)


def test_token_from_env_then_stored_login(hub: StandInHub, export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    publish_export(export, REPO, endpoint=hub.url)
    first = len(hub.requests)
    monkeypatch.delenv("HF_TOKEN")
    Path(constants.HF_TOKEN_PATH).write_text("hf_storedLoginToken")
    publish_export(export, REPO, endpoint=hub.url)

    auth = [r.headers["authorization"] for r in hub.requests]
    assert set(auth[:first]) == {f"Bearer {TOKEN}"}
    assert set(auth[first:]) == {"Bearer hf_storedLoginToken"}


BAD_REPO_IDS = ["a/b/c", "bad name", "x--y", "org/x..y", "-lead", "org/trail.", "org/", "", "n" * 97]


@pytest.mark.parametrize("repo_id", BAD_REPO_IDS)
def test_bad_repo_id_refused_before_any_request(hub: StandInHub, export: Path, repo_id: str) -> None:
    with pytest.raises(PublishError, match=re.escape(f"repo id {repo_id!r}") + ".*Fix: give ORG/NAME"):
        publish_export(export, repo_id, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_no_token_says_how_to_log_in(hub: StandInHub, export: Path) -> None:
    with pytest.raises(PublishError, match=r"no Hugging Face token.*hf auth login.*HF_TOKEN"):
        publish_export(export, REPO, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize("damage", ["delete gsm_config.json", "delete adapter_model.safetensors", "corrupt config"])
def test_invalid_export_refused_before_any_request(hub: StandInHub, export: Path, damage: str) -> None:
    if damage == "corrupt config":
        (export / "gsm_config.json").write_text("{not json")
    else:
        (export / damage.split()[1]).unlink()
    refused = r"refusing to publish an export that does not validate: .*(gsm_config|adapter_model)"
    with pytest.raises(PublishError, match=refused):
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_offline_mode_is_named(hub: StandInHub, export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PublishError, match="HF_HUB_OFFLINE"):
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize(("route", "status", "fix"), [
    ("create", 401, "hf auth login"),
    ("create", 403, "write access"),
    ("branch", 500, "retry later"),
    ("commit", 500, "retry later"),
])
def test_hub_http_error_names_status_and_hides_token(
    hub: StandInHub, export: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    route: str, status: int, fix: str,
) -> None:
    hub.fail[route] = status
    monkeypatch.setattr(constants, "HF_DEBUG", True)  # log every request, as curl commands, too
    caplog.set_level(logging.DEBUG, logger="huggingface_hub")
    hf_logger = logging.getLogger("huggingface_hub")  # does not propagate: listen to it directly
    hf_logger.addHandler(caplog.handler)
    try:
        with pytest.raises(PublishError) as info:
            publish_export(export, REPO, revision="dev", token=TOKEN, endpoint=hub.url)
    finally:
        hf_logger.removeHandler(caplog.handler)

    message = str(info.value)
    assert f"HTTP {status}: stand-in failure on {route}" in message and "Bearer <token>" in message
    assert fix in message.split("Fix: ", 1)[1]
    _assert_secret(info.value)
    assert "Send: curl" in caplog.text and TOKEN not in caplog.text
    if route != "commit":
        assert not any("/commit/" in r.path for r in hub.requests)


def test_rejected_model_card_metadata(hub: StandInHub, export: Path) -> None:
    hub.fail["validate-yaml"] = 400
    with pytest.raises(PublishError, match=r"Invalid metadata in README.md.*Fix: correct README.md") as info:
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    _assert_secret(info.value)
    assert not any("/commit/" in r.path for r in hub.requests)


def test_cli_publish(hub: StandInHub, export: Path, monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli.main(["publish", str(export), "--repo-id", REPO, "--private", "--revision", "dev",
                     "--endpoint", hub.url]) == 0
    assert hub.requests[0].json()["visibility"] == "private"
    assert _committed(hub.requests[-1])[1] == _files(export)
    assert hub.requests[-1].path == f"/api/models/{REPO}/commit/dev"

    hub.requests.clear()
    assert cli.main(["publish", str(export), "--repo-id", "x--y", "--endpoint", hub.url]) == 2
    assert "'x--y'" in capsys.readouterr().err and hub.requests == []
