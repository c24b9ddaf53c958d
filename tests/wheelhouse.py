"""A local wheel cache made from this test environment's installed packages, so that a test host can run
`pip install` (with PIP_NO_INDEX and PIP_FIND_LINKS) without a registry and without downloading anything.

An installed distribution is a wheel unpacked: its files under site-packages, listed in its RECORD, and its
WHEEL and metadata files in its .dist-info. Zipping them back (less the installer's own marks) gives a wheel
that pip installs like the original; console scripts are recreated from entry_points.txt."""

from __future__ import annotations

import re
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement

# What an installer adds to a .dist-info; a wheel carries none of them (RECORD is rewritten).
INSTALLER_FILES = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}


def closure(names: list[str]) -> dict[str, Distribution]:
    """The installed distributions ``names`` need, by normalized name, following their requirements (with
    extras) as installed here; requirements for other platforms or Python versions are skipped."""
    found: dict[str, Distribution] = {}
    todo: list[tuple[str, set[str]]] = [(n, set()) for n in names]
    while todo:
        name, wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found and not wanted:
            continue
        try:
            dist = found.get(key) or distribution(name)
        except PackageNotFoundError:
            continue
        found[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                todo.append((req.name, set(req.extras)))
    return found


def repack(dist: Distribution, dest: Path) -> Path:
    """Zip one installed distribution back into ``dest`` as a wheel."""
    site = Path(dist.locate_file(""))
    info = site / next(f for f in dist.files if f.name == "METADATA").parent
    tags = [
        line.split(":", 1)[1].strip() for line in (info / "WHEEL").read_text().splitlines() if line.startswith("Tag:")
    ]
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    # A wheel for several tags names each part's set, dot-joined (py2.py3-none-any).
    tag = "-".join(".".join(dict.fromkeys(t.split("-")[i] for t in tags)) for i in range(3))
    wheel = dest / f"{name}-{dist.version}-{tag}.whl"
    files = [
        f
        for f in dist.files or []
        if not str(f).startswith("..")
        and f.name != "__pycache__"
        and "__pycache__" not in f.parts
        and not (f.parent.name == info.name and f.name in INSTALLER_FILES)
    ]
    record = f"{info.name}/RECORD"
    # Stored, not deflated: this cache lives for one test, and compressing torch would take longer than the install.
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for f in files:
            if (site / f).is_file():
                z.write(site / f, str(f))
        z.writestr(record, "".join(f"{f},,\n" for f in files) + f"{record},,\n")
    return wheel


def build(dest: Path, names: list[str], leave_out: set[str]) -> list[Path]:
    """Wheels of ``names`` and everything they need, as installed here, less ``leave_out``, into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    return [repack(d, dest) for key, d in closure(names).items() if key not in leave_out]
