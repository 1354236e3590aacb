"""``GET /metrics``: Prometheus exposition of the whole platform, for an
operator's scraper (docs/observability.md has the list and the dashboard).

Two sources, one answer:
- what the processes counted (gateway/core/observability.py): with
  PROMETHEUS_MULTIPROC_DIR set, the files every web and worker process
  writes there, added up; without it, this process's own numbers;
- what is true right now, read from Redis and the database at scrape time:
  in-flight requests and lambda*W per pool and lane, queue depth per lane, the
  adaptive capacity factor, the pool retry budgets, and which pool and
  workload each id is (``*_info``, to put names on the ids).

Only a configured token or a local, unproxied client may scrape it
(settings.SLUICE_METRICS_TOKEN, SLUICE_METRICS_ALLOWED_NETWORKS)."""

from __future__ import annotations

import hmac
import ipaddress
import logging

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from budgets.redis.clients import get_redis
from budgets.models import InferencePool
from gateway.core import keys
from gateway.core.metrics import pool_live_metrics, queue_depths
from gateway.core.protection.throttle import request_client_address
from gateway.web.auth import bearer_key
from tenants.models import Workload

logger = logging.getLogger(__name__)

# A request relayed by a proxy arrives from the proxy's address, often a local
# one: it is never "local" for the allow-list, whatever its address says.
FORWARDING_HEADERS = ("X-Forwarded-For", "Forwarded", "X-Real-IP")


def metrics_access_allowed(request: HttpRequest) -> bool:
    token = settings.SLUICE_METRICS_TOKEN
    if token:
        presented = bearer_key(request.headers.get("Authorization"))
        if presented is not None and hmac.compare_digest(presented.encode(), token.encode()):
            return True
    if any(name in request.headers for name in FORWARDING_HEADERS):
        return False
    try:
        # Unproxied, so the caller's address (the one helper every throttle
        # uses) is the peer's own.
        client = ipaddress.ip_address(request_client_address(request.META))
    except ValueError:
        return False
    if client.version == 6 and client.ipv4_mapped is not None:
        client = client.ipv4_mapped
    return any(client in network for network in settings.SLUICE_METRICS_ALLOWED_NETWORKS)


class _ThisProcess:
    """The process's own registry, when there is no directory to add up."""

    def collect(self):
        return REGISTRY.collect()


