"""experiments/records.py on small hand-made archives: a new run wins, else the archive is
extracted once (again when it changes), and an archive with a stray member is refused."""

from __future__ import annotations

import io
import tarfile

import pytest

from experiments.records import STAMP, records_dir


def _archive(path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_the_archive_is_extracted_once_and_again_when_it_changes(tmp_path):
    results, archives = tmp_path / "results", tmp_path / "records"
    _archive(archives / "grid.tar.xz", {"grid/summary.csv": b"a,b\n1,2\n", "grid/runs/x.jsonl": b"{}\n"})
    path = records_dir("grid", results=results, archives=archives)
    assert path == results / ".records" / "grid"
    assert (path / "summary.csv").read_bytes() == b"a,b\n1,2\n" and (path / "runs" / "x.jsonl").read_bytes() == b"{}\n"
    (path / "analysis.md").write_text("kept")  # an analysis written next to the records stays
    assert records_dir("grid", results=results, archives=archives) == path
    assert (path / "analysis.md").read_text() == "kept"
    _archive(archives / "grid.tar.xz", {"grid/summary.csv": b"a,b\n3,4\n"})
    assert records_dir("grid", results=results, archives=archives) == path
    assert (path / "summary.csv").read_bytes() == b"a,b\n3,4\n" and not (path / "analysis.md").exists()
    assert sorted(p.name for p in path.iterdir()) == [STAMP, "summary.csv"]


def test_a_new_run_wins_over_the_archive(tmp_path):
    results, archives = tmp_path / "results", tmp_path / "records"
    _archive(archives / "grid.tar.xz", {"grid/summary.csv": b"old\n"})
    (results / "grid").mkdir(parents=True)
    assert records_dir("grid", results=results, archives=archives) != results / "grid"  # empty: not a run
    (results / "grid" / "summary.csv").write_text("new\n")
    assert records_dir("grid", results=results, archives=archives) == results / "grid"


def test_no_run_and_no_archive_names_both_places(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"grid.*results.*grid\.tar\.xz"):
        records_dir("grid", results=tmp_path / "results", archives=tmp_path / "records")


@pytest.mark.parametrize("member", ["other/summary.csv", "grid/../escape.txt"])
def test_a_member_outside_the_experiment_folder_is_refused(tmp_path, member):
    _archive(tmp_path / "records" / "grid.tar.xz", {member: b"x"})
    with pytest.raises(ValueError, match="unexpected member"):
        records_dir("grid", results=tmp_path / "results", archives=tmp_path / "records")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "results" / ".records" / "grid").exists()
