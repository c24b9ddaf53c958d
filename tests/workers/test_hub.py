"""Hub ids resolve through huggingface_hub's own cache, laid out here exactly as the hub client writes it, with
HF_HUB_OFFLINE=1: no network, the real lookup code."""

from pathlib import Path

import pytest

from tests.hub_cache import COMMIT, put_in_hub_cache
from workers.hub import resolve_model


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
    with pytest.raises(FileNotFoundError, match="'/no/such/model' does not exist: no such directory"):
        resolve_model("/no/such/model")
    with pytest.raises(FileNotFoundError, match="'./models/x' does not exist"):
        resolve_model("./models/x")
