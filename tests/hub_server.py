"""A small server on loopback that speaks the part of the Hugging Face Hub's HTTP API that
`huggingface_hub` (and so `DiffusionPipeline.from_pretrained`) uses to find and download a model:
repo info at a revision, and files by revision with the commit and ETag headers. Repos, their
commits and branches are plain Python data; every file download is counted, so tests can see how
often a node fetched a snapshot. Pointed to with `HF_ENDPOINT`.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class Repo:
    def __init__(self, gated: bool = False):
        self.commits: dict[str, dict[str, bytes]] = {}  # commit sha -> {path: bytes}
        self.refs: dict[str, str] = {}  # branch -> commit sha
        self.gated = gated

    def push(self, directory: Path, branch: str = "main") -> str:
        """A commit holding every file under `directory`; `branch` moves to it. Returns its sha."""
        files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        sha = hashlib.sha1(
            json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items())).encode()
            + str(len(self.commits)).encode()
        ).hexdigest()
        self.commits[sha] = files
        self.refs[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        return self.refs.get(revision) or (revision if revision in self.commits else None)


class HubServer:
    def __init__(self, port: int = 0):
        self.repos: dict[str, Repo] = {}
        self.downloads: Counter = Counter()  # (repo, commit, path) -> GETs of file contents
        self.tokens = {"hf_test_token"}
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        h.send_header("Content-Type", "application/json")
        body = json.dumps({"error": message}).encode()
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, value, body: bool) -> None:
        data = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        parts = [unquote(p) for p in urlparse(h.path).path.strip("/").split("/")]
        api = parts[:2] == ["api", "models"]
        if api:
            parts = parts[2:]
        repo_id = "/".join(parts[:2])
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound", "Repository not found")
        if repo.gated and h.headers.get("Authorization", "").removeprefix("Bearer ") not in self.tokens:
            return self._error(h, 401, "GatedRepo", "Access to this model is restricted; you must be authenticated")
        if api and len(parts) > 3 and parts[2] == "tree":  # /api/models/{repo}/tree/{rev}[/{path}]
            sha = repo.resolve(parts[3])
            if sha is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
            under = "/".join(parts[4:])
            entries = [
                {"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                for p, b in repo.commits[sha].items()
                if p.startswith(under)
            ]
            return self._json(h, entries, body)
        if api:  # /api/models/{repo}[/revision/{rev}]
            revision = parts[3] if len(parts) > 3 and parts[2] == "revision" else "main"
            sha = repo.resolve(revision)
            if sha is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            files = repo.commits[sha]
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": False,
                "gated": "auto" if repo.gated else False,
                "disabled": False,
                "tags": ["diffusers"],
                "library_name": "diffusers",
                "siblings": [{"rfilename": p, "size": len(b)} for p, b in files.items()],
            }
            return self._json(h, info, body)
        if len(parts) < 5 or parts[2] != "resolve":  # /{repo}/resolve/{rev}/{path}
            return self._error(h, 404, "EntryNotFound", "Not found")
        sha = repo.resolve(parts[3])
        if sha is None:
            return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {parts[3]}")
        path = "/".join(parts[4:])
        data = repo.commits[sha].get(path)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{path} does not exist at {sha}")
        h.send_response(200)
        h.send_header("X-Repo-Commit", sha)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Length", str(len(data)))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if body:
            self.downloads[(repo_id, sha, path)] += 1
            h.wfile.write(data)
        return None
