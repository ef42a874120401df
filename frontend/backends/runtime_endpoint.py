"""`RuntimeEndpoint`: programs run against a radixserve server, or any SGLang-compatible one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import requests

from frontend.backends.base import Backend, BackendError


class RuntimeEndpoint(Backend):
    def __init__(
        self, base_url: str, api_key: str | None = None, chat_template: str | None = None, timeout: float = 600.0
    ):
        """`chat_template` (a Jinja template) overrides the one the server reports in /get_model_info,
        for servers that do not report one. `timeout` bounds each request (seconds between stream
        chunks when streaming)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.chat_template_override = chat_template
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self._info = self._request("GET", "/get_model_info").json()

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    def _request(self, method: str, path: str, body: dict | None = None, stream: bool = False) -> requests.Response:
        try:
            r = self.session.request(method, self.base_url + path, json=body, stream=stream, timeout=self.timeout)
        except requests.RequestException as e:
            raise BackendError(f"{method} {self.base_url}{path} failed: {e}") from e
        if r.status_code != 200:
            raise BackendError(f"{method} {path} -> HTTP {r.status_code}: {_message(r)}", r.status_code)
        return r

    def model_info(self) -> dict:
        return self._info

    def call(self, body: dict) -> Any:
        return self._request("POST", "/generate", body).json()

    def call_stream(self, body: dict) -> Iterator[dict]:
        with self._request("POST", "/generate", body, stream=True) as r:
            try:
                for line in r.iter_lines():
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(f"stream error: {_error_text(chunk)}")
                    yield chunk
            except requests.RequestException as e:
                raise BackendError(f"stream from {self.base_url} broke: {e}") from e
        raise BackendError(f"stream from {self.base_url} ended without [DONE]")

    def flush_cache(self) -> None:
        self._request("POST", "/flush_cache")

    def get_server_info(self) -> dict:
        return self._request("GET", "/get_server_info").json()


def _error_text(payload) -> str:
    err = payload.get("error", payload) if isinstance(payload, dict) else payload
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def _message(r: requests.Response) -> str:
    try:
        return _error_text(r.json())
    except ValueError:
        return r.text[:500]
