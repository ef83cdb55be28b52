"""hsx_service: the server (`hsx serve`). Rooms: `http` (the app, its routers and guards, the
HTTP workers), `body` (one response body, coded as negotiated), `engine` (vLLM, the connector,
the arena and its leases). At the top: cli and settings (the command), lifecycle and serving
(they join the three rooms), and tokenize / tokenize_pool (chat templates and tokens: run
in processes of their own for both /tokenize and /hidden_states, before any engine or body)."""
