"""Publishing to and loading from the Hub, against the local HTTP stand-in of tests/hub_stand_in.py.

The real Hub is unreachable here; the stand-in answers the routes huggingface_hub calls, so these
tests check the exact requests and payloads of `publish_export`, that nothing is sent when a local
check fails, that the token never shows in errors or logs, that the model card passes
huggingface_hub's parser and the stand-in's base_model check, and that a published export loads back
by repo id (`GSMModel.from_pretrained`, `load_gsm`) at a pinned revision with the logits of the
local export.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hub_stand_in import Request, StandInHub, serve_stand_in
from huggingface_hub import HfApi, ModelCard, ModelCardData, constants, snapshot_download
from huggingface_hub.utils import validate_repo_id
from run_helpers import child_env
from safetensors.torch import load, load_file

from gsm_train import GSMModel, cli
from gsm_train.attention import gsm_state_dict, inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.export.adapter_format import CARD_FILE, CONFIG_FILE, GSM_FILE, ExportError
from gsm_train.export.hub import DEFAULT_COMMIT_MESSAGE, PublishError, publish_export
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model

REPO_ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_standInSecretToken0123456789"
REPO = "my-org/gsm-adapter"
EXPORT_NAMES = {CARD_FILE, CONFIG_FILE, GSM_FILE, "training_args.json"}
RECIPE = {
    "stage": "gate_warmup",
    "data": {"train": {"path": "hf://wikitext:wikitext-2-raw-v1@train"}},
    "train": {"steps": 8},
}


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Online, no xet, no telemetry, a fresh Hub cache, and no token anywhere unless a test sets
    one."""
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_OIDC_RESOURCE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "hf_home"
    home.mkdir()
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    # huggingface_hub reads these at import time: patch the resolved values too.
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    with serve_stand_in() as state:
        yield state


