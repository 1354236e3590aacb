"""GET /v1/jobs: a workload's jobs, newest first, in OpenAI's list shape,
with a status filter and keyset paging; never another workload's jobs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from gateway.models import Job

pytestmark = pytest.mark.django_db(transaction=True)


def make_jobs(caller, statuses: list[str]) -> list[Job]:
    """Jobs created one second apart, oldest first."""
    start = timezone.now() - timedelta(minutes=10)
    jobs = []
    for i, status in enumerate(statuses):
        job = Job.objects.create(tenant=caller.tenant, workload=caller.workload, status=status, body={"n": i},
                                 body_sha256=f"{i:064d}", deadline=start + timedelta(hours=1))
        Job.objects.filter(pk=job.pk).update(created_at=start + timedelta(seconds=i))
        jobs.append(job)
    return jobs


def get(api_key: str, query: str = ""):
    return Client().get(f"/v1/jobs{query}", HTTP_AUTHORIZATION=f"Bearer {api_key}")


def test_lists_own_jobs_newest_first_in_pages(make_caller):
    # given 5 jobs of one workload and 2 of another tenant's
    caller = make_caller()
    other = make_caller()
    jobs = make_jobs(caller, ["queued", "succeeded", "delayed", "failed", "succeeded"])
    make_jobs(other, ["queued", "queued"])
    newest_first = [str(j.id) for j in reversed(jobs)]
    # when the first page of 2 is read
    first = get(caller.api_key, "?limit=2")
    # then it is an OpenAI list with the two newest and has_more
    assert first.status_code == 200, first.content
    body = first.json()
    assert body["object"] == "list"
    assert [j["id"] for j in body["data"]] == newest_first[:2]
    assert body["has_more"] is True
    assert body["first_id"] == newest_first[0] and body["last_id"] == newest_first[1]
    assert body["data"][0]["object"] == "job" and body["data"][0]["status"] == "succeeded"
    # and the pages after it continue without overlap, ending with has_more false
    second = get(caller.api_key, f"?limit=2&after={body['last_id']}").json()
    third = get(caller.api_key, f"?limit=2&after={second['last_id']}").json()
    assert [j["id"] for j in second["data"]] == newest_first[2:4]
    assert [j["id"] for j in third["data"]] == newest_first[4:]
    assert (second["has_more"], third["has_more"]) == (True, False)
    # and the other workload's key sees only its own two
    assert len(get(other.api_key).json()["data"]) == 2


def test_status_filter(make_caller):
    caller = make_caller()
    jobs = make_jobs(caller, ["queued", "succeeded", "delayed", "succeeded"])
    body = get(caller.api_key, "?status=succeeded").json()
    assert [j["id"] for j in body["data"]] == [str(jobs[3].id), str(jobs[1].id)]
    assert body["has_more"] is False


def test_a_cursor_of_another_workload_is_refused(make_caller):
    caller = make_caller()
    other = make_caller()
    theirs = make_jobs(other, ["queued"])[0]
    response = get(caller.api_key, f"?after={theirs.id}")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_cursor"


@pytest.mark.parametrize("query, code", [
    ("?status=bogus", "invalid_status"),
    ("?limit=0", "invalid_limit"),
    ("?limit=101", "invalid_limit"),
    ("?limit=ten", "invalid_limit"),
    ("?after=not-a-uuid", "invalid_cursor"),
])
def test_bad_queries_are_openai_shaped_400s(make_caller, query, code):
    caller = make_caller()
    response = get(caller.api_key, query)
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


def test_needs_a_key_and_other_methods_are_405(make_caller):
    assert Client().get("/v1/jobs").status_code == 401
    caller = make_caller()
    response = Client().delete("/v1/jobs", HTTP_AUTHORIZATION=f"Bearer {caller.api_key}")
    assert response.status_code == 405
    assert response.headers["Allow"] == "GET, HEAD, POST"
