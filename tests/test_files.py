"""fedconvex.files.replaced_atomically: the new file whole, or the old one and nothing beside it."""

import os

import pytest

from fedconvex.files import replaced_atomically


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, failure):
    path = tmp_path / "f.json"
    path.write_text("old")
    with pytest.raises(type(failure)):
        with replaced_atomically(str(path)) as tmp, open(tmp, "w") as fh:
            fh.write("half")
            raise failure
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["f.json"]


def test_a_write_that_ends_replaces_the_file_whole(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("old")
    with replaced_atomically(str(path)) as tmp, open(tmp, "w") as fh:
        assert tmp != str(path) and str(os.getpid()) in tmp  # per process by default
        fh.write("new")
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["f.json"]
    with replaced_atomically(str(path), str(path) + ".tmp") as tmp, open(tmp, "w") as fh:
        fh.write("newer")
    assert path.read_text() == "newer" and os.listdir(tmp_path) == ["f.json"]
