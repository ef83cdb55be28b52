"""The HTTP room: the FastAPI app and its per-feature routers, the guard (headers, keys,
limits), the one map from the core's errors to HTTP statuses (errors.py), the response
schema, the Bearer token, the offline docs, the connection bounds, and the `--http-workers`
processes (http_workers.py starts and watches them, http_worker.py is one of them). It may
import every other room; none imports it but lifecycle.py and cli.py."""
