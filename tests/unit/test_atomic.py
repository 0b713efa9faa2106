"""`testbed.atomic.write_json`: the file is the old one or the whole new one, never a part."""

import json

import pytest

from testbed.atomic import make_dirs, write_json
from testbed.errors import UserError


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "sub" / "state.json"
    assert write_json(path, {"a": 1}) == path  # the directory is made
    write_json(path, {"b": [1, 2]}, indent=1)
    assert json.loads(path.read_text()) == {"b": [1, 2]} and path.read_text().startswith("{\n ")
    assert sorted(p.name for p in path.parent.iterdir()) == ["state.json"]


def test_a_write_that_fails_leaves_the_old_file_intact(tmp_path):
    path = tmp_path / "doc.json"
    write_json(path, {"ok": True})
    with pytest.raises(TypeError):
        write_json(path, {"bad": object()})  # not serialisable: fails before anything is renamed
    assert json.loads(path.read_text()) == {"ok": True}


def test_a_write_that_fails_on_the_disk_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    """The rename is what makes it atomic: with it failing, a plain write would already have replaced the file."""
    from pathlib import Path

    path = tmp_path / "doc.json"
    write_json(path, {"ok": True})

    def broken(self, target):
        raise OSError("disk full")

    monkeypatch.setattr(Path, "replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_json(path, {"new": 1})
    assert json.loads(path.read_text()) == {"ok": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.json"]


def test_the_file_gets_the_mode_a_plain_write_gives_it(tmp_path):
    import os

    old = os.umask(0o022)  # a temporary from mkstemp would be 0600 here, a plain write 0644
    try:
        plain = tmp_path / "plain.json"
        plain.write_text("{}")
        written = write_json(tmp_path / "a.json", {})
    finally:
        os.umask(old)
    assert (plain.stat().st_mode & 0o777) == 0o644 and (written.stat().st_mode & 0o777) == 0o644


def test_an_output_folder_that_cannot_be_made_is_one_user_error_naming_it(tmp_path):
    """`--out`/`--plots` paths come from users: a file in the way was a FileExistsError or NotADirectoryError traceback."""
    assert make_dirs(tmp_path / "a" / "b") == tmp_path / "a" / "b" and (tmp_path / "a" / "b").is_dir()
    assert make_dirs(tmp_path / "a") == tmp_path / "a"  # an existing folder is fine
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match=r"f: cannot create this folder \(File exists\)"):
        make_dirs(tmp_path / "f")
    with pytest.raises(UserError, match=r"f/sub: cannot create this folder \(Not a directory\)"):
        make_dirs(tmp_path / "f" / "sub")
    with pytest.raises(UserError, match="cannot create this folder"):  # and a file written there says the same
        write_json(tmp_path / "f" / "sub" / "x.json", {})
