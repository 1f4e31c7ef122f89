"""The bench's --pin-clients split: disjoint halves of the physical cores, and affinity restored."""

from __future__ import annotations

import os

import pytest

from runtime.bench import pinning

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")


def test_cores_cover_the_allowed_cpus_once():
    cores = pinning.physical_cores()
    flat = [cpu for core in cores for cpu in core]
    assert sorted(flat) == sorted(os.sched_getaffinity(0))


def test_split_is_disjoint_halves_of_whole_cores():
    split = pinning.split_cpus()
    cores = pinning.physical_cores()
    if len(cores) < 4:
        assert split is None
        return
    service, clients = split
    assert not service & clients and service | clients == os.sched_getaffinity(0)
    for core in cores:  # a core's hardware threads stay together
        assert set(core) <= service or set(core) <= clients


def test_pinned_restores_the_affinity():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    with pinning.pinned(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with pinning.pinned(None):
        assert os.sched_getaffinity(0) == before
