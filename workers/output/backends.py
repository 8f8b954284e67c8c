"""What differs between the object stores behind `Output` (workers/output/storage.py): which
backends fleetgen knows to create atomically, and the Azure copy a move waits for."""

from __future__ import annotations

import asyncio
import posixpath

import fsspec

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
