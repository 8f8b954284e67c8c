"""None"""

import threading

import pytest

from fleetgen.errors import StorageError
from fleetgen.workers.output import backends, policy
from fleetgen.workers.output.storage import Output


def test_storage_retries_a_transient_fault_and_names_the_url_of_a_persistent_one(tmp_path, monkeypatch):
    """Real faults on a real filesystem: a file squatting where a directory must go."""
    monkeypatch.setattr(policy, "BACKOFF", 0.05)
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


def test_removing_a_prefix_on_s3_goes_page_by_page(s3_server, monkeypatch):
    """`--overwrite` and `verify --fix` remove prefixes of any size: keys are listed a page at a time
    and each page deleted in one request; neighbours sharing the name's start stay."""
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("remove-pages")
    out = Output("s3://remove-pages/out")
    for i in range(23):
        out.put(f"images/shard-{i % 3}/{i}.png", b"x")
    out.put("images", b"an object at the prefix's own key")
    out.put("images2/keep.png", b"y")
    out.put("data/keep.tar", b"z")
    monkeypatch.setattr(backends, "S3_PAGE", 5)
    calls = []
    real = out.fs.call_s3

    def counting(method, **kwargs):
        calls.append((method, len(kwargs.get("Delete", {}).get("Objects", []))))
        return real(method, **kwargs)

    monkeypatch.setattr(out.fs, "call_s3", counting)
    out.remove("images")
    assert [m for m, _ in calls].count("list_objects_v2") == 5  # 23 keys, 5 a page
    assert max(n for m, n in calls if m == "delete_objects") == 5
    assert sorted(out.find("")) == ["data/keep.tar", "images2/keep.png"]
    out.remove("images")  # absent: fine
    # a key S3 refuses to delete comes back inside a 200 answer: it must not pass silently
    out.put("data/locked.tar", b"z")

    def refusing(method, **kwargs):
        if method == "delete_objects":
            return {"Errors": [{"Key": kwargs["Delete"]["Objects"][0]["Key"], "Code": "AccessDenied", "Message": "no"}]}
        return real(method, **kwargs)

    monkeypatch.setattr(out.fs, "call_s3", refusing)
    with pytest.raises(StorageError, match="Could not remove s3://remove-pages/out/data: .*AccessDenied"):
        out.remove("data")
