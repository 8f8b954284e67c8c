"""What differs between the object stores behind `Output` (workers/output/storage.py): which
backends fleetgen knows to create atomically, the Azure copy a move waits for, and S3's removal of a
prefix page by page."""

from __future__ import annotations

import asyncio
import posixpath

import fsspec

S3_PAGE = 1000  # keys per listing page, and the most one DeleteObjects request takes
# The object stores whose fsspec backend creates an object only if absent, atomically (`mode="create"`).
_STORES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}


def store_kind(fs: fsspec.AbstractFileSystem) -> str | None:
    """ "local", "s3", "gcs" or "azure" for the backends fleetgen knows; None for any other."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    if {"file", "local"} & set(protocols):
        return "local"
    return next((_STORES[p] for p in protocols if p in _STORES), None)


async def azure_copy(fs, src: str, dst: str) -> None:
    """Copy one blob to another key and return once the copy is complete. Azure's Copy Blob may
    answer "pending" and finish later (adlfs' `cp_file` does not wait), and deleting the source of a
    pending copy aborts it; fsspec's generic `mv` also copies into `dst/` when it takes an existing
    `dst` for a folder (a retried move). So: one Copy Blob, its status followed to "success"."""
    from azure.core.exceptions import ResourceNotFoundError

    (c1, b1, _), (c2, b2, _) = fs.split_path(src), fs.split_path(dst)
    target = fs.service_client.get_blob_client(container=c2, blob=b2)
    try:
        copy = await target.start_copy_from_url(fs.service_client.get_blob_client(container=c1, blob=b1).url)
    except ResourceNotFoundError as err:
        raise FileNotFoundError(src) from err
    status, waited = copy.get("copy_status"), 0.0
    while status == "pending" and waited < 300:
        await asyncio.sleep(0.2)
        waited += 0.2
        status = (await target.get_blob_properties()).copy.status
    if status != "success":
        raise OSError(f"the copy of {src} to {dst} ended {status!r}")
    fs.invalidate_cache(posixpath.dirname(dst))


def remove_s3_prefix(fs, path: str) -> None:
    """An S3 object and every object under it as a prefix, 1,000 keys per listing page, deleted in one
    request each (memory does not grow with the prefix); a key one DeleteObjects refused raises."""
    bucket, key, _ = fs.split_path(path)
    page: dict = {"NextContinuationToken": None}
    while "NextContinuationToken" in page:
        token = page["NextContinuationToken"]
        page = fs.call_s3(
            "list_objects_v2",
            Bucket=bucket,
            Prefix=f"{key}/",
            MaxKeys=S3_PAGE,
            **({"ContinuationToken": token} if token else {}),
        )
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            done = fs.call_s3("delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
            if done.get("Errors"):  # per-key failures come back in a 200 answer, not as an exception
                first = done["Errors"][0]
                raise PermissionError(
                    f"{len(done['Errors'])} key(s) not deleted, e.g. {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message')}"
                )
    fs.call_s3("delete_object", Bucket=bucket, Key=key)  # the object at the key itself (absent: a no-op)
    fs.invalidate_cache(path)
