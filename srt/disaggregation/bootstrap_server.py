"""The bootstrap server a prefill server runs on --disaggregation-bootstrap-port, with SGLang's HTTP
protocol (its `CommonKVBootstrapServer`, SGLang 0.5.x; see README "Prefill-decode disaggregation"):

- `PUT /route` — a prefill rank registers: `{"attn_tp_size", "attn_tp_rank", "attn_cp_size",
  "attn_cp_rank", "attn_dp_size", "attn_dp_rank", "pp_size", "pp_rank", "system_dp_size",
  "system_dp_rank", "rank_ip", "rank_port", "page_size", "kv_cache_dtype"}`.
- `GET /route?prefill_dp_rank=&prefill_cp_rank=&target_tp_rank=&target_pp_rank=` — all -1: the
  prefill server's layout `{"attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size",
  "kv_cache_dtype", "follow_bootstrap_room"}`; else one rank's `{"rank_ip", "rank_port"}`. 503
  until every rank has registered, 404 for a rank that does not exist, 400 for a missing parameter.
- `POST /register_dp_rank` `{"bootstrap_room", "dp_rank"}` and `POST /query_dp_ranks`
  `{"bootstrap_rooms": [...]}` -> `{"<room>": dp_rank}`; `GET /health`.

A decode rank asks once per prefill server for the layout, then for the endpoint of the rank that
holds its KV heads, and talks to that rank directly (see `transfer.py`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from srt.disaggregation.utils import env_seconds

logger = logging.getLogger(__name__)

REGISTER_FIELDS = (
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
)
QUERY_FIELDS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BootstrapState:
    """The registry behind the routes (thread-safe; no I/O under the lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.layout: dict | None = None  # from the first registration
        self.ranks: dict[tuple[int, int, int, int], dict] = {}  # (dp, cp, tp, pp) -> endpoint
        self.room_dp: dict[int, tuple[int, float]] = {}  # room -> (dp rank, when)
        self.room_ttl = env_seconds("SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL", 120.0)

    def register(self, data: dict) -> None:
        missing = [f for f in REGISTER_FIELDS if f not in data]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        ints = {f: int(data[f]) for f in REGISTER_FIELDS if f not in ("rank_ip", "kv_cache_dtype")}
        dp_size = ints["attn_dp_size"] if ints["system_dp_size"] == 1 else ints["system_dp_size"]
        dp_rank = ints["attn_dp_rank"] if ints["system_dp_size"] == 1 else ints["system_dp_rank"]
        with self.lock:
            if self.layout is None:
                self.layout = {
                    "attn_tp_size": ints["attn_tp_size"],
                    "attn_cp_size": ints["attn_cp_size"],
                    "dp_size": dp_size,
                    "pp_size": ints["pp_size"],
                    "page_size": ints["page_size"],
                    "kv_cache_dtype": str(data["kv_cache_dtype"]),
                    "follow_bootstrap_room": data.get("load_balance_method", "follow_bootstrap_room")
                    == "follow_bootstrap_room",
                }
            key = (dp_rank, ints["attn_cp_rank"], ints["attn_tp_rank"], ints["pp_rank"])
            self.ranks[key] = {"rank_ip": str(data["rank_ip"]), "rank_port": ints["rank_port"]}

    def ready(self) -> bool:
        lay = self.layout
        if lay is None:
            return False
        return len(self.ranks) >= lay["dp_size"] * lay["attn_cp_size"] * lay["attn_tp_size"] * lay["pp_size"]

    def register_room(self, room: int, dp_rank: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.room_dp = {r: v for r, v in self.room_dp.items() if now - v[1] < self.room_ttl}
            self.room_dp[room] = (dp_rank, now)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        logger.debug("bootstrap %s", format % args)

    def _reply(self, status: int, body: dict | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _json(self) -> dict | None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
            data = json.loads(self.rfile.read(n) or b"null")
        except (ValueError, json.JSONDecodeError):
            data = None
        if not isinstance(data, dict):
            self._reply(400, "the body must be a JSON object")
            return None
        return data

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/health":
            return self._reply(200, "OK")
        if url.path != "/route":
            return self._reply(404, f"no route {url.path}")
        query = dict(urllib.parse.parse_qsl(url.query))
        try:
            key = tuple(int(query[f]) for f in QUERY_FIELDS)
        except (KeyError, ValueError):
            return self._reply(400, f"Missing inputs for bootstrap server: {', '.join(QUERY_FIELDS)} (integers)")
        st = self.server.state
        with st.lock:
            if not st.ready():
                n = len(st.ranks)
                return self._reply(503, f"Prefill server not fully registered yet ({n} workers registered).")
            assert st.layout is not None, "ready() implies a layout"
            if key == (-1, -1, -1, -1):
                return self._reply(200, dict(st.layout))
            rank = st.ranks.get(key)  # pyright: ignore[reportArgumentType]
        if rank is None:
            where = "dp_rank={} cp_rank={} tp_rank={} pp_rank={}".format(*key)
            return self._reply(404, f"Bootstrap info not found for {where}")
        return self._reply(200, dict(rank))

    def do_PUT(self) -> None:
        if urllib.parse.urlsplit(self.path).path != "/route":
            return self._reply(404, f"no route {self.path}")
        data = self._json()
        if data is None:
            return
        try:
            self.server.state.register(data)
        except (ValueError, TypeError) as e:
            return self._reply(400, f"bad registration: {e}")
        self._reply(200, "OK")

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path not in ("/register_dp_rank", "/query_dp_ranks"):
            return self._reply(404, f"no route {path}")
        data = self._json()
        if data is None:
            return
        st = self.server.state
        try:
            if path == "/register_dp_rank":
                st.register_room(int(data["bootstrap_room"]), int(data["dp_rank"]))
                return self._reply(200, "OK")
            rooms = [int(r) for r in data["bootstrap_rooms"]]
        except (KeyError, ValueError, TypeError) as e:
            return self._reply(400, f"bad body: {e}")
        with st.lock:
            found = {str(r): st.room_dp[r][0] for r in rooms if r in st.room_dp}
        self._reply(200, found)

    do_DELETE = do_PATCH = lambda self: self._reply(405, "Method not allowed")  # noqa: E731


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    state: BootstrapState


class BootstrapServer:
    """Serves the routes from a daemon thread of the prefill server's main process."""

    def __init__(self, host: str, port: int):
        self.httpd = _Server((host, port), _Handler)
        self.httpd.state = BootstrapState()
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="bootstrap-server", daemon=True)
        self.thread.start()
        logger.info("disaggregation bootstrap server on %s:%d", host, port)

    @property
    def state(self) -> BootstrapState:
        return self.httpd.state

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# -- clients -----------------------------------------------------------------------------------------


# The bootstrap server is a peer on the cluster network: never reached through an HTTP proxy that the
# environment configures for the outside world.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_json(method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, object]:
    """(status, parsed JSON or text); status 0 when the server cannot be reached."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with _OPENER.open(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(getattr(e, "reason", e))
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def register_prefill_rank(bootstrap_url: str, info: dict, deadline_s: float = 30.0) -> None:
    """PUT this rank's endpoint; retries while the server starts (it runs in the parent process)."""
    deadline = time.monotonic() + deadline_s
    while True:
        status, body = http_json("PUT", bootstrap_url + "/route", info)
        if status == 200:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not register with the bootstrap server {bootstrap_url}: {status} {body}")
        time.sleep(0.2)


def query_prefill(host: str, port: int, tp_ranks: list[int], deadline_s: float) -> tuple[dict, dict[int, dict]]:
    """The prefill server's layout and the endpoints of its tensor-parallel ranks `tp_ranks`
    (dp/cp/pp rank 0), waiting while it reports 503 (still starting)."""
    base = f"http://{host}:{port}/route?"
    deadline = time.monotonic() + deadline_s

    def get(**q) -> dict:
        url = base + urllib.parse.urlencode({f: q.get(f, -1) for f in QUERY_FIELDS})
        while True:
            status, body = http_json("GET", url)
            if status == 200 and isinstance(body, dict):
                return body
            if status not in (0, 503) or time.monotonic() > deadline:
                where = f"the bootstrap server at {host}:{port}"
                problem = f"answered {status}: {body}" if status else f"is unreachable: {body}"
                raise RuntimeError(f"{where} {problem}")
            time.sleep(0.2)

    layout = get()
    ranks = {
        r: get(prefill_dp_rank=0, prefill_cp_rank=0, target_tp_rank=r, target_pp_rank=0) for r in sorted(set(tp_ranks))
    }
    return layout, ranks
