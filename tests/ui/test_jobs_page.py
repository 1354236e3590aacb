"""The jobs page of a workload: delayed (with release time), queued,
running and finished jobs; members see only their own tenant's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gateway.core import keys
from gateway.models import Job

pytestmark = pytest.mark.django_db


def make_job(world, status: str, **fields) -> Job:
    return Job.objects.create(tenant=world.tenant_a, workload=world.wl_a, status=status, body={}, body_sha256="0" * 64,
                              deadline=timezone.now() + timedelta(hours=1), **fields)


def test_jobs_page_shows_each_state(login, world, redis_client):
    # given a delayed job with its release time, a queued one, one a worker started, a finished one
    release = timezone.now().replace(microsecond=0) + timedelta(minutes=3)
    delayed = make_job(world, "delayed", release_at=release, reason="workload_tpm", delays=2)
    queued = make_job(world, "queued", request_id="req-queued")
    running = make_job(world, "queued", request_id="req-running")
    done = make_job(world, "succeeded", request_id="req-done", finished_at=timezone.now())
    redis_client.set(keys.request_owner("req-running"), "worker:0")
    # when the member opens the page
    response = login(world.member_a).get(f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/jobs")
    # then every job is there in its state, the delayed one with its release time
    assert response.status_code == 200
    body = response.content.decode()
    for job in (delayed, queued, running, done):
        assert str(job.id) in body
    assert release.strftime("%Y-%m-%d %H:%M:%S") in body and "workload_tpm" in body
    assert body.count(">Running</span>") == 1 and body.count(">Queued on its lane</span>") == 1
    assert body.count(">Succeeded</span>") == 1 and body.count(">Delayed (waiting for budget)</span>") == 1
    # and the status filter narrows it
    filtered = login(world.member_a).get(f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/jobs?status=delayed")
    assert str(delayed.id) in filtered.content.decode() and str(done.id) not in filtered.content.decode()


def test_jobs_page_is_tenant_scoped(login, world):
    make_job(world, "queued")
    url = f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/jobs"
    assert login(world.member_b).get(url).status_code == 404
    # a workload of another tenant under one's own tenant's slug is not found either
    assert login(world.member_b).get(f"/t/{world.tenant_b.slug}/workloads/{world.wl_a.slug}/jobs").status_code == 404
    assert login(world.finance).get(url).status_code == 200
    assert login(world.admin).get(url).status_code == 200


def test_a_bad_filter_is_a_400_page(login, world):
    response = login(world.member_a).get(f"/t/{world.tenant_a.slug}/workloads/{world.wl_a.slug}/jobs?status=bogus")
    assert response.status_code == 400 and "must be one of" in response.content.decode()
