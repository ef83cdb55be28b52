"""The engine room: the vLLM AsyncLLM wrapper (prefill.py), the KV connector that copies
hidden states into the shared arena, the arena and its leases, the vLLM version shims
and everything else that needs or describes the engine."""
