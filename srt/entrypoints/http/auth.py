"""API keys (--api-key, --tenant-config), the admin key (--admin-api-key) and tenants (--tenant-header)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from srt.entrypoints.http.errors import ANTHROPIC_PATHS, route_error
from srt.qos.tenants import load_tenant_config
from srt.server_args import ServerArgs

# Routes that need the admin key when --admin-api-key is set (/abort_request's abort_all too).
ADMIN_ROUTES = frozenset(
    {
        "/flush_cache",
        "/clear_hicache_storage_backend",
        "/server_info",
        "/get_server_info",
        "/start_profile",
        "/stop_profile",
        "/configure_logging",
        "/load_lora_adapter",
        "/unload_lora_adapter",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
        "/get_weights_by_name",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)
# Probes answer without a key (load balancers and orchestrators call them unauthenticated).
OPEN_PATHS = frozenset({"/health", "/ready", "/ping"})
# The built-in pages load without a key (they hold nothing); they ask for it and send it with every call.
PAGE_PATHS = frozenset({"/", "/dashboard"})
PAGE_PREFIX = "/webui/"


class Auth:
    """Who a request is: "admin", an API key's index, or "" (no key configured), and its tenant."""

    def __init__(self, args: ServerArgs):
        named = load_tenant_config(args).keys  # --tenant-config's keys, by their tenant's name
        self.keys = [f"Bearer {k}".encode() for k in [*args.api_keys, *named]]
        self.admin = f"Bearer {args.admin_api_key}".encode() if args.admin_api_key else None
        self.tenant_ids = [hashlib.sha256(k).hexdigest()[:16] for k in self.keys[: len(args.api_keys)]]
        self.tenant_ids += [f"t:{name}" for name in named.values()]
        self.tenant_header = args.tenant_header

    def identify(self, header: str) -> str | int | None:
        given = header.encode()
        # Compare against every key (constant time each, no early exit) so timing says nothing.
        matches = [hmac.compare_digest(given, k) for k in self.keys]
        is_admin = self.admin is not None and hmac.compare_digest(given, self.admin)
        if is_admin:
            return "admin"
        if any(matches):
            return matches.index(True)
        return "" if not self.keys else None

    def is_admin(self, who) -> bool:
        return who == "admin" or (self.admin is None and who is not None)

    def tenant(self, who, headers) -> str | None:
        if self.tenant_header:
            return "h:" + headers.get(self.tenant_header, "")
        if isinstance(who, int) and self.tenant_ids[who].startswith("t:"):
            return self.tenant_ids[who]  # a --tenant-config tenant: its name
        if isinstance(who, int) and len(self.keys) > 1:
            return "k:" + self.tenant_ids[who]
        return None


class AuthMiddleware:
    """Deny by default: every route, including ones added later, except the liveness probe. A plain
    ASGI middleware (not BaseHTTPMiddleware), so routes still see their client disconnect."""

    def __init__(self, app, auth: Auth):
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in OPEN_PATHS or path in PAGE_PATHS or path.startswith(PAGE_PREFIX):
            return await self.app(scope, receive, send)
        request = Request(scope)
        header = request.headers.get("authorization", "")
        if not header and scope["path"].startswith(ANTHROPIC_PATHS) and "x-api-key" in request.headers:
            header = "Bearer " + request.headers["x-api-key"]  # how Anthropic's clients send the key
        who = self.auth.identify(header)
        error = None
        if who is None:
            error = "missing or invalid API key (send 'Authorization: Bearer <key>'" + (
                " or 'x-api-key: <key>')" if scope["path"].startswith(ANTHROPIC_PATHS) else ")"
            )
        elif scope["path"] in ADMIN_ROUTES and not self.auth.is_admin(who):
            error = f"{scope['path']} needs the admin API key (--admin-api-key)"
        if error is not None:
            return await route_error(request, 401, error, code="invalid_api_key")(scope, receive, send)
        state = scope.setdefault("state", {})
        state["admin"] = self.auth.is_admin(who)
        state["tenant"] = self.auth.tenant(who, request.headers)
        await self.app(scope, receive, send)
