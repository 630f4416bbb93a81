"""A cancel's reason reaches the task's end (issue 11): the gateway cancels a
task a stop sequence ended with its own reason, and the task's record must
say that, not a generic "cancelled by the client"; without a reason the
generic one stays.
"""

from __future__ import annotations

from factories import make_profile, make_request
from test_engine import EngineDriver
from test_engine_v2 import make_engine

from lemix.engine import Failed

STOPPED = "CANCELLED: a stop sequence ended the completion"


def test_a_waiting_request_ends_with_the_cancels_reason() -> None:
    engine = make_engine(make_profile(), num_micro_batches=2, max_batch_size=2)
    driver = EngineDriver(engine)
    for i in range(3):
        driver.add(make_request(f"r{i}", 0.0, 10, 5, seq=i))
    driver.run(until_s=0.001)
    assert [r.task.task_id for r in engine.waiting] == ["r2"]
    found, _, outcomes = engine.cancel("r2", driver.now_s, STOPPED)
    assert found and outcomes == [Failed("r2", STOPPED)]


def test_an_in_flight_request_ends_with_it_when_its_iteration_ends() -> None:
    engine = make_engine(make_profile(), num_micro_batches=1)
    driver = EngineDriver(engine)
    driver.add(make_request("a", 0.0, 10, 50))
    driver.add(make_request("b", 0.0, 10, 50, seq=1))
    driver.run(until_s=0.05)
    assert all(b.is_in_flight for b in engine.micro_batches)
    assert engine.cancel("a", driver.now_s, "the client left")[0]  # no status prefix: added
    assert engine.cancel("b", driver.now_s)[0]
    driver.run()
    reasons = {o.task_id: o.reason for _, o in driver.of(Failed)}
    assert reasons == {
        "a": "CANCELLED: the client left",
        "b": "CANCELLED: cancelled by the client",
    }
