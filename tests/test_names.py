"""The names the agent and the controller share (agent/names.py), on plain data: the brake ConfigMap's data as the
controller writes it reads back the same with the one parser both programs use, a malformed one is told apart, and
the parser stays linear and bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agent.act.brake import admitted_nodes, engaged_for
from agent.controller.plan import BrakeState
from agent.names import (
    BRAKE_ADMITTED,
    MAX_ADMITTED_BYTES,
    format_brake,
    parse_admitted,
)

NODE = st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,20}[a-z0-9])?", fullmatch=True)


@given(admitted=st.lists(NODE, max_size=20, unique=True), unavailable=st.integers(0, 50), budget=st.integers(0, 50))
def test_what_the_controller_writes_the_agent_reads_back(admitted: list[str], unavailable: int, budget: int) -> None:
    data = format_brake(unavailable > budget, admitted, unavailable, budget, 100)
    assert parse_admitted(data) == tuple(admitted)
    assert admitted_nodes({"data": data}) == frozenset(admitted)
    for node in admitted:
        assert not engaged_for({"data": data}, node)  # admitted: not held


def test_the_brake_state_writes_through_the_one_formatter() -> None:
    st_ = BrakeState(gpu_nodes=4, unavailable=("a", "b", "c"), budget=2, admitted=("b", "a"))
    assert st_.data() == {
        "engaged": "true",
        "admitted": "b,a",
        "unavailable": "3",
        "maxUnavailable": "2",
        "gpuNodes": "4",
    }


def test_one_reading_of_admitted_spaces_and_blanks_dropped() -> None:
    assert parse_admitted({BRAKE_ADMITTED: " a, b ,,c "}) == ("a", "b", "c")
    assert parse_admitted({BRAKE_ADMITTED: ""}) == ()  # present and empty: no node admitted


def test_a_malformed_brake_is_none_and_the_agent_holds() -> None:
    for data in (
        None,
        "x",
        {},
        {"engaged": "false"},
        {BRAKE_ADMITTED: 3},
        {BRAKE_ADMITTED: "a" * (MAX_ADMITTED_BYTES + 1)},
    ):
        assert parse_admitted(data) is None, data
        assert engaged_for({"data": data}, "a")  # fails closed
