"""A step the engine has built and queued on the device, until its tokens are read back."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from runtime.protocol.worker import DecodeBatch, PromptLogprobs, Step
from runtime.worker.sampler import StepDraws


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device but not read back yet."""

    step_id: int
    tokens: mx.array | None = None
    draws: StepDraws | None = None
    logprobs: tuple[list, list, list] | None = None  # read back with the tokens, when a row asked
    written: mx.array | None = None
    step: Step | None = None
    in_place: bool = True  # updates the pools in place: submit only after the previous read-back
    first_tokens: bool = False  # has prefill chunks: some request's first token comes from it
    awaiting: DecodeBatch | None = None  # a decode whose deferred rows' masks have not come yet
    logits: mx.array | None = None  # that decode's logits, sampled by ``apply_masks``
    # prefill chunks that asked for prompt logprobs: (chunk, chosen, top ids, top values), lazy ...
    prompt_arrays: list[tuple] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # ... and read back
