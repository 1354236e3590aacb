"""Job callbacks without SSRF: which URLs are refused (at submission and
again at send time), DNS answers that point inside or change between submit
and send, pinning the connection to the checked address, signing, backoff,
the delivery log. Sending runs in-process here (callback_deliver, what the
housekeeping task calls); DNS is played by patching our resolver function.
The end-to-end path through the processes is in test_callbacks_live.py."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from datetime import timedelta

import httpx
import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule

from gateway.core import keys
from gateway.core.jobs.callbacks import (CallbackRefused, callback_backoff_s, callback_signature, callback_signature_verify,
                                    callback_target_resolve, callback_url_check, callback_url_parse)
from gateway.models import Job, JobCallbackDelivery, JobSchedule
from gateway.worker.callbacks import callback_deliver
from tenants import outbound
from tenants.models import Tenant
from tenants.services import tenant_callback_secret_rotate
from tests.receivers import CallbackReceiver

HELLO = [{"role": "user", "content": "hi"}]
PUBLIC = "93.184.215.14"


@pytest.fixture
def strict(settings):
    """The production defaults: https only, public receivers only."""
    settings.SLUICE_CALLBACK_ALLOW_HTTP = False
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = False
    return settings


@pytest.fixture
def dns(monkeypatch):
    """A DNS server for the test: name -> addresses (changeable mid-test),
    with a count of lookups per name."""
    answers: dict[str, list[str]] = {}
    lookups: dict[str, int] = {}

    def resolve(host: str, port: int) -> list[str]:
        lookups[host] = lookups.get(host, 0) + 1
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(answers[host])

    monkeypatch.setattr(outbound, "resolve_host", resolve)  # the guard lives in tenants.outbound
    resolve.answers = answers
    resolve.lookups = lookups
    return resolve


# --- refused at submission ----------------------------------------------------------------


@pytest.mark.parametrize("url,why", [
    ("http://hooks.example.com/x", "must be an https URL"),
    ("ftp://hooks.example.com/x", "must be an https URL"),
    ("https://127.0.0.1:8080/x", "a loopback address"),
    ("https://[::1]/x", "a loopback address"),
    ("https://[::ffff:127.0.0.1]/x", "a loopback address"),
    ("https://[2002:7f00:1::]/x", "a loopback address"),  # 6to4 around 127.0.0.1
    ("https://localhost/x", "an internal host name"),
    ("https://localhost./x", "an internal host name"),
    ("https://LOCALHOST/x", "an internal host name"),
    ("https://ｌｏｃａｌｈｏｓｔ/x", "an internal host name"),  # fullwidth: IDNA maps it to localhost
    ("https://api.localhost/x", "an internal host name"),
    ("https://2130706433/x", "an IP address not written as a plain IP literal"),
    ("https://0x7f000001/x", "an IP address not written as a plain IP literal"),
    ("https://0177.0.0.1/x", "an IP address not written as a plain IP literal"),
    ("https://127.1/x", "an IP address not written as a plain IP literal"),
    ("https://user:pw@127.0.0.1/x", "must not carry a user name or password"),
    ("https://user:pw@hooks.example.com/x", "must not carry a user name or password"),
    ("https://hooks.example.com@127.0.0.1/x", "must not carry a user name or password"),
    ("https://169.254.169.254/latest/meta-data/", "a cloud metadata address"),
    ("https://[fd00:ec2::254]/", "a cloud metadata address"),
    ("https://168.63.129.16/", "a cloud metadata address"),
    ("https://metadata.google.internal/computeMetadata/v1/", "a cloud metadata host"),
    ("https://metadata/", "a cloud metadata host"),
    ("https://10.0.0.1/x", "a private address"),
    ("https://172.16.5.4/x", "a private address"),
    ("https://192.168.1.1/x", "a private address"),
    ("https://100.64.0.1/x", "a private address"),  # carrier-grade NAT
    ("https://[fd12:3456::1]/x", "a private address"),
    ("https://[64:ff9b::a00:1]/x", "a private address"),  # NAT64 around 10.0.0.1
    ("https://169.254.10.10/x", "a link-local address"),
    ("https://[fe80::1]/x", "a link-local address"),
    ("https://224.0.0.1/x", "a multicast address"),
    ("https://0.0.0.0/x", "an unspecified address"),
    ("https://240.0.0.1/x", "a reserved address"),
    ("https://redis/x", "not a fully qualified domain name"),
    ("https://db.internal/x", "an internal host name"),
    ("https://hooks.example.com:0/x", "no valid port"),
    ("https://hooks.example.com:99999/x", "not a valid URL"),
    ("https://hooks example.com/x", "spaces"),
    ("https://hooks.example.com\\@127.0.0.1/x", "backslashes"),
    ("https:///x", "has no host"),
    ("", "must be a URL string"),
    ("https://hooks.example.com/" + "x" * 1000, "at most 1000 characters"),
])
def test_callback_urls_sluice_will_not_call_are_refused(strict, dns, url, why):
    dns.answers["hooks.example.com"] = [PUBLIC]
    with pytest.raises(CallbackRefused) as refused:
        callback_url_check(url=url)
    assert why in refused.value.message
    assert not refused.value.retryable


@pytest.mark.parametrize("value", [None, 5, ["https://hooks.example.com/x"], {"url": "x"}])
def test_a_callback_url_that_is_not_a_string_is_refused(strict, value):
    with pytest.raises(CallbackRefused, match="must be a URL string"):
        callback_url_parse(url=value)


def test_a_host_name_that_resolves_to_a_private_address_is_refused(strict, dns):
    # given a public-looking name whose DNS answer points inside
    dns.answers["hooks.example.com"] = ["10.1.2.3"]
    # when it is submitted, then it is refused, naming what it resolved to
    with pytest.raises(CallbackRefused, match=r"hooks.example.com resolves to 10.1.2.3, a private address"):
        callback_url_check(url="https://hooks.example.com/x")


def test_every_address_of_a_host_is_checked_not_only_the_first(strict, dns):
    dns.answers["hooks.example.com"] = [PUBLIC, "2606:4700::1111", "169.254.169.254"]
    with pytest.raises(CallbackRefused, match="169.254.169.254, a cloud metadata address"):
        callback_url_check(url="https://hooks.example.com/x")


def test_a_public_host_is_accepted_and_pinned_to_its_checked_address(strict, dns):
    dns.answers["hooks.example.com"] = [PUBLIC, "2606:4700::1111"]
    target = callback_target_resolve(url="https://Hooks.Example.COM./cb?x=1")
    assert (target.host, target.port, target.address) == ("hooks.example.com", 443, PUBLIC)
    assert target.pinned_url == f"https://{PUBLIC}:443/cb?x=1"
    assert (target.host_header, target.sni_hostname) == ("hooks.example.com", "hooks.example.com")
    target = callback_target_resolve(url="https://[2606:4700::1111]:8443/cb")
    assert target.pinned_url == "https://[2606:4700::1111]:8443/cb"
    assert (target.host_header, target.sni_hostname) == ("[2606:4700::1111]:8443", None)


def test_a_host_that_does_not_resolve_is_refused_and_may_work_later(strict, dns):
    with pytest.raises(CallbackRefused, match="does not resolve") as refused:
        callback_url_check(url="https://nowhere.example.com/x")
    assert refused.value.retryable


def test_settings_allow_http_and_private_receivers_but_never_metadata(settings, dns):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    dns.answers["localhost"] = ["127.0.0.1"]
    dns.answers["hooks.corp.internal"] = ["10.0.0.7"]
    assert callback_url_check(url="http://127.0.0.1:9000/x") == "http://127.0.0.1:9000/x"
    assert callback_url_check(url="http://localhost:9000/x") == "http://localhost:9000/x"
    assert callback_url_check(url="https://hooks.corp.internal/x") == "https://hooks.corp.internal/x"
    for url in ("http://169.254.169.254/", "http://metadata.google.internal/", "http://[fe80::1]/",
                "http://0.0.0.0/", "http://u:p@127.0.0.1/", "http://2130706433/"):
        with pytest.raises(CallbackRefused):
            callback_url_check(url=url)


# --- checked again at send time -------------------------------------------------------------


@pytest.fixture
def finished_job(make_caller, settings):
    """A finished job, made directly (how it ran is not the point here).
    Retries it plans are due far in the future: a platform's pacer running
    in this session must not send them during the test."""
    settings.SLUICE_CALLBACK_BACKOFF_BASE_S = 600
    settings.SLUICE_CALLBACK_BACKOFF_CAP_S = 1200

    def make(callback_url: str) -> Job:
        caller = make_caller(workload_class="batch")
        return Job.objects.create(
            tenant=caller.tenant, workload=caller.workload, status=Job.Status.SUCCEEDED,
            body={"model": "sim-small", "messages": HELLO}, body_sha256="0" * 64, callback_url=callback_url,
            deadline=timezone.now() + timedelta(hours=1), finished_at=timezone.now(),
            result={"choices": [{"message": {"role": "assistant", "content": "hello"}}]},
        )

    return make


def test_a_dns_answer_that_changes_after_submission_is_refused_at_send_time(strict, dns, finished_job,
                                                                            redis_client):
    with CallbackReceiver() as receiver:
        # given a job whose callback host was public when it was submitted
        url = f"https://hooks.example.com:{receiver.port}/hook"
        dns.answers["hooks.example.com"] = [PUBLIC]
        assert callback_url_check(url=url) == url
        job = finished_job(url)
        # when its DNS answer has moved to loopback by the time it is sent (rebinding)
        dns.answers["hooks.example.com"] = ["127.0.0.1"]
        outcome = callback_deliver(job_id=str(job.id), attempt=1)
    # then nothing was sent, the refusal is logged, and it is not tried again
    assert outcome == "refused"
    assert receiver.received == []
    [row] = JobCallbackDelivery.objects.filter(job=job)
    assert (row.attempt, row.status_code, row.delivered, row.next_attempt_at) == (1, None, False, None)
    assert "resolves to 127.0.0.1, a loopback address" in row.error
    assert Job.objects.get(pk=job.pk).callback_status == 0
    assert redis_client.zcard(keys.CALLBACK_RETRIES) == 0


def test_sending_resolves_once_and_connects_to_the_checked_address_naming_the_host(settings, dns, finished_job):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True  # the receiver is on loopback
    with CallbackReceiver() as receiver:
        # given a host whose checked address is the receiver's
        dns.answers["hooks.example.com"] = ["127.0.0.1"]
        job = finished_job(f"http://hooks.example.com:{receiver.port}/hook?k=1")
        # when the callback is sent
        assert callback_deliver(job_id=str(job.id), attempt=1) == "delivered"
        [received] = receiver.received
    # then DNS was asked once, the connection went to that address, and the
    # request still named the host (a second lookup could have been steered)
    assert dns.lookups["hooks.example.com"] == 1
    assert received.headers["host"] == f"hooks.example.com:{receiver.port}"
    assert received.path == "/hook?k=1"
    secret = Tenant.objects.get(pk=job.tenant_id).callback_secret
    assert callback_signature_verify(secret=secret, header=received.headers["x-sluice-signature"],
                                     body=received.body, now=time.time())
    [row] = JobCallbackDelivery.objects.filter(job=job)
    assert (row.address, row.status_code, row.delivered) == ("127.0.0.1", 204, True)


@pytest.fixture
def tls_server(tmp_path):
    """A TLS server on 127.0.0.1 with a self-signed certificate that records
    the server name (SNI) each client asked for."""
    if shutil.which("openssl") is None:
        # .ci/run installs it: under CI the SNI and pinning checks must run.
        if os.environ.get("CI"):
            pytest.fail("the openssl command is missing, and CI must run the TLS callback tests")
        pytest.skip("needs the openssl command to make a certificate (apt-get install openssl)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=hooks.example.com", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve():
        try:
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ssl.SSLError):
            pass  # the client refuses our self-signed certificate: expected

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1], names
    thread.join(timeout=10)
    listener.close()


def test_https_to_the_checked_address_sends_the_host_as_sni_and_verifies_its_certificate(settings, dns, finished_job,
                                                                                         tls_server):
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    port, names = tls_server
    dns.answers["hooks.example.com"] = ["127.0.0.1"]
    job = finished_job(f"https://hooks.example.com:{port}/hook")
    # when the callback goes to the pinned address over TLS
    assert callback_deliver(job_id=str(job.id), attempt=1) == "failed"
    # then the TLS handshake named the host, and a certificate no CA signed was refused
    assert names == ["hooks.example.com"]
    [row] = JobCallbackDelivery.objects.filter(job=job)
    assert row.status_code is None and "CERTIFICATE_VERIFY_FAILED" in row.error


# --- attempts, backoff, idempotency ---------------------------------------------------------


def test_failed_attempts_schedule_the_next_with_capped_exponential_backoff(settings, finished_job, redis_client):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    settings.SLUICE_CALLBACK_BACKOFF_BASE_S = 100
    settings.SLUICE_CALLBACK_BACKOFF_CAP_S = 250
    settings.SLUICE_CALLBACK_MAX_ATTEMPTS = 3
    with CallbackReceiver(statuses=[500]) as receiver:
        job = finished_job(receiver.url())
        waits = []
        for attempt in (1, 2, 3):
            before_ms = redis_client.time()[0] * 1000
            assert callback_deliver(job_id=str(job.id), attempt=attempt) == "failed"
            due = redis_client.zscore(keys.CALLBACK_RETRIES, f"{job.id}:{attempt + 1}")
            waits.append(None if due is None else (due - before_ms) / 1000)
        assert len(receiver.received) == 3
    # then attempt 2 waits 50-100 s (base), attempt 3 100-200 s (2 x base),
    # and after the third (the cap on attempts) nothing is planned
    assert 50 - 1 <= waits[0] <= 100 + 1, waits
    assert 100 - 1 <= waits[1] <= 200 + 1, waits
    assert waits[2] is None
    rows = list(JobCallbackDelivery.objects.filter(job=job).order_by("attempt"))
    assert [(r.attempt, r.status_code, r.error) for r in rows] == [(1, 500, "HTTP 500"), (2, 500, "HTTP 500"),
                                                                  (3, 500, "HTTP 500")]
    assert [r.next_attempt_at is not None for r in rows] == [True, True, False]


def test_backoff_doubles_up_to_its_cap_with_jitter_over_the_upper_half(settings):
    settings.SLUICE_CALLBACK_BACKOFF_BASE_S = 2
    settings.SLUICE_CALLBACK_BACKOFF_CAP_S = 600
    for attempt, ceiling in [(1, 2), (2, 4), (3, 8), (9, 512), (10, 600), (30, 600)]:
        samples = [callback_backoff_s(failed_attempt=attempt) for _ in range(200)]
        assert all(ceiling / 2 <= s <= ceiling for s in samples), (attempt, min(samples), max(samples))
        assert max(samples) - min(samples) > ceiling / 4  # jittered, not fixed


def test_an_attempt_runs_once_however_often_its_task_is_delivered(settings, finished_job):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    with CallbackReceiver(statuses=[500, 204]) as receiver:
        job = finished_job(receiver.url())
        outcomes = [callback_deliver(job_id=str(job.id), attempt=1), callback_deliver(job_id=str(job.id), attempt=1),
                    callback_deliver(job_id=str(job.id), attempt=2), callback_deliver(job_id=str(job.id), attempt=3)]
        assert len(receiver.received) == 2
    # a redelivered attempt, and any attempt after a delivered one, send nothing
    assert outcomes == ["failed", "duplicate", "delivered", "duplicate"]
    assert JobCallbackDelivery.objects.filter(job=job).count() == 2


def test_a_receiver_that_does_not_answer_in_time_is_a_failed_attempt(settings, finished_job):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    settings.SLUICE_CALLBACK_TIMEOUT_S = 0.3
    listener = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    try:
        job = finished_job(f"http://127.0.0.1:{listener.getsockname()[1]}/hook")
        assert callback_deliver(job_id=str(job.id), attempt=1) == "failed"
    finally:
        listener.close()
    [row] = JobCallbackDelivery.objects.filter(job=job)
    assert row.status_code is None and row.error.startswith("ReadTimeout")
    assert Job.objects.get(pk=job.pk).callback_status == 0


# --- signing ------------------------------------------------------------------------------------


def test_signatures_verify_only_for_the_same_secret_body_and_a_recent_time():
    body = b'{"id":"job-1","status":"succeeded"}'
    header = callback_signature(secret="whsec_one", timestamp=1_700_000_000, body=body)
    assert header.startswith("t=1700000000,v1=") and len(header.rpartition("v1=")[2]) == 64
    assert callback_signature_verify(secret="whsec_one", header=header, body=body, now=1_700_000_100)
    assert not callback_signature_verify(secret="whsec_two", header=header, body=body, now=1_700_000_100)
    assert not callback_signature_verify(secret="whsec_one", header=header, body=body + b" ", now=1_700_000_100)
    assert not callback_signature_verify(secret="whsec_one", header=header, body=body, now=1_700_000_000 + 301)
    forged = header.replace("t=1700000000", "t=1700000200")  # a fresh time on an old signature
    assert not callback_signature_verify(secret="whsec_one", header=forged, body=body, now=1_700_000_200)
    assert not callback_signature_verify(secret="whsec_one", header="garbage", body=body, now=1_700_000_000)


# --- the tenant's secret ------------------------------------------------------------------------


@pytest.mark.django_db
def test_each_tenant_gets_its_own_secret_and_rotation_replaces_it():
    one = Tenant.objects.create(name="One", slug="one")
    two = Tenant.objects.create(name="Two", slug="two")
    assert one.callback_secret.startswith("whsec_") and len(one.callback_secret) > 40
    assert one.callback_secret != two.callback_secret
    before = one.callback_secret
    tenant_callback_secret_rotate(tenant=one)
    one.refresh_from_db()
    assert one.callback_secret != before and one.callback_secret_rotated_at is not None
    assert Tenant.objects.get(pk=two.pk).callback_secret == two.callback_secret


# --- schedules ------------------------------------------------------------------------------------


def test_a_schedule_with_a_refused_callback_url_does_not_validate(strict, make_caller):
    caller = make_caller(workload_class="scheduled")
    crontab = CrontabSchedule.objects.create(minute="*/5")
    schedule = JobSchedule(name="nightly", workload=caller.workload, crontab=crontab,
                           body={"model": "sim-small", "messages": HELLO}, callback_url="https://169.254.169.254/")
    with pytest.raises(ValidationError) as invalid:
        schedule.full_clean()
    assert "a cloud metadata address" in str(invalid.value.message_dict["callback_url"])


# --- through the gateway: a 400 at submission, no job ---------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/hook", "http://localhost:9/hook", "http://2130706433/hook", "http://user:pw@127.0.0.1/hook",
    "http://169.254.169.254/latest/meta-data/", "http://metadata.google.internal/", "http://10.0.0.1/hook",
    "http://[::1]/hook",
])
@pytest.mark.django_db(transaction=True)
def test_refused_callback_urls_are_a_400_at_submission(platform, make_caller, url):
    caller = make_caller(pool=make_caller.pool(base_url=f"{platform.sim_url}/v1"), workload_class="batch")
    response = httpx.post(f"{platform.base_url}/v1/jobs", timeout=30,
                          headers={"Authorization": f"Bearer {caller.api_key}"},
                          json={"model": "sim-small", "messages": HELLO, "max_tokens": 5, "callback_url": url})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("callback_url", "invalid_callback_url",
                                                              "invalid_request_error")
    assert "must point to a public host" in error["message"] or "user name or password" in error["message"]
    assert Job.objects.filter(workload=caller.workload).count() == 0
