"""Letting MLX's CUDA backend release finished work's buffers before writes in place.

MLX writes an array in place (a pool's scatter) only when nothing else holds its buffer. A
kernel queued on a CUDA stream holds its inputs' buffers until MLX's completion thread runs
the command's handlers, some time after the GPU finished it and after any ``mx.eval`` waiting
on it returned. A pool write evaluated in that window finds the pool still held by the decode
step just read back (whose attention read every layer's pool) and copies the whole pool layer
instead: gigabytes a step on a production pool, and a new allocation each time near a full
device. ``mx.synchronize`` waits for the stream and for a handler queued behind every earlier
one, so the writes after it find the buffers free.
"""

from __future__ import annotations

import mlx.core as mx


def release_finished() -> None:
    """Wait until the default stream's finished work has released its buffers (cheap when the
    stream is idle: a round trip through MLX's completion thread)."""
    mx.synchronize()
