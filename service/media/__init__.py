"""Images in requests: OpenAI `image_url` content parts to bounded, decoded images.

parts.py finds the image parts of a chat (and names each by message and part index),
sources.py turns a part's URL into bytes (data URIs; local files under
--allowed-media-dir; http(s) only with --allow-remote-media), decode.py checks those bytes
(format, pixels from the header, truncation) before and while decoding them. Every refusal
names the part it is about.
"""
