"""A stand-in for the Hugging Face Hub on loopback (the real hub cannot be reached from the test host).

It serves just what the real `huggingface_hub` client asks for to resolve a revision and run
`snapshot_download` with Xet disabled (HF_HUB_DISABLE_XET=1):
- `GET /api/models/{org}/{name}/revision/{rev}` — model info: the commit SHA and the files (siblings, with sizes);
- `GET /api/models/{org}/{name}/tree/{rev}` — the file listing `snapshot_download` reads at a SHA;
- `HEAD`/`GET /{org}/{name}/resolve/{rev}/{path}` — the file, with `ETag`, `X-Repo-Commit` and `Content-Length`.
Revisions are branch/tag names or commit SHAs. With `token` set, every request needs
`Authorization: Bearer <token>` (else 401, as the hub answers for a private repo). Downloads can
be throttled (`bytes_per_s`) so a test can watch the engine's `downloading` phase. Every request is
logged in `requests` (method, path).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    commits: dict[str, Commit] = field(default_factory=dict)  # sha -> commit
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> sha

    def add_commit(self, folder: Path, refs: tuple[str, ...] = ("main",), extra: dict[str, bytes] | None = None) -> str:
        """Commit every file of `folder` (plus `extra`); the named refs point at it. Returns its SHA."""
        files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
        files.update(extra or {})
        digest = hashlib.sha1()
        for name, data in sorted(files.items()):
            digest.update(name.encode() + hashlib.sha1(data).digest())
        digest.update(str(len(self.commits)).encode())
        sha = digest.hexdigest()
        self.commits[sha] = Commit(sha, files)
        for ref in refs:
            self.refs[ref] = sha
        return sha

    def resolve(self, rev: str) -> Commit | None:
        return self.commits.get(self.refs.get(rev, rev))


class HubStandIn:
    def __init__(self, token: str | None = None, bytes_per_s: float | None = None) -> None:
        self.repos: dict[str, Repo] = {}
        self.token = token
        self.bytes_per_s = bytes_per_s
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def repo(self, name: str) -> Repo:
        return self.repos.setdefault(name, Repo())

    def start(self) -> "HubStandIn":
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, filename: str) -> int:
        return sum(1 for m, p in self.requests if m == "GET" and "/resolve/" in p and p.endswith("/" + filename))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            # One request per connection: a stopped stand-in must look down, not keep serving kept-alive sockets.
            protocol_version = "HTTP/1.0"

            def log_message(self, fmt: str, *args: object) -> None:
                return None

            def _json(self, status: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, status: int, message: str, code: str | None = None) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("X-Error-Message", message)
                if code:  # what huggingface_hub maps to RepositoryNotFoundError etc.
                    self.send_header("X-Error-Code", code)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _route(self) -> None:
                path = unquote(urlparse(self.path).path)
                hub.requests.append((self.command, path))
                if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._error(401, "Invalid credentials in Authorization header")
                parts = [p for p in path.split("/") if p]
                if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                    repo_name, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
                    repo = hub.repos.get(repo_name)
                    if repo is None:
                        return self._error(404, "Repository not found", "RepoNotFound")
                    commit = repo.resolve(rev)
                    if commit is None:
                        return self._error(404, f"Invalid rev id: {rev}", "RevisionNotFound")
                    if kind == "revision":
                        return self._json(200, {
                            "id": repo_name, "modelId": repo_name, "sha": commit.sha, "private": hub.token is not None,
                            "siblings": [{"rfilename": n, "size": len(d), "blobId": hashlib.sha1(d).hexdigest()}
                                         for n, d in sorted(commit.files.items())],
                        })
                    return self._json(200, [{"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                            for n, d in sorted(commit.files.items())])
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = hub.repos.get(f"{parts[0]}/{parts[1]}")
                    commit = repo.resolve(parts[3]) if repo else None
                    name = "/".join(parts[4:])
                    if commit is None or name not in commit.files:
                        return self._error(404, "Entry not found", "EntryNotFound")
                    data = commit.files[name]
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                    self.send_header("X-Repo-Commit", commit.sha)
                    self.send_header("Content-Type", "application/octet-stream")
                    self.end_headers()
                    if self.command == "GET":
                        step = 16384
                        for i in range(0, len(data), step):
                            self.wfile.write(data[i : i + step])
                            if hub.bytes_per_s:
                                time.sleep(step / hub.bytes_per_s)
                    return None
                return self._error(404, f"no route for {path}")

            do_GET = _route
            do_HEAD = _route

        return Handler
