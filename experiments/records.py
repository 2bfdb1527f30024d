"""Where an experiment's run records are: a new run's folder, else the committed archive.

New runs write to the top-level `results/<name>/` (ignored by git). The committed runs live
out of the code tree, one archive per experiment: `docs/records/<name>.tar.xz` (what each
holds, the command and the hardware: docs/records/README.md). The first read of an archive
extracts it once into `results/.records/<name>/`; a changed archive is extracted again.

    from experiments.records import records_dir
    summary = records_dir("gpu-grid") / "summary.csv"

Standard library only, so the analysis scripts that need no pdserve can use it anywhere.
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
ARCHIVES = ROOT / "docs" / "records"
CACHE = RESULTS / ".records"
STAMP = ".archive-sha256"


def archive_path(name: str) -> Path:
    return ARCHIVES / f"{name}.tar.xz"


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _extract(archive: Path, name: str, cache: Path) -> Path:
    target = cache / name
    digest = _digest(archive)
    stamp = target / STAMP
    if stamp.is_file() and stamp.read_text().strip() == digest:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=f".{name}-") as tmp:
        with tarfile.open(archive, "r:xz") as tar:
            for member in tar.getmembers():
                # the archives hold plain files and folders under <name>/, nothing else
                parts = Path(member.name).parts
                if not (member.isfile() or member.isdir()) or not parts or parts[0] != name or ".." in parts:
                    raise ValueError(f"{archive}: unexpected member {member.name!r}")
            tar.extractall(tmp)
        (Path(tmp) / name / STAMP).write_text(digest + "\n")
        if target.exists():
            shutil.rmtree(target)
        (Path(tmp) / name).rename(target)
    return target


def records_dir(name: str, *, results: Path = RESULTS, archives: Path = ARCHIVES) -> Path:
    """The folder holding experiment `name`'s records: `results/<name>/` when a new run is
    there, else the committed archive `docs/records/<name>.tar.xz`, extracted once into
    `results/.records/<name>/`. FileNotFoundError (naming both places) when neither exists."""
    fresh = results / name
    if fresh.is_dir() and any(fresh.iterdir()):
        return fresh
    archive = archives / f"{name}.tar.xz"
    if archive.is_file():
        return _extract(archive, name, results / ".records")
    raise FileNotFoundError(f"no records for experiment {name!r}: neither a run in {fresh} "
                            f"nor an archive {archive}")


def resolve(arg: str | Path) -> Path:
    """A command-line argument naming records: an existing folder as given, else an
    experiment's name (`gpu-grid`, `results/gpu-grid`) looked up with records_dir."""
    path = Path(arg)
    if path.is_dir():
        return path
    return records_dir(path.name)


def label(path: Path) -> str:
    """`path` as a report names it: relative to the repository, with an extracted archive's
    folder named by its archive (`docs/records/<name>.tar.xz/...`)."""
    path = Path(path).resolve()
    try:
        inner = path.relative_to(CACHE.resolve())
        return str(Path("docs/records") / f"{inner.parts[0]}.tar.xz" / Path(*inner.parts[1:]))
    except (ValueError, IndexError):
        pass
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)
