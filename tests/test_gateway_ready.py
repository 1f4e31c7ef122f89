"""A gateway process asks the scheduler itself before answering ``starting`` (and is stopped once).

With several gateway processes on one port, ``/health`` may answer 200 from one while another
has not yet polled the scheduler past its start-up; a request landing there must be served,
not refused (the early-gateway race the two-process test once hit).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from runtime.client import ServiceUnavailable
from runtime.gateway.upstream import Gateway
from runtime.gateway.errors import ApiError
from runtime.gateway.process import GatewayProcess


@dataclass
class _Status:
    worker_state: str
    max_context: int = 2048


class _Scheduler:
    """A client whose status answers are scripted."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.asked = 0

    async def status(self, timeout: float):
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _gateway(client: _Scheduler) -> Gateway:
    return Gateway(settings=None, model="m", metrics=None, tokens=None, client=client)  # type: ignore[arg-type]


async def test_a_request_before_this_process_polled_asks_the_scheduler():
    scheduler = _Scheduler(_Status("up", 4096))
    gw = _gateway(scheduler)
    limits = await gw.ready_limits()  # the start-up poll has not run: the request asks itself
    assert limits.max_context == 4096 and scheduler.asked == 1
    assert (await gw.ready_limits()).max_context == 4096 and scheduler.asked == 1  # asked once only


@pytest.mark.parametrize("answer", [_Status("starting"), ServiceUnavailable("not listening")])
async def test_a_starting_service_is_still_refused_at_once(answer):
    gw = _gateway(_Scheduler(answer))
    with pytest.raises(ApiError) as refused:
        await gw.ready_limits()
    assert refused.value.status == 503 and refused.value.code == "starting"
    assert gw.limits is None


async def test_the_start_up_poll_waits_for_the_worker():
    scheduler = _Scheduler(ServiceUnavailable("not yet"), _Status("starting"), _Status("up", 512))
    gw = _gateway(scheduler)
    await gw.wait_for_scheduler()
    assert gw.limits is not None and gw.limits.max_context == 512 and scheduler.asked == 3


async def test_health_asks_the_scheduler_once_per_call():
    scheduler = _Scheduler(_Status("starting"), _Status("up"), _Status("restarting"))
    gw = _gateway(scheduler)
    assert await gw.health() == (503, {"status": "starting", "scheduler": "starting"})
    assert await gw.health() == (200, {"status": "ok"}) and scheduler.asked == 2  # one query, not two
    assert gw.limits is not None
    assert await gw.health() == (503, {"status": "unavailable", "scheduler": "restarting"})
    assert scheduler.asked == 3


async def test_the_gateway_processes_are_stopped_once(tmp_path):
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    gateway = GatewayProcess([proc], "http://127.0.0.1:1", str(metrics))
    await gateway.stop()
    assert proc.returncode is not None and not metrics.exists()
    metrics.mkdir()  # a second stop (runtime up's way out after the serving loop's) touches nothing
    await gateway.stop()
    assert metrics.exists()
