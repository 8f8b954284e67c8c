"""Where everything lives under OUT (workers/output/layout.py): deterministic keys, safe ids."""

from fleetgen.workers.output.layout import image_key, manifest_key, unsafe_id_reason


def test_keys_are_deterministic():
    assert image_key("shard-00001", "abc", "jpeg") == "images/shard-00001/abc.jpg"
    assert manifest_key("shard-00001") == "shards/shard-00001.parquet"


def test_unsafe_ids_are_refused():
    for bad in ["../x", "/abs", "a/b", "", ".hidden", "x" * 129, "caf\u00e9", "a\nb", "a b"]:
        assert unsafe_id_reason(bad) is not None, bad
    for good in ["a", "row-1", "Img_0001.v2", "x" * 128]:
        assert unsafe_id_reason(good) is None, good
