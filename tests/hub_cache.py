"""A model in huggingface_hub's cache, laid out exactly as the hub client writes a download, for tests that
resolve hub ids offline."""

import hashlib
import os
import shutil
from pathlib import Path

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
