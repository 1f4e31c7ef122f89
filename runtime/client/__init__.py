"""What clients import: ``Client`` (async) and ``SyncClient``."""

from runtime.client.client import (
    Client,
    GenerationChunk,
    GenerationResult,
    RequestFailed,
    ServiceUnavailable,
    TokenLogprob,
)
from runtime.client.sync_client import SyncClient

__all__ = ["Client", "SyncClient", "GenerationResult", "GenerationChunk", "TokenLogprob", "RequestFailed", "ServiceUnavailable"]
