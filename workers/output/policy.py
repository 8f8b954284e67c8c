"""The store's one error policy (`guarded`), for every operation of `workers.storage.Output` and the
input reads: a fault that may pass — an `OSError`, a timeout, a botocore connection/read/endpoint
error, an aiohttp client error, a 5xx the client gave up on — is retried with backoff, then raised
as a `StorageError` naming the URL and the error in one line; an error no retry fixes (no
credentials, access denied) is raised at once, the same way; `FileNotFoundError` passes through
(callers decide what absent means)."""

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


_CREDENTIALS_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or use an instance role",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
}


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
    return tuple(transient), tuple(permanent)


_TRANSIENT, _PERMANENT = _client_errors()


def _hint(url: str, err: BaseException) -> str:
    name = type(err).__name__
    if "Credential" in name:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        return f" ({_CREDENTIALS_HINT.get(scheme.rstrip('a'), 'give fleetgen credentials for this store')})"
    return ""


def _kind(err: BaseException) -> str | None:
    """ "transient", "permanent", or None: not a store client's error (let it through as it is)."""
    if type(err) is OSError and err.errno is None and not isinstance(err.__cause__, _TRANSIENT):
        return None  # raised by a library over bytes it has (pyarrow: "Couldn't deserialize thrift"), not by I/O
    if isinstance(err, _PERMANENT):
        return "permanent"
    if isinstance(err, _TRANSIENT):
        return "transient"
    response = getattr(err, "response", None)  # botocore's ClientError: an answer it did not translate
    if isinstance(response, dict) and "Error" in response:
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return "transient" if status >= 500 or status == 429 else "permanent"
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
        except Exception as err:
            kind = _kind(err)
            if kind is None or isinstance(err, StorageError):
                raise
            if kind == "permanent":
                raise StorageError(f"Could not {what} {url}: {one_line(err)}{_hint(url, err)}") from err
            if attempt == attempts - 1:
                tries = f" after {attempts} attempts" if attempts > 1 else ""
                raise StorageError(f"Could not {what} {url}{tries}: {one_line(err)}") from err
            time.sleep(backoff * 2**attempt)
    raise AssertionError("unreachable")
