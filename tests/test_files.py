"""pose_mlx.files: a file or folder is at its place whole (the new content) or as it was, never half-written, and
nothing temporary is left beside it, also when the writer or the final rename fails."""

import fnmatch
import os

import pytest

from pose_mlx import files


def _tree(folder):
    """{relative path: bytes} of every file under `folder`."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _fail_rename_of(source, monkeypatch):
    """Make os.replace fail (as on a full or read-only file system) when it moves `source`; others go through."""
    real = os.replace

    def replace(src, dst):
        if os.fspath(src) == os.fspath(source):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("content, expected", [("naïve\n", "naïve\n".encode("utf-8")), (b"\x00\xff", b"\x00\xff")],
                         ids=["text", "bytes"])
def test_write_atomic_writes_text_as_utf8_and_bytes_as_they_are(tmp_path, content, expected):
    path = tmp_path / "a.json"
    assert files.write_atomic(path, content) == path
    assert path.read_bytes() == expected
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_write_atomic_hands_a_writer_a_hidden_sibling_with_the_suffix(tmp_path):
    """The writer gets a hidden name in the same folder with the target's suffix (writers such as
    mx.save_safetensors and savefig go by it), which the run folder's leftover sweep (".*.tmp*") matches."""
    seen = []

    def writer(tmp):
        seen.append(tmp)
        tmp.write_bytes(b"written by the writer")

    path = tmp_path / "weights-000010.safetensors"
    files.write_atomic(path, writer)
    (tmp,) = seen
    assert tmp.parent == tmp_path and tmp.name.startswith(".") and tmp.suffix == ".safetensors"
    assert fnmatch.fnmatch(tmp.name, ".*.tmp*")
    assert path.read_bytes() == b"written by the writer" and not tmp.exists()


def test_write_atomic_replaces_an_existing_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("old")
    files.write_atomic(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text("old\n")

    def writer(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.write_atomic(path, writer)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]


@pytest.mark.parametrize("existing", [True, False], ids=["over-a-file", "new-file"])
def test_a_failing_rename_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch, existing):
    path = tmp_path / "run.json"
    if existing:
        path.write_text("old")

    def replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(path, "new")
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == (["run.json"] if existing else [])
    assert not existing or path.read_text() == "old"


def _folder(path, files_):
    path.mkdir()
    for name, data in files_.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)
    return path


def test_sibling_is_a_fresh_hidden_name_beside_the_folder(tmp_path):
    """Fresh on every call, and of the shape the run's leftover sweep removes (".<name>.<kind>-*")."""
    out = tmp_path / "model.v2"
    names = {files.sibling(out, "export") for _ in range(50)}
    assert len(names) == 50
    for name in names:
        assert name.parent == tmp_path and fnmatch.fnmatch(name.name, ".model.v2.export-*")
        assert str(os.getpid()) in name.name


def test_replace_dir_moves_a_folder_to_a_free_place(tmp_path):
    new = _folder(tmp_path / "new", {"a.txt": b"a", "sub/b.bin": b"b"})
    dest = tmp_path / "out"
    assert files.replace_dir(new, dest) == dest
    assert _tree(dest) == {"a.txt": b"a", "sub/b.bin": b"b"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_dir_replaces_an_existing_folder_whole(tmp_path):
    """No file of the old folder survives in the new one (a replacement, not a merge), and the old one is gone."""
    dest = _folder(tmp_path / "out", {"old-only.txt": b"x", "a.txt": b"old"})
    new = _folder(tmp_path / ".out.export-1", {"a.txt": b"new"})
    files.replace_dir(new, dest)
    assert _tree(dest) == {"a.txt": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_replace_dir_restores_the_old_folder_when_the_last_rename_fails(tmp_path, monkeypatch):
    """The rollback: the old folder was moved aside, the new one cannot be moved in: the old one is put back
    intact under its name, the new one is left for the caller, and no aside copy remains."""
    old_files = {"model.safetensors": b"old weights", "config.json": b"{}", "sub/x": b"x"}
    dest = _folder(tmp_path / "out", old_files)
    new = _folder(tmp_path / ".out.export-1", {"model.safetensors": b"new weights"})
    _fail_rename_of(new, monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        files.replace_dir(new, dest)
    assert _tree(dest) == old_files
    assert _tree(new) == {"model.safetensors": b"new weights"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.export-1", "out"]


def test_replace_dir_leaves_everything_when_the_old_folder_cannot_be_moved_aside(tmp_path, monkeypatch):
    dest = _folder(tmp_path / "out", {"a": b"old"})
    new = _folder(tmp_path / "new", {"a": b"new"})
    _fail_rename_of(dest, monkeypatch)
    with pytest.raises(OSError):
        files.replace_dir(new, dest)
    assert _tree(dest) == {"a": b"old"} and _tree(new) == {"a": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "out"]
