"""What ``runtime up`` hands the gateway process (as JSON on its command line)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GatewaySettings:
    """The scheduler's client address, the model, and the ``[http]`` keys the app needs."""

    scheduler_address: str
    model_path: str
    served_model_name: str
    api_keys: tuple[str, ...] = ()
    server_key: str | None = None  # the scheduler's CURVE public key when CURVE is on
    metrics_dir: str | None = None  # several gateway processes: their shared Prometheus files

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> GatewaySettings:
        data = json.loads(text)
        data["api_keys"] = tuple(data.get("api_keys", ()))
        return cls(**data)