class LiveCollector:
    """Numbers that live in Redis and the database, read at scrape time."""

    def collect(self):
        up = GaugeMetricFamily("sluice_live_metrics_up",
                               "1 when the live numbers (Redis, database) could be read for this scrape.")
        try:
            families = list(self._families())
        except Exception as exc:  # noqa: BLE001 - a scrape must still show the counters when Redis is away
            logger.warning("metrics: live numbers unavailable: %s", exc)
            up.add_metric([], 0)
            return [up]
        up.add_metric([], 1)
        return [up, *families]

    def _families(self):
        pool_info = GaugeMetricFamily("sluice_pool_info", "Always 1: the pool's slug for its id.", labels=["pool_id", "pool"])
        workload_info = GaugeMetricFamily("sluice_workload_info", "Always 1: the workload's and tenant's slugs for its id.",
                                          labels=["workload_id", "workload", "tenant"])
        capacity = GaugeMetricFamily("sluice_pool_capacity_factor",
                                     "The pool's adaptive admission rate as a share of its configured one.",
                                     labels=["pool_id"])
        pool_in_flight = GaugeMetricFamily("sluice_pool_in_flight", "Requests holding a lease on the pool.",
                                           labels=["pool_id"])
        lane_in_flight = GaugeMetricFamily("sluice_lane_in_flight", "Measured in-flight requests L, per pool and lane.",
                                           labels=["pool_id", "lane"])
        lambda_w = GaugeMetricFamily("sluice_lane_lambda_w",
                                     "Little's law lambda*W over the last minute, to set beside the measured L.",
                                     labels=["pool_id", "lane"])
        arrival_rate = GaugeMetricFamily("sluice_lane_arrival_rate", "Arrivals per second over the last minute.",
                                         labels=["pool_id", "lane"])
        time_in_system = GaugeMetricFamily("sluice_lane_time_in_system_seconds",
                                           "Mean time in system W over the last minute.", labels=["pool_id", "lane"])
        first_attempts = CounterMetricFamily("sluice_pool_retry_first_attempts",
                                             "First attempts, each earning the pool a share of a retry.",
                                             labels=["pool_id"])
        retries = CounterMetricFamily("sluice_pool_retries", "Retries spent from the pool's retry budget.",
                                      labels=["pool_id"])
        retry_refusals = CounterMetricFamily("sluice_pool_retry_refusals", "Retries refused, by the budget that refused.",
                                             labels=["pool_id", "budget"])
        retry_tokens = GaugeMetricFamily("sluice_pool_retry_tokens", "Retries the pool's budget holds now.",
                                         labels=["pool_id"])
        lane_limit = GaugeMetricFamily("sluice_lane_concurrency_limit",
                                       "The adaptive limit of a lane's concurrent pool calls, per pool and lane.",
                                       labels=["pool_id", "lane"])
        lane_limit_in_use = GaugeMetricFamily("sluice_lane_concurrency_in_use",
                                              "A limited lane's slots held in a pool call now.",
                                              labels=["pool_id", "lane"])
        provider_remaining = GaugeMetricFamily("sluice_pool_provider_remaining",
                                               "What the provider's x-ratelimit-remaining-* headers last said, less "
                                               "what was sent since (NaN: it never said).", labels=["pool_id", "unit"])
        circuit = GaugeMetricFamily("sluice_pool_circuit_state",
                                    "1 for the pool's circuit breaker state (closed, open, half-open).",
                                    labels=["pool_id", "state"])
        relay_rate = GaugeMetricFamily("sluice_lane_relay_tokens_per_second",
                                       "Output tokens relayed to callers per second over the last minute, per pool "
                                       "and lane (counted as each request finishes).", labels=["pool_id", "lane"])
        held = GaugeMetricFamily("sluice_pool_held_requests",
                                 "Requests admitted through an outage and held until the provider has room.",
                                 labels=["pool_id"])
        client = get_redis()
        for workload_id, workload_slug, tenant_slug in Workload.objects.values_list("id", "slug", "tenant__slug"):
            workload_info.add_metric([str(workload_id), workload_slug, tenant_slug], 1)
        for pool_id, slug in InferencePool.objects.values_list("id", "slug"):
            pid = str(pool_id)
            pool_info.add_metric([pid, slug], 1)
            live = pool_live_metrics(pool_id=pool_id)
            capacity.add_metric([pid], live["effective_capacity_factor"])
            for lane, numbers in live["lane_limits"].items():
                lane_limit.add_metric([pid, lane], numbers["limit"])
                lane_limit_in_use.add_metric([pid, lane], numbers["in_use"])
            for unit in ("tokens", "requests"):
                # NaN: the provider never stated it (a gap on a graph, not a false 0).
                remaining = live["provider"][f"remaining_{unit}"]
                provider_remaining.add_metric([pid, unit], float("nan") if remaining is None else remaining)
            for state in ("closed", "open", "half-open"):
                circuit.add_metric([pid, state], 1 if live["circuit"]["state"] == state else 0)
            held.add_metric([pid], live["circuit"].get("held", 0))
            pool_in_flight.add_metric([pid], live["in_flight"])
            for lane, numbers in live["lanes"].items():
                lane_in_flight.add_metric([pid, lane], numbers["in_flight"])
                lambda_w.add_metric([pid, lane], numbers["littles_l"])
                arrival_rate.add_metric([pid, lane], numbers["arrival_rate_per_s"])
                time_in_system.add_metric([pid, lane], numbers["mean_time_in_system_s"])
                relay_rate.add_metric([pid, lane], numbers["relay_tokens_per_s"])
            budget = client.hgetall(keys.pool_retry(pool_id))
            first_attempts.add_metric([pid], float(budget.get("first_attempts", 0)))
            retries.add_metric([pid], float(budget.get("retries", 0)))
            retry_refusals.add_metric([pid, "pool"], float(budget.get("refused_pool", 0)))
            retry_refusals.add_metric([pid, "session"], float(budget.get("refused_session", 0)))
            retry_tokens.add_metric([pid], float(budget.get("tokens", 0)))
        yield from (pool_info, workload_info, capacity, pool_in_flight, lane_in_flight, lambda_w, arrival_rate,
                    time_in_system, first_attempts, retries, retry_refusals, retry_tokens, lane_limit,
                    lane_limit_in_use, provider_remaining, circuit, held, relay_rate)
        try:
            depths = queue_depths()
        except Exception as exc:  # noqa: BLE001 - the broker may live elsewhere and be down
            logger.warning("metrics: queue depths unavailable: %s", exc)
            return
        depth = GaugeMetricFamily("sluice_queue_depth",
                                  "Admitted calls waiting in each lane's queue for a worker (zero below the pools' "
                                  "limits: the lanes are sized by them).", labels=["lane"])
        for lane, waiting in depths.items():
            depth.add_metric([lane], waiting)
        yield depth


def metrics(request: HttpRequest) -> HttpResponse:
    if request.method != "GET":
        return HttpResponse("Use GET.\n", status=405, content_type="text/plain")
    if not metrics_access_allowed(request):
        if settings.SLUICE_METRICS_TOKEN:
            response = HttpResponse("A metrics token is required.\n", status=401, content_type="text/plain")
            response["WWW-Authenticate"] = 'Bearer realm="metrics"'
            return response
        return HttpResponse("Metrics are not served to this address.\n", status=403, content_type="text/plain")
    registry = CollectorRegistry()
    if settings.SLUICE_METRICS_DIR:
        try:
            MultiProcessCollector(registry, path=settings.SLUICE_METRICS_DIR)
        except ValueError:
            logger.error("metrics: PROMETHEUS_MULTIPROC_DIR %s is not a directory", settings.SLUICE_METRICS_DIR)
            return HttpResponse("The metrics directory is missing.\n", status=503, content_type="text/plain")
    else:
        registry.register(_ThisProcess())
    registry.register(LiveCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