@pytest.fixture
def endpoint(hub: StandInHub, monkeypatch: pytest.MonkeyPatch) -> str:
    """HF_ENDPOINT pointing at the stand-in, for downloads (read at import: patched where it was
    read)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        constants,
        "HUGGINGFACE_CO_URL_TEMPLATE",
        hub.url + "/{repo_id}/resolve/{revision}/{filename}",
    )
    return hub.url


def _trained(seed: int) -> torch.nn.Module:
    """A tiny model with GSM modules whose tensors differ from a fresh injection (by `seed`)."""
    model = tiny_model("llama")
    inject_gsm(
        model,
        GSMConfig.model_validate({"sparse_attention": {"top_k": 8, "k_min": 8}}),
        mode="sparse",
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in gsm_state_dict(model).values():
            if tensor.is_floating_point():
                tensor.add_(0.05 * torch.randn(tensor.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def built_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_adapter(
        _trained(0),
        tmp_path_factory.mktemp("built") / "export",
        base_name="tiny-llama",
        recipe=RECIPE,
        metrics={"ppl": 12.5, "gate_mass_k8": 0.9},
    )


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


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(48).reshape(2, 24) * 5 % 256
    with torch.no_grad():
        return model.eval()(ids).logits


def test_publish_creates_repo_and_commits_export_once(hub: StandInHub, export: Path) -> None:
    url = publish_export(export, REPO, private=True, token=TOKEN, endpoint=hub.url)

    models = f"/api/models/{REPO}"
    assert hub.routes == [
        ("POST", "/api/repos/create"),
        ("POST", "/api/validate-yaml"),
        ("POST", f"{models}/preupload/main"),
        ("POST", f"{models}/commit/main"),
    ]
    assert all(r.headers["authorization"] == f"Bearer {TOKEN}" for r in hub.requests)
    create = hub.requests[0].json()
    assert (create["organization"], create["name"], create["visibility"], create["type"]) == (
        "my-org",
        "gsm-adapter",
        "private",
        "model",
    )
    header, files = _committed(hub.requests[3])
    assert header["summary"] == DEFAULT_COMMIT_MESSAGE
    assert hub.requests[1].json()["content"] == files[CARD_FILE].decode()
    assert set(files) == EXPORT_NAMES and {f["path"] for f in hub.requests[2].json()["files"]} == EXPORT_NAMES
    local = _files(export)
    assert all(files[name] == local[name] for name in EXPORT_NAMES - {CARD_FILE})
    # the card the export wrote, with the repo id in its loading snippet
    assert files[CARD_FILE] == local[CARD_FILE].replace(b"PATH/TO/THIS/FOLDER", REPO.encode()).replace(
        b"name: GSM adapter for tiny-llama", f"name: {REPO}".encode()
    )
    commit = hub.requests[3]
    assert url == f"{hub.url}/{REPO}/commit/{hashlib.sha1(commit.body).hexdigest()}"


def test_publish_uploads_only_the_exports_own_files(hub: StandInHub, export: Path) -> None:
    (export / ".env").write_text("HF_TOKEN=hf_secret\n")
    (export / "notes.txt").write_text("private notes")
    (export / "cache").mkdir()
    (export / "cache" / "x.bin").write_bytes(b"\0")
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert set(_committed(hub.requests[-1])[1]) == EXPORT_NAMES


def test_publish_refuses_a_linked_export_file(hub: StandInHub, export: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.safetensors"
    (export / GSM_FILE).rename(outside)
    (export / GSM_FILE).symlink_to(outside)
    with pytest.raises(PublishError, match=f"{GSM_FILE} is a link"):
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_publish_again_to_existing_public_repo(hub: StandInHub, export: Path) -> None:
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url, commit_message="second stage")

    assert hub.requests[0].json()["visibility"] == "public"
    assert [r.path for r in hub.requests].count(f"/api/models/{REPO}/commit/main") == 2
    assert _committed(hub.requests[-1])[0]["summary"] == "second stage"


def test_revision_creates_branch_then_commits_to_it(hub: StandInHub, export: Path) -> None:
    publish_export(export, REPO, revision="dev", token=TOKEN, endpoint=hub.url)

    models = f"/api/models/{REPO}"
    assert hub.routes == [
        ("POST", "/api/repos/create"),
        ("POST", f"{models}/branch/dev"),
        ("POST", "/api/validate-yaml"),
        ("POST", f"{models}/preupload/dev"),
        ("POST", f"{models}/commit/dev"),
    ]
    assert set(hub.repos[REPO].branches) == {"main", "dev"}
    assert set(_committed(hub.requests[-1])[1]) == EXPORT_NAMES


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


BAD_REPO_IDS = [
    "a/b/c",
    "bad name",
    "x--y",
    "org/x..y",
    "-lead",
    "org/trail.",
    "org/",
    "",
    "n" * 97,
]


@pytest.mark.parametrize("repo_id", BAD_REPO_IDS)
def test_bad_repo_id_refused_before_any_request(hub: StandInHub, export: Path, repo_id: str) -> None:
    with pytest.raises(PublishError, match=f"repo id {repo_id!r}".replace("(", r"\(") + ".*Fix: give ORG/NAME"):
        publish_export(export, repo_id, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_no_token_says_how_to_log_in(hub: StandInHub, export: Path) -> None:
    with pytest.raises(PublishError, match=r"no Hugging Face token.*hf auth login.*HF_TOKEN"):
        publish_export(export, REPO, endpoint=hub.url)
    assert hub.requests == []


@pytest.mark.parametrize("damage", ["delete gsm_config.json", f"delete {GSM_FILE}", "corrupt config"])
def test_invalid_export_refused_before_any_request(hub: StandInHub, export: Path, damage: str) -> None:
    if damage == "corrupt config":
        (export / CONFIG_FILE).write_text("{not json")
    else:
        (export / damage.split()[1]).unlink()
    refused = r"refusing to publish an export that does not validate: .*(gsm_config|gsm_modules)"
    with pytest.raises(PublishError, match=refused):
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_offline_mode_is_named(hub: StandInHub, export: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PublishError, match="HF_HUB_OFFLINE"):
        publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_unreachable_endpoint_is_one_clear_error(
    export: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with serve_stand_in() as gone:
        url = gone.url  # a port that was just free and now has no server
    with pytest.raises(PublishError, match=f"could not reach the Hub at {url}.*Fix: check --endpoint") as info:
        publish_export(export, REPO, token=TOKEN, endpoint=url)
    _assert_secret(info.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert cli.main(["publish", str(export), "--repo-id", REPO, "--endpoint", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: publishing") and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("route", "status", "fix"),
    [
        ("create", 401, "hf auth login"),
        ("create", 403, "write access"),
        ("branch", 500, "retry later"),
        ("commit", 500, "retry later"),
    ],
)
def test_hub_http_error_names_status_and_hides_token(
    hub: StandInHub,
    export: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    route: str,
    status: int,
    fix: str,
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


def test_card_names_the_bases_hub_id_and_passes_the_hubs_checks(hub: StandInHub, tmp_path: Path) -> None:
    """An export of the built-in smollm2-135m (its identity is what matters here, so a tiny model
    stands for it): the card's base_model is the alias's Hub id, which the stand-in, like the Hub,
    requires to be a model repo; huggingface_hub's parser reads it back, with the metrics as a
    model-index."""
    folder = export_adapter(
        _trained(0),
        tmp_path / "export",
        base_name="smollm2-135m",
        recipe=RECIPE,
        metrics={"ppl": 12.5, "gate_mass_k8": 0.9, "diverged": float("nan")},
    )
    publish_export(folder, REPO, token=TOKEN, endpoint=hub.url)
    card_file = tmp_path / "published.md"
    card_file.write_bytes(_committed(hub.requests[-1])[1][CARD_FILE])

    card = ModelCard.load(card_file, ignore_metadata_errors=False)
    data = card.data.to_dict()
    assert (
        data["base_model"],
        data["base_model_relation"],
        data["license"],
        data["library_name"],
        data["pipeline_tag"],
    ) == (
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "adapter",
        "apache-2.0",
        "gsm-train",
        "text-generation",
    )
    validate_repo_id(data["base_model"])
    assert data["datasets"] == ["wikitext"] and {"gsm", "sparse-attention"} <= set(data["tags"])
    parsed = ModelCardData(**data)
    assert parsed.model_name == REPO
    assert {(r.metric_type, r.metric_value) for r in parsed.eval_results} == {
        ("perplexity", 12.5),
        ("gate_mass_k8", 0.9),
    }
    assert f'GSMModel.from_pretrained("{REPO}")' in card.text


def test_a_local_base_needs_its_hub_id_to_publish(hub: StandInHub, tmp_path: Path) -> None:
    base = tmp_path / "my-base"
    tiny_model("llama").save_pretrained(base)
    folder = export_adapter(_trained(0), tmp_path / "export", base_name=str(base))
    with pytest.raises(PublishError, match="whose Hub id is not known.*--base-model-id"):
        publish_export(folder, REPO, token=TOKEN, endpoint=hub.url)
    assert hub.requests == []

    publish_export(folder, REPO, token=TOKEN, endpoint=hub.url, base_model_id="my-org/local-base")
    files = _committed(hub.requests[-1])[1]
    assert json.loads(files[CONFIG_FILE])["base_model"]["hub_id"] == "my-org/local-base"
    assert "base_model: my-org/local-base" in files[CARD_FILE].decode()
    assert json.loads((folder / CONFIG_FILE).read_text())["base_model"]["hub_id"] is None, "the export is unchanged"


def test_an_edited_card_is_published_as_written(hub: StandInHub, export: Path) -> None:
    card = (export / CARD_FILE).read_text() + "\nTrained for the demo on 2026-12-02.\n"
    (export / CARD_FILE).write_text(card)
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    assert _committed(hub.requests[-1])[1][CARD_FILE].decode() == card


def test_cli_publish(
    hub: StandInHub,
    export: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert (
        cli.main(
            [
                "publish",
                str(export),
                "--repo-id",
                REPO,
                "--private",
                "--revision",
                "dev",
                "--endpoint",
                hub.url,
            ]
        )
        == 0
    )
    assert hub.requests[0].json()["visibility"] == "private"
    assert set(_committed(hub.requests[-1])[1]) == EXPORT_NAMES
    assert hub.requests[-1].path == f"/api/models/{REPO}/commit/dev"

    hub.requests.clear()
    assert cli.main(["publish", str(export), "--repo-id", "x--y", "--endpoint", hub.url]) == 2
    assert "'x--y'" in capsys.readouterr().err and hub.requests == []


def test_from_pretrained_by_repo_id_with_hf_endpoint_matches_the_local_export(
    hub: StandInHub, export: Path, tmp_path: Path
) -> None:
    """A new process that knows only HF_ENDPOINT and the repo id loads base + adapter through
    snapshot_download and computes the logits of the export it was published from."""
    publish_export(export, REPO, token=TOKEN, endpoint=hub.url)
    out = tmp_path / "logits.pt"
    code = (
        "import sys, torch; from gsm_train import GSMModel; sys.path.insert(0, 'tests'); "
        "from test_hub import _logits; "
        f"gsm = GSMModel.from_pretrained({REPO!r}); torch.save(_logits(gsm.model), {str(out)!r})"
    )
    env = child_env(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "fresh_home"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    local = GSMModel.from_pretrained(export)
    assert torch.equal(torch.load(out), _logits(local.model))
    assert ("GET", f"/api/models/{REPO}/revision/main") in hub.routes
    assert any(
        method == "GET" and path.endswith(f"/resolve/{hub.repos[REPO].branches['main']}/{GSM_FILE}")
        for method, path in hub.routes
    )


def test_revision_pinning_and_load_gsm_by_repo_id(hub: StandInHub, endpoint: str, tmp_path: Path) -> None:
    first = export_adapter(_trained(1), tmp_path / "first", base_name="tiny-llama")
    second = export_adapter(_trained(2), tmp_path / "second", base_name="tiny-llama")
    publish_export(first, REPO, token=TOKEN)
    pinned = hub.repos[REPO].branches["main"]
    publish_export(second, REPO, token=TOKEN)
    publish_export(first, REPO, token=TOKEN, revision="stable")  # a branch starts at main's head: `second`

    newest, at_commit = (
        GSMModel.from_pretrained(REPO),
        GSMModel.from_pretrained(REPO, revision=pinned),
    )
    assert torch.equal(_logits(newest.model), _logits(GSMModel.from_pretrained(second).model))
    assert torch.equal(_logits(at_commit.model), _logits(GSMModel.from_pretrained(first).model))
    assert at_commit.folder.name == pinned
    model = tiny_model("llama")
    load_gsm(model, REPO, revision="stable")
    assert torch.equal(_logits(model), _logits(at_commit.model))


def test_push_to_hub_publishes_the_export_a_model_came_from(hub: StandInHub, endpoint: str, export: Path) -> None:
    """An unchanged model pushes the tensors of the export it came from (tests/test_peft_parity.py: a
    changed one pushes its changes)."""
    GSMModel.from_pretrained(export).push_to_hub(REPO, token=TOKEN)
    pushed = hub.repos[REPO].commits[hub.repos[REPO].branches["main"]]
    exported = load_file(str(export / GSM_FILE))
    assert set(pushed) == EXPORT_NAMES
    assert all(torch.equal(tensor, exported[name]) for name, tensor in load(pushed[GSM_FILE]).items())


@pytest.mark.parametrize(
    ("repo_id", "revision", "message"),
    [("my-org/missing", None, "no such Hub repo"), (REPO, "no-such-branch", "no such revision")],
)
def test_loading_a_missing_repo_or_revision_is_one_clear_error(
    hub: StandInHub, endpoint: str, export: Path, repo_id: str, revision: str | None, message: str
) -> None:
    publish_export(export, REPO, token=TOKEN)
    with pytest.raises(ExportError, match=message):
        GSMModel.from_pretrained(repo_id, revision=revision)


def test_loading_from_an_unreachable_hub_is_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with serve_stand_in() as gone:
        url = gone.url
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    with pytest.raises(ExportError, match=f"Hub repo {REPO}: could not be fetched.*ConnectError.*HF_ENDPOINT"):
        GSMModel.from_pretrained(REPO)


def test_a_base_from_the_hub_cache_is_recorded_and_loaded_back_by_id(
    hub: StandInHub, endpoint: str, tmp_path: Path
) -> None:
    """A base loaded from a folder of the Hub cache records its repo, commit and card license; once
    that folder is gone, from_pretrained fetches the base by that id at that commit."""
    base_repo = "my-org/local-base"
    staged = tmp_path / "staged"
    tiny_model("llama").save_pretrained(staged)
    byte_tokenizer().save_pretrained(staged)
    (staged / CARD_FILE).write_text("---\nlicense: mit\n---\n# a tiny base\n")
    HfApi(endpoint=hub.url, token=TOKEN).create_repo(base_repo)
    HfApi(endpoint=hub.url, token=TOKEN).upload_folder(folder_path=staged, repo_id=base_repo)
    commit = hub.repos[base_repo].branches["main"]
    cached = Path(snapshot_download(base_repo))
    assert cached.name == commit and "models--my-org--local-base" in cached.as_posix()

    folder = export_adapter(_trained(3), tmp_path / "export", base_name=str(cached))
    base = json.loads((folder / CONFIG_FILE).read_text())["base_model"]
    assert (base["hub_id"], base["revision"], base["license"]) == (base_repo, commit, "mit")
    publish_export(folder, REPO, token=TOKEN)  # no --base-model-id needed
    card = _committed(hub.requests[-1])[1][CARD_FILE].decode()
    assert f"base_model: {base_repo}" in card and "license: mit" in card

    shutil.rmtree(constants.HF_HUB_CACHE)  # the base folder the export names is gone
    gsm = GSMModel.from_pretrained(REPO)
    fetched = {
        path.rsplit("/", 1)[1]
        for method, path in hub.routes
        if method == "GET" and path.startswith(f"/{base_repo}/resolve/{commit}/")
    }
    assert {"config.json", "model.safetensors"} <= fetched
    local = GSMModel.from_pretrained(folder, base="tiny-llama")
    assert torch.equal(_logits(gsm.model), _logits(local.model))
