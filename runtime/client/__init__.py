"""What clients import: ``Client`` (async) and ``SyncClient``."""

from runtime.client.client import (
    Client,
    GenerationChunk,
    TokenLogprob,
    GenerationResult,
    RequestFailed,
    ServiceUnavailable,
    SyncClient,
)

__all__ = ["Client", "SyncClient", "GenerationResult", "GenerationChunk", "TokenLogprob", "RequestFailed", "ServiceUnavailable"]
