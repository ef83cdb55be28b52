"""Same-host transfer, client side: the lease protocol's reading half lives in the kernel
(hsx.protocol.lease, shared with the server's HTTP workers); the library names it here."""

from hsx.protocol.lease import SESSION_HEADER, ArenaMap, ShmUnavailable, attach

__all__ = ["SESSION_HEADER", "ArenaMap", "ShmUnavailable", "attach"]
