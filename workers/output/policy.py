"""The store's one error policy (`guarded`), for every operation of `workers.storage.Output` and the
input reads: a fault that may pass — an `OSError`, a timeout, a botocore connection/read/endpoint
error, an aiohttp client error, an Azure SDK request/response error, a 5xx / 429 / 408 the client
gave up on (S3, GCS, Azure) — is retried with backoff, then raised as a `StorageError` naming the URL
and the error in one line; an error no retry fixes (no credentials, access denied) is raised at
once, the same way, with what to set for that store; `FileNotFoundError` passes through (callers
decide what absent means)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from fleetgen.errors import StorageError, one_line

T = TypeVar("T")
# Per storage operation, beside the client's own retries. FLEETGEN_STORAGE_ATTEMPTS and
# FLEETGEN_STORAGE_BACKOFF override them (read at each operation; the driver hands them to its
# workers), for an operator who knows their store, and for tests.
ATTEMPTS = 4  # tries; waits 0.5 s, 1 s, 2 s between them
BACKOFF = 0.5  # seconds before the first retry, doubling
STORAGE_ENV = ("FLEETGEN_STORAGE_ATTEMPTS", "FLEETGEN_STORAGE_BACKOFF")


_S3_HINT = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or use an instance role"
_GCS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account's key file, or run "
    "`gcloud auth application-default login`, or use the VM's service account"
)
_AZURE_HINT = (
    "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY "
    "(or AZURE_STORAGE_SAS_TOKEN), or sign in for DefaultAzureCredential (`az login`, a managed identity)"
)
_CREDENTIALS_HINT = {
    "s3": _S3_HINT,
    "s3a": _S3_HINT,
    "gs": _GCS_HINT,
    "gcs": _GCS_HINT,
    "az": _AZURE_HINT,
    "abfs": _AZURE_HINT,
    "abfss": _AZURE_HINT,
}
_RETRY_STATUS = {408, 429}  # with every 5xx: a store asking the client to come back


def _client_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(transient, permanent) exception types of the store clients that are installed. botocore's
    and aiohttp's errors are not `OSError`s: a policy that catches `OSError` alone misses them."""
    transient: list[type[BaseException]] = [OSError, TimeoutError]
    permanent: list[type[BaseException]] = [PermissionError, IsADirectoryError]
    try:
        from botocore import exceptions as boto

        # connection, endpoint, read-timeout, closed-connection and streaming errors; ClientError
        # (an answer the client did not translate, e.g. a 5xx it gave up on) may pass too
        transient += [boto.ConnectionError, boto.HTTPClientError, boto.IncompleteReadError]
        permanent += [
            boto.NoCredentialsError,
            boto.PartialCredentialsError,
            boto.CredentialRetrievalError,
            boto.NoRegionError,
            boto.ParamValidationError,
        ]
    except ImportError:
        pass
    try:
        import aiohttp

        transient.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:  # GCS (gcsfs): credentials that cannot be found or refreshed
        from google.auth import exceptions as google

        permanent += [google.DefaultCredentialsError]
        transient += [google.TransportError]
    except ImportError:
        pass
    try:  # Azure (adlfs over the Azure SDK): a request that did not reach the store, or whose answer did not come back
        from azure.core import exceptions as azure

        permanent += [azure.ClientAuthenticationError]
        transient += [azure.ServiceRequestError, azure.ServiceResponseError]
    except ImportError:
        pass
    return tuple(transient), tuple(permanent)


_TRANSIENT, _PERMANENT = _client_errors()


def _status(err: BaseException) -> int | None:
    """The HTTP status of a store's answer the client raised as an error, where it says one:
    botocore's ClientError, gcsfs' HttpError (`code`), the Azure SDK's HttpResponseError."""
    response = getattr(err, "response", None)
    if isinstance(response, dict) and "Error" in response:  # botocore
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    for attribute in ("status_code", "code"):  # Azure SDK, gcsfs
        status = getattr(err, attribute, None)
        if isinstance(status, int) and 100 <= status < 600:
            return status
    if type(err) is OSError and str(err).startswith("Forbidden:"):  # gcsfs' 403
        return 403
    return None


def _hint(url: str, err: BaseException) -> str:
    if "://" not in url:
        return ""  # a local path: its permissions, not credentials
    if "Credential" in type(err).__name__ or isinstance(err, PermissionError) or _status(err) in (401, 403):
        scheme = url.split("://", 1)[0]
        return f" ({_CREDENTIALS_HINT.get(scheme, 'give fleetgen credentials for this store')})"
    return ""


def _unwrapped(err: BaseException) -> BaseException:
    """The store's error under a wrapper a backend adds (adlfs raises a `RuntimeError` "Failed to
    remove ..." from the Azure SDK's error)."""
    while type(err) is RuntimeError and isinstance(err.__cause__, Exception):
        err = err.__cause__
    return err


def _kind(err: BaseException) -> str | None:
    """ "transient", "permanent", or None: not a store client's error (let it through as it is)."""
    if isinstance(err, _PERMANENT):
        return "permanent"
    status = _status(err)  # an answer the client did not translate (a 5xx it gave up on, a 403)
    if status is not None:
        return "transient" if status >= 500 or status in _RETRY_STATUS else "permanent"
    if type(err) is OSError and err.errno is None and not isinstance(err.__cause__, _TRANSIENT):
        return None  # raised by a library over bytes it has (pyarrow: "Couldn't deserialize thrift"), not by I/O
    if isinstance(err, _TRANSIENT):
        return "transient"
    return None


def guarded(what: str, url: str, op: Callable[[], T], attempts: int | None = None, read: bool = True) -> T:
    """Run one store operation under the error policy (see the module's doc). `read`: a
    `FileNotFoundError` passes through (absent); a write that meets one (a missing bucket) fails."""
    attempts = attempts or int(os.environ.get("FLEETGEN_STORAGE_ATTEMPTS") or ATTEMPTS)
    backoff = float(os.environ.get("FLEETGEN_STORAGE_BACKOFF") or BACKOFF)
    for attempt in range(attempts):
        try:
            return op()
        except FileNotFoundError as err:
            if read:
                raise
            raise StorageError(f"Could not {what} {url}: {one_line(err)}") from err
        except Exception as raised:
            err = _unwrapped(raised)
            kind = _kind(err)
            if kind is None or isinstance(err, StorageError):
                raise
            if kind == "permanent":
                raise StorageError(f"Could not {what} {url}: {one_line(err)}{_hint(url, err)}") from raised
            if attempt == attempts - 1:
                tries = f" after {attempts} attempts" if attempts > 1 else ""
                raise StorageError(f"Could not {what} {url}{tries}: {one_line(err)}") from raised
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")
