"""The core room: what every other room shares and none of them owns, free of any
transport: the domain errors (no HTTP status: http/errors.py maps them), the admission
gate, the metrics, the request schema and the API-key match. It imports nothing of
engine/, body/, http/ or serving (tests/kernel/test_import_layers.py checks it)."""
