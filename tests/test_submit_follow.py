"""`cpattn submit` following its job, against a fake job server: a pending job is reminded of and then given up on
with what it waits for; a job that starts streams its logs to the end. (The real job server: test_cli.py.)"""

from __future__ import annotations

import argparse
import asyncio

import pytest
from ray.job_submission import JobStatus

from cpattn.errors import ServiceError
from cpattn.launch import submit


class FakeJobServer:
    def __init__(self, statuses: list[JobStatus], logs: list[str]):
        self.statuses, self.logs, self.stopped = list(statuses), logs, []

    def get_job_status(self, job_id: str) -> JobStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def stop_job(self, job_id: str) -> bool:
        self.stopped.append(job_id)
        return True

    async def tail_job_logs(self, job_id: str):
        while self.get_job_status(job_id) == JobStatus.PENDING:   # Ray's stream starts when the job does
            await asyncio.sleep(0.01)
        for line in self.logs:
            yield line


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(submit, "POLL_S", 0.02)
    monkeypatch.setattr(submit, "NOTICE_EVERY_S", 0.1)


def test_a_job_that_never_starts_is_reminded_of_then_stopped_with_what_it_waits_for(quick, capsys):
    server = FakeJobServer([JobStatus.PENDING], [])
    waiting_for = submit._waiting_for(argparse.Namespace(entrypoint_num_gpus=2.0, entrypoint_num_cpus=0.5, pip=[]))
    with pytest.raises(ServiceError, match=r"job j1 did not start within --pending-timeout-s=0.35: it was waiting "
                                           r"for a node with 2 GPU and 0.5 CPU free, or its runtime_env \(working_dir "
                                           r"upload\) to be set up\. It was told to stop") as info:
        asyncio.run(submit._follow(server, "j1", 0.35, waiting_for))
    assert "ray status" in str(info.value) and server.stopped == ["j1"]
    notices = [line for line in capsys.readouterr().err.splitlines() if "pending for" in line]
    assert 2 <= len(notices) <= 4 and "waiting for a node with 2 GPU and 0.5 CPU free" in notices[0], notices


def test_a_job_that_starts_streams_its_logs_to_the_end_and_is_never_stopped(quick, capsys):
    server = FakeJobServer([JobStatus.PENDING] * 3 + [JobStatus.RUNNING] * 2 + [JobStatus.SUCCEEDED],
                           ["one\n", "two\n"])
    asyncio.run(submit._follow(server, "j2", 60.0, "its runtime_env (working_dir upload) to be set up"))
    captured = capsys.readouterr()
    assert captured.out == "one\ntwo\n" and server.stopped == []


def test_a_job_asking_for_nothing_waits_only_for_its_runtime_env():
    nothing = argparse.Namespace(entrypoint_num_gpus=None, entrypoint_num_cpus=0.0, pip=["numpy"])
    assert submit._waiting_for(nothing) == "its runtime_env (working_dir upload, pip installs) to be set up"
