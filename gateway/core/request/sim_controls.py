"""The simulated pool's test switches (a chat body's ``sim`` object), as the
gateway knows them: it checks them before a pool call is spent on a bad one,
and forwards them only to a pool that is a simulator (SLUICE_SIM_CONTROLS).

This is the client's side of the simulator's protocol, written here because
the request path never imports the simulator (it stands in for a GPU server,
a separate program). tests/gateway/test_sim_controls.py fails when the two
sides disagree."""

# The switches a request may set, and the statuses an injected failure may answer.
SIM_FIELDS = ("output_tokens", "fail_status", "fail_retry_after", "latency_ms", "fail_after_tokens")
SIM_OUTAGE_STATUSES = (429, 500, 502, 503)
