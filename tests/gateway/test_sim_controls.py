"""The gateway's copy of the simulator's test-switch protocol matches the
simulator's own (the request path may not import the simulator)."""

from gateway.core.request.sim_controls import SIM_FIELDS, SIM_OUTAGE_STATUSES
from inference_sim import config, protocol


def test_the_gateway_knows_the_simulators_switches():
    assert SIM_FIELDS == protocol.SIM_FIELDS


def test_the_gateway_knows_the_simulators_failure_statuses():
    assert SIM_OUTAGE_STATUSES == config.OUTAGE_STATUSES
