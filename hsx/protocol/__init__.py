"""The protocol both sides share, beside the wire format (hsx.wire): the lease protocol
(`lease`: the session header, attach / ArenaMap, SendReport), the /final_norm body
(`final_norm`) and the key of hsx's entry in vLLM's kv_transfer_params."""

# kv_transfer_params[KV_PARAMS_KEY] = {"key", "offset", "nbytes", "layer_positions"}: what the
# engine wrapper asks of the connector for one request (where in the arena its states go, and
# which of the captured layers by position, where HTTP's `layers` names layer ids).
KV_PARAMS_KEY = "hsx"
