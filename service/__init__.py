"""hsx_service: the server (`hsx serve`). Rooms: `core` (transport-free: errors, admission,
metrics, request schema, key match; imports no other room), `engine` (vLLM, the connector,
the arena and its leases), `body` (one response body, coded as negotiated), `http` (the app,
its routers and guards, the HTTP workers, errors to statuses; the only room that imports
every other). At the top: cli and settings (the command), lifecycle and serving (they join
the rooms; serving never imports http), and tokenize / tokenize_pool (chat templates and
tokens: run in processes of their own for both /tokenize and /hidden_states, before any
engine or body)."""
