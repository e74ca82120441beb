"""Files halwatch writes appear whole or not at all, with the permissions of any file the user creates."""

import os
import stat
import threading

import pytest

from halwatch.data.jsonl import write_jsonl
from halwatch.files import replaced


def test_a_written_file_has_the_users_permissions_and_a_failed_write_leaves_the_old_one(tmp_path):
    umask = os.umask(0o027)  # a group-readable umask, unlike the default: the file must follow it
    try:
        out = tmp_path / "scores.jsonl"
        write_jsonl(out, [{"id": "a"}])
        assert stat.S_IMODE(out.stat().st_mode) == 0o640  # not mkstemp's owner-only 0o600
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        assert stat.S_IMODE(plain.stat().st_mode) == stat.S_IMODE(out.stat().st_mode)  # as open() makes them
    finally:
        os.umask(umask)

    def rows():
        yield {"id": "b"}
        raise RuntimeError("the scorer failed mid-file")

    with pytest.raises(RuntimeError):
        write_jsonl(out, rows())
    assert out.read_text() == '{"id": "a"}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["plain.txt",
                                                                                                  "scores.jsonl"]
    with replaced(tmp_path / "new" / "x.bin", binary=True) as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "new" / "x.bin").read_bytes() == b"\x00\x01"


def test_a_pipe_or_device_is_written_in_place_not_replaced(tmp_path):
    # renaming a finished file over /dev/null made it a plain root-only file (halwatch score --output /dev/null as
    # root): a target that is no regular file is written as it is, and stays what it was
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_text()), daemon=True)
    reader.start()
    write_jsonl(pipe, [{"id": "a"}, {"id": "b"}])
    reader.join(timeout=30)
    assert got == ['{"id": "a"}\n{"id": "b"}\n']
    assert stat.S_ISFIFO(pipe.stat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
    with replaced(os.devnull) as f:
        f.write("nothing\n")
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
