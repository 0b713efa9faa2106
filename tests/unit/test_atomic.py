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
    with pytest.raises(UserError, match=r"doc.json: cannot write this file \(disk full\)"):
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


def test_a_file_the_file_system_refuses_is_one_user_error_naming_it(tmp_path):
    """A folder where the file goes (`results.parquet/` in an experiment's --out) was an IsADirectoryError traceback
    after the experiment's last run; the folder is left as it was, with no temporary beside it."""
    (tmp_path / "results.json").mkdir()
    with pytest.raises(UserError, match=r"results.json: cannot write this file \(Is a directory\)"):
        write_json(tmp_path / "results.json", {"a": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"] and (tmp_path / "results.json").is_dir()


def test_a_folder_that_cannot_take_a_file_is_refused_before_the_work(tmp_path, monkeypatch):
    """A read-only file system lets `make_dirs` pass over an existing folder; `writable_dir` tries a file there."""
    import os

    from testbed.atomic import writable_dir

    assert writable_dir(tmp_path / "w") == tmp_path / "w" and list((tmp_path / "w").iterdir()) == []
    real_open = os.open

    def read_only(path, flags, mode=0o777):
        if flags & os.O_CREAT:
            raise OSError(30, "Read-only file system")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(UserError, match=r"/w: cannot write in this folder \(Read-only file system\)"):
        writable_dir(tmp_path / "w")
    with pytest.raises(UserError, match=r"/w/x.json: cannot write this file \(Read-only file system\)"):
        write_json(tmp_path / "w" / "x.json", {})
