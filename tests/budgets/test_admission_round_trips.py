"""How many round trips an admission costs on a single Redis (gateway/core/
admission.py): the pool's admission and the spend hold in one script, and a
workload the pool has just refused asked admission alone for a second (a
refusal storm pays one plain script each). Not marked ``redis_cluster``: on a
cluster the two are separate scripts by design."""

from __future__ import annotations

from decimal import Decimal

import pytest
from django.conf import settings as django_settings

from budgets.admission import keys
from budgets.errors import Rejected
from budgets.models import SpendBudget
from gateway.core.request.context import context_for_workload
from tests.budgets.test_spend_admission import holds, price, settle_and_record, try_admit  # noqa: F401 - price: the fixture

pytestmark = pytest.mark.django_db(transaction=True)

if django_settings.SLUICE_REDIS_CLUSTER:
    pytestmark = [pytestmark, pytest.mark.skip(reason="on a cluster the pool's and the tenant's keys are two scripts")]




def test_on_a_single_redis_admission_and_hold_are_one_round_trip(make_caller, redis_client):
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    SpendBudget.objects.create(tenant=caller.tenant, monthly_amount=Decimal("0.02"), hard_cap=True)
    ctx = context_for_workload(caller.workload)
    try_admit(ctx, "warm")  # the tenant's spend is restored on first use
    redis_client.config_resetstat()
    try_admit(ctx, "one")
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    # a spend refusal still takes the lease back (a second script)
    with pytest.raises(Rejected) as excinfo:
        try_admit(ctx, "over")
    assert excinfo.value.reason == "spend_budget"
    assert not redis_client.exists(keys.lease(caller.pool.id, "over"))
    assert sorted(holds(redis_client, caller.tenant)) == ["one", "warm"]


def test_a_workload_the_pool_just_refused_is_asked_admission_alone(make_caller, redis_client):
    from gateway.core.request import admission as admission_module

    # given a priced workload allowed one request in flight, which has it
    caller = make_caller(reserved_tpm=600_000, ceiling_tpm=600_000)
    caller.reservation.max_concurrency = 1
    caller.reservation.save()
    from budgets.admission.pool_config import pool_config_push

    pool_config_push(pool=caller.pool)
    ctx = context_for_workload(caller.workload)
    settle_and_record(ctx, try_admit(ctx, "first"), input_tokens=10, output_tokens=10)
    try_admit(ctx, "in-flight")
    # when the pool refuses its next request: one script, nothing held
    redis_client.config_resetstat()
    with pytest.raises(Rejected):
        try_admit(ctx, "refused")
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    assert "refused" not in holds(redis_client, caller.tenant)
    # then for a second its requests go admission alone: a refusal is one
    # plain script, and an admission two (admit, then hold)
    with pytest.raises(Rejected):
        try_admit(ctx, "refused-again")
    redis_client.delete(keys.lease(caller.pool.id, "in-flight"),
                        keys.pool_leases(caller.pool.id), keys.workload_leases(caller.pool.id, caller.workload.id))
    redis_client.config_resetstat()
    admission = try_admit(ctx, "after")
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 2
    assert admission.spend_month and "after" in holds(redis_client, caller.tenant)
    # and once the second has passed, together again
    admission_module._refused_at[(caller.workload.id, caller.pool.id)] -= admission_module.REFUSED_RECENTLY_S
    redis_client.delete(keys.lease(caller.pool.id, "after"),
                        keys.pool_leases(caller.pool.id), keys.workload_leases(caller.pool.id, caller.workload.id))
    redis_client.config_resetstat()
    try_admit(ctx, "later")
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
