"""Hub ids resolve through huggingface_hub's own cache, laid out here exactly as the hub client writes it, with
HF_HUB_OFFLINE=1: no network, the real lookup code."""

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from workers.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(cache: Path, repo_id: str, model_dir: str, revision: str = "main") -> Path:
    """`model_dir`'s files as the hub client stores a download of `repo_id`: content-addressed blobs, a snapshot
    of relative symlinks per commit, and a ref naming the commit. Returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in Path(model_dir).iterdir():
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / revision).write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An HF_HOME of the test's own, offline; huggingface_hub reads both when it is imported, so its constants
    are pointed there too."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_a_cached_hub_id_resolves_to_its_snapshot(offline_hub, tiny_model_dir):
    snapshot = put_in_hub_cache(offline_hub, "tiny-org/tiny-llama", tiny_model_dir("llama"))
    path = resolve_model("tiny-org/tiny-llama")
    assert Path(path) == snapshot
    assert (Path(path) / "config.json").read_text() == (Path(tiny_model_dir("llama")) / "config.json").read_text()
    assert resolve_model("tiny-org/tiny-llama", revision=COMMIT) == path


def test_a_download_dir_is_the_cache_it_names(offline_hub, tiny_model_dir, tmp_path):
    shared = tmp_path / "shared-models"
    snapshot = put_in_hub_cache(shared, "tiny-org/tiny-llama", tiny_model_dir("llama"))
    assert Path(resolve_model("tiny-org/tiny-llama", download_dir=str(shared))) == snapshot
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache"):
        resolve_model("tiny-org/tiny-llama")  # not in the default cache


def test_an_uncached_id_offline_names_the_id_and_the_cache(offline_hub):
    with pytest.raises(FileNotFoundError) as e:
        resolve_model("nobody/no-model", revision="v2")
    assert "'nobody/no-model' at revision 'v2' is not in the Hugging Face cache at " + str(offline_hub) in str(e.value)


def test_a_directory_is_taken_as_it_is_and_a_missing_one_named(tiny_model_dir):
    assert resolve_model(tiny_model_dir("llama")) == tiny_model_dir("llama")
    with pytest.raises(FileNotFoundError, match="'/no/such/model': no such directory"):
        resolve_model("/no/such/model")
    with pytest.raises(FileNotFoundError, match="'./models/x': no such directory"):
        resolve_model("./models/x")
