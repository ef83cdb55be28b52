"""The body room: one response body, coded as negotiated (identity, zstd, bf16split),
streamed from the shared arena on a compression pool of its own."""
