"""A loopback stand-in for the Hugging Face Hub's HTTP API, enough for huggingface_hub's real client: create_repo,
upload_folder (preupload + commit, every file sent inline), and the downloads from_pretrained makes (repo info,
HEAD/GET resolve). It records every request so a test can assert what went over the wire.

    with HubServer() as hub:          # then HF_ENDPOINT=hub.url for the client (in this process or a child)
        ...
        hub.repos["someone/model"]    # {path: bytes}, the repo as uploaded
        hub.requests                  # [(method, path, authorization header)]
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

USER = "someone"


class HubServer:
    def __init__(self, token: str = "hf_test_token"):
        self.token = token
        self.repos: dict[str, dict[str, bytes]] = {}
        self.private: dict[str, bool] = {}
        self.commits: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str, str]] = []
        self.valid_cards: list[dict] = []
        self.invalid_cards: list[str] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> HubServer:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def sha(self, repo_id: str) -> str:
        return (self.commits.get(repo_id) or ["0" * 40])[-1]

    def write_repo(self, repo_id: str, folder: Path) -> Path:
        """The repo's files as uploaded, written under ``folder``."""
        for path, data in self.repos[repo_id].items():
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_bytes(data)
        return folder

    # ------------------------------------------------------------------------------------------------ handler
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, code: int, payload=None, headers: dict | None = None, raw: bytes | None = None,
                      head: bool = False) -> None:
                data = raw if raw is not None else (json.dumps(payload).encode() if payload is not None else b"")
                self.send_response(code)
                self.send_header("Content-Type", "application/json" if raw is None else "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            def _authorized(self) -> bool:
                return self.headers.get("Authorization") == f"Bearer {hub.token}"

            def _record(self) -> str:
                path = unquote(urlparse(self.path).path)
                with hub.lock:
                    hub.requests.append((self.command, path, self.headers.get("Authorization") or ""))
                return path

            # ---- writes
            def do_POST(self):
                path = self._record()
                body = self._body()
                if not self._authorized():
                    return self._send(401, {"error": "Invalid credentials"}, {"X-Error-Code": "InvalidCredentials"})
                parts = path.strip("/").split("/")
                if path == "/api/validate-yaml":  # the client sends a README's front matter before committing it
                    return self._validate_yaml(json.loads(body))
                if path == "/api/repos/create":
                    req = json.loads(body)
                    repo_id = f"{req.get('organization') or USER}/{req['name']}"
                    with hub.lock:
                        hub.repos.setdefault(repo_id, {})
                        hub.private[repo_id] = bool(req.get("private")) or req.get("visibility") == "private"
                    return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id, "id": repo_id})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                if len(parts) >= 6 and parts[:2] == ["api", "models"] and parts[4] == "commit":
                    repo_id = "/".join(parts[2:4])
                    if repo_id not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
                    with hub.lock:
                        for line in body.decode().splitlines():
                            item = json.loads(line)
                            if item["key"] == "file":
                                value = item["value"]
                                hub.repos[repo_id][value["path"]] = base64.b64decode(value["content"])
                            elif item["key"] == "deletedFile":
                                hub.repos[repo_id].pop(item["value"]["path"], None)
                        oid = hashlib.sha1(body).hexdigest()
                        hub.commits.setdefault(repo_id, []).append(oid)
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                                            "pullRequestUrl": None})
                return self._send(404, {"error": f"no route {path}"})

            def _validate_yaml(self, req: dict):
                """What the Hub checks, as far as huggingface_hub can: a README whose YAML front matter parses into
                card metadata with a well-formed model-index (``ModelCard`` parses it into ``EvalResult``s)."""
                from huggingface_hub import ModelCard

                try:
                    card = ModelCard(req["content"])
                    data = card.data.to_dict()
                    if not data:
                        raise ValueError("no YAML front matter")
                    if "model-index" in card.content and not card.data.eval_results:
                        raise ValueError("model-index holds no results")
                except Exception as e:
                    hub.invalid_cards.append(str(e))
                    return self._send(400, {"error": f"Invalid metadata in README.md: {e}"})
                hub.valid_cards.append(data)
                return self._send(200, {"warnings": []})

            # ---- reads
            def do_HEAD(self):
                self._get(head=True)

            def do_GET(self):
                self._get(head=False)

            def _get(self, head: bool):
                path = self._record()
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo_id = "/".join(parts[2:4])
                    if repo_id not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"},
                                          head=head)
                    files = hub.repos[repo_id]
                    if len(parts) >= 5 and parts[4] in ("tree", "paths-info"):
                        return self._send(200, [{"type": "file", "path": p, "size": len(b), "oid": "x"}
                                                for p, b in sorted(files.items())], head=head)
                    return self._send(200, {"id": repo_id, "modelId": repo_id, "sha": hub.sha(repo_id),
                                            "private": hub.private.get(repo_id, False),
                                            "siblings": [{"rfilename": p} for p in sorted(files)]}, head=head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo_id, filename = "/".join(parts[:2]), "/".join(parts[4:])
                    if repo_id not in hub.repos:
                        return self._send(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"},
                                          head=head)
                    data = hub.repos[repo_id].get(filename)
                    if data is None:
                        return self._send(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound",
                                                                             "X-Repo-Commit": hub.sha(repo_id)},
                                          head=head)
                    etag = hashlib.sha256(data).hexdigest()
                    return self._send(200, raw=data, head=head,
                                      headers={"X-Repo-Commit": hub.sha(repo_id), "ETag": f'"{etag}"'})
                return self._send(404, {"error": f"no route {path}"}, head=head)

        return Handler
