"""hsx's client library: the front door.

    from hsx_client import HsxClient, ServerBusyError

Every public name is listed in `__all__` and loaded on first use, so `import hsx_client`
(which every `hsx` command and worker process does) stays cheap: httpx, numpy and the
transports load only with the names that need them. The modules behind these names are
the library's own; its rooms (`corpus`, `training`, `regenerate`) use it through this door.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # `typing` itself costs more to import than this whole module

# Public name -> the module of the library that defines it.
_HOMES = {
    "HsxClient": "api",
    "ServerSet": "servers",
    "ClientSettings": "settings",
    "Lease": "responses",
    "SampleStream": "sample_stream",
    "SampleHead": "sample_stream",
    "StatesLayout": "sample_stream",
    "StatesChunk": "sample_stream",
    "states_layout": "sample_stream",
    "HsxError": "errors",
    "BadRequestError": "errors",
    "AuthenticationError": "errors",
    "PayloadTooLargeError": "errors",
    "ServerBusyError": "errors",
    "ServerError": "errors",
    "ConnectionFailedError": "errors",
    "ResponseValidationError": "errors",
    "RequestTimeoutError": "errors",
    "ServersUnreachableError": "errors",
    "LeaseExpiredError": "errors",
    "RetriesExhaustedError": "errors",
}

__all__ = sorted(_HOMES)

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each loads on first use
    from typing import Any

    from hsx_client.api import HsxClient
    from hsx_client.errors import (AuthenticationError, BadRequestError, ConnectionFailedError, HsxError,
                                   LeaseExpiredError, PayloadTooLargeError, RequestTimeoutError, ResponseValidationError,
                                   RetriesExhaustedError, ServerBusyError, ServerError, ServersUnreachableError)
    from hsx_client.responses import Lease
    from hsx_client.sample_stream import SampleHead, SampleStream, StatesChunk, StatesLayout, states_layout
    from hsx_client.servers import ServerSet
    from hsx_client.settings import ClientSettings


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hsx_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hsx_client.{home}"), name)
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
