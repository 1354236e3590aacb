"""Routing across pools at admission: a request for model M is admitted on
the first pool of its workload's route that has room for it
(docs/architecture.md, "Routing across pools").

The route is the workload's slices whose pools serve M, by rank
(``CallerContext.route``); slices of equal rank (replicas) are tried in the
order of their pools' headroom now (``budgets/admission/headroom.py``).
Each pool's admission stays one atomic step (``admission_plan``). A refusal
for the pool's or the slice's own limits moves the request to the next pool
of its route; a refusal for what belongs to the tenant or the workload as a
whole (its spend caps) is final at once, since every pool would give it.
A pool whose circuit is not closed admits by holding the request until the
provider recovers (gateway/core/protection/held.py): with a pool after it in
the route, its lease is given back and the next pool is asked instead, so a
pool that is failing is skipped while another can serve; except the one
request the circuit takes as its half-open trial (gateway/core/protection/circuit.lua, its gate), which
goes to that pool's lane at once: its success closes the circuit and brings
the route back to its primary, its failure moves it on to the next pool
(gateway/worker/failover.py). The caller hears a
429 only when every pool refused: the smallest Retry-After among them, the
reason of the pool that will have room first, and every pool's reason in
the message.

The request keeps one id on every pool it is asked on: each pool's lease is
keyed by it under the pool's own hash tag, and the tenant's spend hold is
taken once (a second pool's hold of the same id answers "held already")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from budgets.admission.buckets import Admission, lease_give_back_call
from budgets.admission.estimation import Estimate
from budgets.admission.headroom import headroom_call
from budgets.admission.spend_holds import spend_settle_call
from budgets.errors import BudgetUnavailable, Rejected
from budgets.redis.clients import REDIS_UNAVAILABLE
from budgets.redis.composition import Plan, RoundTrip, Step, plan_run, plan_run_async
from gateway.core.errors import budget_unavailable, no_reservation
from gateway.core.protection.circuit import circuit_gate_call
from gateway.core.request.admission import admission_plan
from gateway.core.request.context import CallerContext

# Refusals for the tenant or the workload as a whole: every pool would give them.
WHOLE_WORKLOAD_REASONS = frozenset({"spend_budget"})


@dataclass(frozen=True)
class Routed:
    """Where a request was admitted: ``ctx`` on the admitting pool, its
    estimate with that pool's tokenizer, and the pools after it in the route
    (ids), where a call that fails before its first token may move once."""

    ctx: CallerContext
    admission: Admission
    estimate: Estimate
    fallback_pool_ids: tuple[int, ...]


def route_refused(refusals: list[tuple[CallerContext, Rejected]]) -> Rejected:
    """Every pool of the route refused: the budget refusal (429) of the
    pool that will have room first (the smallest Retry-After; one that never
    will last), or, when none refused for budget (every pool failing or
    down), the soonest of the others; its x-ratelimit-* numbers are that
    pool's; every pool's reason is named."""
    budget = [r for r in refusals if r[1].status == 429] or refusals
    first_ctx, first = min(budget, key=lambda r: (r[1].retry_after_ms is None, r[1].retry_after_ms or 0))
    reasons = "; ".join(f"{c.pool_slug}: {r.reason}" for c, r in refusals)
    return replace(first, message=f"{first.message} Every pool of this workload's route refused ({reasons}).",
                   limits=first_ctx.limits,
                   headers={**first.headers, "x-sluice-pool": first_ctx.pool_slug,
                            "x-sluice-route-refusals": reasons})


def _held_skip(ctx: CallerContext, request_id: str) -> Plan[None]:
    """Give back the lease a held admission took on a pool whose circuit is
    not closed (the spend hold stays for the next pool of the route)."""
    yield lease_give_back_call(pool_id=ctx.pool_id, workload_id=ctx.workload_id, request_id=request_id)


def routed_admission_plan(route: tuple[CallerContext, ...], *, request_id: str, model: str,
                          estimate_for: Callable[[CallerContext], Estimate], lease_ms: int,
                          body_digest: str = "") -> Plan[Routed]:
    """Admit on the first pool of ``route`` with room (see the module's
    docstring). ``estimate_for``: the request's estimate with a pool's
    tokenizer (it raises Rejected for a prompt over the workload's cap)."""
    if not route:
        raise no_reservation(on_any_pool=True)
    refusals: list[tuple[CallerContext, Rejected]] = []
    spend_month = ""
    for position, ctx in enumerate(route):
        last = position == len(route) - 1
        try:
            # Each pool counts with its own tokenizer: a prompt over the cap
            # there is that pool's refusal, not the route's.
            estimate = estimate_for(ctx)
            admission = yield from admission_plan(ctx, request_id=request_id, model=model, estimate=estimate,
                                                  lease_ms=lease_ms, body_digest=body_digest)
        except Rejected as rejected:
            rejected.headers = {**rejected.headers, "x-sluice-pool": ctx.pool_slug}
            rejected.limits = rejected.limits or ctx.limits
            if rejected.reason in WHOLE_WORKLOAD_REASONS or (last and not refusals):
                yield from _spend_forget(route[0], request_id, spend_month)
                raise
            refusals.append((ctx, rejected))
            if last:
                yield from _spend_forget(route[0], request_id, spend_month)
                raise route_refused(refusals) from rejected
            continue
        if admission.held and not last:
            gate = yield circuit_gate_call(pool_id=ctx.pool_id, holder=request_id)
            if gate.go and gate.state == "half-open":
                # The circuit's trial: straight to the lane, not held.
                admission = replace(admission, held=False)
            elif gate.go:
                pass  # closed: held for the body's earlier hold (held.py), as on any route
            else:
                # Its circuit is open: another pool of the route may serve now.
                spend_month = admission.spend_month or spend_month
                yield from _held_skip(ctx, request_id)
                refusals.append((ctx, Rejected(reason="pool_circuit_open", status=503, retry_after_ms=1000,
                                               message=f"The pool {ctx.pool_slug} is failing.",
                                               error_type="service_unavailable")))
                continue
        if not admission.spend_month and spend_month:
            admission = replace(admission, spend_month=spend_month)
        return Routed(ctx=ctx, admission=admission, estimate=estimate,
                      fallback_pool_ids=tuple(c.pool_id for c in route[position + 1:]))
    raise AssertionError("unreachable: the last pool either admits or raises")


def _spend_forget(ctx: CallerContext, request_id: str, spend_month: str) -> Plan[None]:
    """A spend hold taken on a pool that was then skipped (held), when no
    other pool admitted: the request does not exist, nor does its hold."""
    if spend_month:
        yield spend_settle_call(tenant_id=ctx.tenant_id, month=spend_month, request_id=request_id, forget=True)


# --- equal ranks by headroom ----------------------------------------------------------


def _has_replicas(route: tuple[CallerContext, ...]) -> bool:
    ranks = [c.slice_rank for c in route]
    return len(set(ranks)) < len(ranks)


def headroom_steps(route: tuple[CallerContext, ...]) -> list[Step]:
    """One headroom read per pool that shares its rank with another."""
    ranks = [c.slice_rank for c in route]
    return [Step(f"headroom:{c.pool_id}", headroom_call(pool_id=c.pool_id))
            for c in route if ranks.count(c.slice_rank) > 1]


def route_by_headroom(route: tuple[CallerContext, ...], headroom: dict[int, float]) -> tuple[CallerContext, ...]:
    """The route with each group of equal rank ordered by its pools' headroom
    (most first; ties keep the slices' order). Ranks keep their order."""
    order = {id(c): i for i, c in enumerate(route)}
    return tuple(sorted(route, key=lambda c: (c.slice_rank, -headroom.get(c.pool_id, 0.0), order[id(c)])))


def _headroom_of(answers) -> dict[int, float]:
    return {int(name.split(":", 1)[1]): value for name, value in answers.items()}


def route_ordered(route: tuple[CallerContext, ...]) -> tuple[CallerContext, ...]:
    """``route`` with its replicas by headroom (sync callers)."""
    if not _has_replicas(route):
        return route
    try:
        return route_by_headroom(route, _headroom_of(RoundTrip(*headroom_steps(route)).run()))
    except (*REDIS_UNAVAILABLE, BudgetUnavailable):
        return route  # admission itself will say whether Redis is there


async def route_ordered_async(route: tuple[CallerContext, ...]) -> tuple[CallerContext, ...]:
    if not _has_replicas(route):
        return route
    try:
        return route_by_headroom(route, _headroom_of(await RoundTrip(*headroom_steps(route)).run_async()))
    except (*REDIS_UNAVAILABLE, BudgetUnavailable):
        return route


def request_route_admit(route: tuple[CallerContext, ...], *, request_id: str, model: str,
                        estimate_for: Callable[[CallerContext], Estimate], lease_ms: int,
                        body_digest: str = "") -> Routed:
    """Admit on the route or raise Rejected (every pool's refusal, a whole-
    workload refusal, no_reservation, budget_unavailable)."""
    try:
        return plan_run(routed_admission_plan(route_ordered(route), request_id=request_id, model=model,
                                              estimate_for=estimate_for, lease_ms=lease_ms, body_digest=body_digest))
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc


async def request_route_admit_async(route: tuple[CallerContext, ...], *, request_id: str, model: str,
                                    estimate_for: Callable[[CallerContext], Estimate], lease_ms: int,
                                    body_digest: str = "") -> Routed:
    """``request_route_admit`` for the async API views."""
    try:
        return await plan_run_async(routed_admission_plan(
            await route_ordered_async(route), request_id=request_id, model=model, estimate_for=estimate_for,
            lease_ms=lease_ms, body_digest=body_digest))
    except BudgetUnavailable as exc:
        raise budget_unavailable() from exc
