"""The HTTP room: the FastAPI app and its per-feature routers, the guard (headers, keys,
limits), admission, the error answers, the request schema, auth, the offline docs, the
metrics, the connection bounds, and the `--http-workers` processes (http_workers.py starts
and watches them, http_worker.py is one of them)."""
