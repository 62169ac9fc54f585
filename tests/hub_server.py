"""A local HTTP server that answers huggingface_hub as the Hugging Face hub does, for a few tiny repositories.

It serves what ``HfApi.model_info(files_metadata=True)`` and ``hf_hub_download`` ask for: the model's JSON with
each file's size, git blob id and LFS sha256; HEAD/GET of ``/{repo}/resolve/{revision}/{file}`` with ``X-Repo-Commit``,
``X-Linked-Etag`` and byte ranges; the hub's 404s with ``X-Error-Code`` (RepoNotFound, RevisionNotFound,
EntryNotFound). Faults on demand: a GET cut after some bytes, a 503 after a cut, a wrong sha256 in the listing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    """A repository's files at one commit (branch 'main'), and the faults to inject."""

    files: dict[str, bytes]
    listed_sha256: dict[str, str] = field(default_factory=dict)  # a wrong hash to list for a file
    cut_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the first GET is cut
    fail_after_cut: bool = False  # answer 503 to every GET after a cut

    def sha256(self, name: str) -> str:
        return self.listed_sha256.get(name) or hashlib.sha256(self.files[name]).hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo]
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range header)
    cuts: set[str] = field(default_factory=set)
    url: str = ""


def _sibling(repo: Repo, name: str) -> dict[str, object]:
    data = repo.files[name]
    blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()
    return {"rfilename": name, "size": len(data), "blobId": blob,
            "lfs": {"sha256": repo.sha256(name), "size": len(data), "pointerSize": 134}}


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # quiet
            return

        def _error(self, status: int, code: str) -> None:
            body = json.dumps({"error": code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, data: object) -> None:
            body = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _route(self) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range", "")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"]:
                repo_id = "/".join(parts[2:4])
                rev = parts[5] if len(parts) > 5 and parts[4] == "revision" else "main"
                return self._model_info(repo_id, rev)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
            return self._error(404, "RepoNotFound")

        def _model_info(self, repo_id: str, rev: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound")
            if rev not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            self._json({"id": repo_id, "sha": COMMIT, "private": False,
                        "siblings": [_sibling(repo, n) for n in sorted(repo.files)]})

        def _resolve(self, repo_id: str, rev: str, name: str) -> None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound")
            if rev not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            if name not in repo.files:
                return self._error(404, "EntryNotFound")
            if self.command == "GET" and repo.fail_after_cut and hub.cuts:
                return self._error(503, "Unavailable")
            data = repo.files[name]
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                start = int(rng[len("bytes="):].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{repo.sha256(name)}"')
            self.send_header("X-Linked-Etag", f'"{repo.sha256(name)}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(data) - start))
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            cut = repo.cut_after.get(name)
            if cut is not None and name not in hub.cuts:
                hub.cuts.add(name)
                self.wfile.write(data[start:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:])

        def do_GET(self) -> None:
            self._route()

        def do_HEAD(self) -> None:
            self._route()

    return Handler


@contextmanager
def serve_hub(repos: dict[str, Repo]) -> Iterator[Hub]:
    """Serve ``repos`` on 127.0.0.1 (an ephemeral port) until the block ends; ``hub.url`` is HF_ENDPOINT."""
    hub = Hub(repos=repos)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
