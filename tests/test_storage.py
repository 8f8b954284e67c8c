import threading

import pytest

from fleetgen.errors import StorageError
from workers import storage
from workers.storage import Output


def test_storage_retries_a_transient_fault_and_names_the_url_of_a_persistent_one(tmp_path, monkeypatch):
    """Real faults on a real filesystem: a file squatting where a directory must go."""
    monkeypatch.setattr(storage, "BACKOFF", 0.05)
    out = Output(str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    blocker = tmp_path / "out" / "images"
    blocker.write_text("not a directory")
    with pytest.raises(StorageError) as err:
        out.put("images/s/a.png", b"x")
    assert f"Could not write {tmp_path}/out/images/s/a.png after 4 attempts" in str(err.value)

    timer = threading.Timer(0.08, blocker.unlink)  # the fault clears while put is backing off
    timer.start()
    out.put("images/s/a.png", b"x")
    timer.join()
    assert (tmp_path / "out" / "images" / "s" / "a.png").read_bytes() == b"x"
    # a killed writer's temporary file is swept, finished objects stay
    (tmp_path / "out" / "images" / "s" / "b.png.tmp-1234abcd").write_bytes(b"half")
    assert out.sweep_tmp("images/s") == 1
    assert sorted(p.name for p in (tmp_path / "out" / "images" / "s").iterdir()) == ["a.png"]
