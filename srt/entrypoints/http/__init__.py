"""The HTTP server's parts, one concern each; `srt.entrypoints.http_server` composes them.

- `errors`: JSON and error responses; client-visible exceptions -> HTTP statuses, in one place.
- `auth`: API keys, the admin key and tenants (`AuthMiddleware`, deny by default).
- `request`: what a route reads from its request (the `ServerContext`, the JSON body).
- `native_routes`, `admin_routes`, `openai_routes`, `load_routes`: the routes, one APIRouter each.
- `streaming`: the SSE shape of /generate (`--incremental-streaming-output`).
- `load`: /get_load, /v1/loads and their Prometheus text from the schedulers' internal states.
- `lifecycle`: uvicorn, child-death and SIGTERM drain handling.
"""
