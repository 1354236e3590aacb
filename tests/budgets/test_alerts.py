"""Alerts reach people: a tenant chooses recipients, a webhook and events;
each matching notification goes out by e-mail and as a signed webhook,
retried with backoff and logged; webhook URLs pass the job callbacks' guard;
the page is tenant-scoped and read-only for finance."""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest
from django.core import mail
from django.test import override_settings
from django.utils import timezone

from budgets.admission import keys
from budgets.models import AlertDelivery, AlertSettings, Notification, RejectionStat
from budgets.services import alerts as alerts_service
from budgets.services.alert_spikes import rejection_spikes_check
from budgets.services.alerts import alert_deliver, alert_retries_release, alert_settings_save
from budgets.services.budget_requests import budget_request_approve, budget_request_submit
from budgets.services.notifications import notification_create
from gateway.core.lanes import HOUSEKEEPING
from tenants.outbound import callback_signature_verify
from tests.people import build_world
from tests.receivers import CallbackReceiver

EVENTS = ["spend_soft", "spend_hard", "request_decision", "rejection_spike"]


@pytest.fixture
def private_receivers(settings):
    settings.SLUICE_CALLBACK_ALLOW_HTTP = True
    settings.SLUICE_CALLBACK_ALLOW_PRIVATE = True
    settings.SLUICE_CALLBACK_BACKOFF_BASE_S = 0.01
    settings.SLUICE_CALLBACK_BACKOFF_CAP_S = 0.02
    settings.SLUICE_CALLBACK_MAX_ATTEMPTS = 3


def approve(world) -> Notification:
    request = budget_request_submit(tenant=world.tenant_a, user=world.member_a, pool=world.pool, workload=world.wl_a,
                                    reserved_tpm=120_000, ceiling_tpm=200_000, rpm=700, justification="launch")
    budget_request_approve(request_id=request.pk, approver=world.admin, comment="go")
    return Notification.objects.get(tenant=world.tenant_a, kind="request_approved")


@pytest.mark.django_db
@pytest.mark.parametrize("url, why", [
    ("http://hooks.example.com/x", "must be an https URL"),
    ("https://169.254.169.254/latest", "a cloud metadata address"),
    ("https://127.0.0.1/hook", "a loopback address"),
    ("https://10.1.2.3/hook", "a private address"),
    ("https://user:pw@hooks.example.com/", "must not carry a user name"),
    ("https://2130706433/", "an IP address not written as a plain IP literal"),
])
def test_webhook_urls_pass_the_callback_guard(world, url, why):
    with pytest.raises(Exception) as refused:
        alert_settings_save(tenant=world.tenant_a, email_recipients="", webhook_url=url, events=EVENTS)
    assert why in str(refused.value) and "'webhook_url'" in str(refused.value)
    assert not AlertSettings.objects.exists()


@pytest.mark.django_db
def test_bad_recipients_and_events_are_refused(world):
    with pytest.raises(Exception) as refused:
        alert_settings_save(tenant=world.tenant_a, email_recipients="ops@acme.test, not-an-address",
                            webhook_url="", events=["spend_soft", "weather"])
    errors = refused.value.message_dict
    assert errors["email_recipients"] == ["'not-an-address' is not an e-mail address."]
    assert errors["events"] == ["Unknown events: weather."]


@pytest.mark.django_db(transaction=True)
def test_an_alert_is_mailed_and_posted_signed_and_a_failing_webhook_is_retried(world, private_receivers,
                                                                              redis_of_its_own, monkeypatch):
    # The attempts this test makes itself, in order: what would go to the
    # broker is recorded instead, so a housekeeping worker left running by an
    # earlier test (the session's platform) cannot make them first, and the
    # retry is parked in a Redis database of the test's own, so the session's
    # pacer cannot release it first. The broker's side is
    # test_alerts_go_out_from_the_housekeeping_worker's.
    redis_client = redis_of_its_own
    enqueued: list[tuple[int, str, int]] = []
    monkeypatch.setattr(alerts_service, "_send", lambda *attempt: enqueued.append(attempt))
    with CallbackReceiver(statuses=[500, 204]) as receiver:
        # given acme's alerts to two people and a webhook, for request decisions only
        alert_settings_save(tenant=world.tenant_a, email_recipients="ops@acme.test\nlead@acme.test",
                            webhook_url=receiver.url("/alerts"), events=["request_decision"])
        # when its request is approved
        notification = approve(world)
        # then the first attempt on each channel is enqueued on commit
        assert enqueued == [(notification.id, "email", 1), (notification.id, "webhook", 1)]
        # then the e-mail goes to both, saying what happened
        assert alert_deliver(notification_id=notification.id, channel="email", attempt=1) == "delivered"
        assert len(mail.outbox) == 1 and mail.outbox[0].to == ["ops@acme.test", "lead@acme.test"]
        assert "was approved" in mail.outbox[0].body and "Budget request approved" in mail.outbox[0].subject
        # and the webhook's first answer (500) is logged and attempt 2 parked in Redis
        assert alert_deliver(notification_id=notification.id, channel="webhook", attempt=1) == "failed"
        first = AlertDelivery.objects.get(channel="webhook", attempt=1)
        assert (first.status_code, first.delivered, first.error) == (500, False, "HTTP 500")
        assert first.next_attempt_at is not None
        assert redis_client.zrange(keys.ALERT_RETRIES, 0, -1) == [f"{notification.id}:webhook:2"]
        # once due, the pacer's release takes it off the set (and enqueues it)
        deadline = time.monotonic() + 5
        while alert_retries_release() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert redis_client.zcard(keys.ALERT_RETRIES) == 0 and enqueued[2:] == [(notification.id, "webhook", 2)]
        assert alert_deliver(notification_id=notification.id, channel="webhook", attempt=2) == "delivered"
        # a redelivered attempt changes nothing
        assert alert_deliver(notification_id=notification.id, channel="webhook", attempt=2) == "duplicate"
        posts = receiver.received
    assert len(posts) == 2
    body = json.loads(posts[1].body)
    assert body == {"id": notification.id, "object": "alert", "event": "request_decision", "kind": "request_approved",
                    "tenant": world.tenant_a.slug, "workload": world.wl_a.slug, "message": notification.message,
                    "created_at": notification.created_at.isoformat()}
    assert posts[1].headers["x-sluice-attempt"] == "2" and posts[1].headers["x-sluice-event"] == "request_decision"
    world.tenant_a.refresh_from_db()
    assert callback_signature_verify(secret=world.tenant_a.callback_secret, header=posts[1].headers["x-sluice-signature"],
                                     body=posts[1].body, now=time.time())
    assert list(AlertDelivery.objects.order_by("channel", "attempt").values_list("channel", "attempt", "delivered")) == [
        ("email", 1, True), ("webhook", 1, False), ("webhook", 2, True)]


@pytest.mark.django_db
def test_only_chosen_events_are_sent(world, django_capture_on_commit_callbacks):
    alert_settings_save(tenant=world.tenant_a, email_recipients="ops@acme.test", webhook_url="", events=["spend_hard"])
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        notification_create(tenant=world.tenant_a, kind="request_approved", message="x", dedupe_key="k1")
    # only the notification's own signal is queued, no alert
    assert len(callbacks) == 1
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        notification_create(tenant=world.tenant_a, kind="spend_hard_cap", message="y", dedupe_key="k2")
    assert len(callbacks) == 2


@pytest.mark.django_db
def test_a_sustained_rejection_spike_notifies_once_an_hour(world, settings):
    settings.SLUICE_ALERT_REJECTION_SPIKE_PER_MINUTE = 50
    settings.SLUICE_ALERT_REJECTION_SPIKE_MINUTES = 3
    now = timezone.now().replace(second=30, microsecond=0)
    last_closed = now.replace(second=0) - timedelta(minutes=1)

    def rejected(minutes_ago: int, count: int, workload=None, reason: str = "workload_tpm") -> None:
        workload = workload or world.wl_a
        RejectionStat.objects.create(minute=last_closed - timedelta(minutes=minutes_ago), tenant=workload.tenant,
                                     workload=workload, pool=world.pool, reason=reason, count=count)

    # tenant A: 60, 50 (two reasons' worth) and 70 in the three minutes before the last closed one;
    # tenant B: one quiet minute in the middle
    rejected(1, 60), rejected(2, 30), rejected(2, 20, reason="workload_rpm"), rejected(3, 70)
    rejected(1, 90, world.wl_b), rejected(2, 10, world.wl_b), rejected(3, 90, world.wl_b)
    assert rejection_spikes_check(now=now) == 1
    spike = Notification.objects.get(kind="rejection_spike")
    assert spike.tenant == world.tenant_a and spike.message.startswith("180 requests of")
    assert not Notification.objects.filter(kind="rejection_spike", tenant=world.tenant_b).exists()
    assert rejection_spikes_check(now=now + timedelta(minutes=1)) == 0  # the same hour: once


@pytest.mark.django_db
def test_alerts_page_is_tenant_scoped_and_read_only_for_finance(login, world):
    url = f"/t/{world.tenant_a.slug}/alerts"
    member = login(world.member_a)
    assert member.get(url).status_code == 200
    response = member.post(url, {"email_recipients": "ops@acme.test", "events": ["spend_soft", "spend_hard"]},
                           follow=True)
    assert response.redirect_chain == [(url, 302)] and "Alert settings saved." in response.content.decode()
    assert AlertSettings.objects.get(tenant=world.tenant_a).events == ["spend_soft", "spend_hard"]
    bad = member.post(url, {"webhook_url": "https://169.254.169.254/", "events": ["spend_soft"]})
    assert bad.status_code == 400 and "cloud metadata" in bad.content.decode()
    # another tenant's member: 404 either way; finance reads, cannot write
    other = login(world.member_b)
    assert other.get(url).status_code == 404 and other.post(url, {"events": []}).status_code == 404
    finance = login(world.finance)
    page = finance.get(url)
    assert page.status_code == 200 and "ops@acme.test" in page.content.decode() and 'id="save-alerts"' not in page.content.decode()
    assert finance.post(url, {"email_recipients": "", "events": []}).status_code in (403, 404)
    assert AlertSettings.objects.get(tenant=world.tenant_a).recipients == ["ops@acme.test"]


@pytest.mark.django_db(transaction=True)
def test_alerts_go_out_from_the_housekeeping_worker(platform, tmp_path):
    """The whole path through real processes: approval -> on commit -> the
    housekeeping worker mails (file backend: no SMTP here) and posts."""
    overrides = {"SLUICE_CALLBACK_ALLOW_PRIVATE": "1", "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
                 "EMAIL_FILE_PATH": str(tmp_path)}
    with platform.environment(overrides, lanes=[HOUSEKEEPING.name]), CallbackReceiver(statuses=[204]) as receiver:
        world = build_world()
        with override_settings(SLUICE_CALLBACK_ALLOW_PRIVATE=True, SLUICE_CALLBACK_ALLOW_HTTP=True):
            alert_settings_save(tenant=world.tenant_a, email_recipients="ops@acme.test",
                                webhook_url=receiver.url("/alerts"), events=["request_decision"])
        notification = approve(world)
        posts = receiver.wait_for(1, timeout=30)
        deadline = time.monotonic() + 30
        while AlertDelivery.objects.filter(delivered=True).count() < 2:
            assert time.monotonic() < deadline, list(AlertDelivery.objects.values_list("channel", "delivered", "error"))
            time.sleep(0.1)
    assert json.loads(posts[0].body)["id"] == notification.id
    mails = [p.read_text() for p in tmp_path.iterdir()]
    assert len(mails) == 1 and "To: ops@acme.test" in mails[0] and "was approved" in mails[0]


@pytest.mark.django_db(transaction=True)
def test_a_test_alert_goes_to_every_channel_through_the_delivery_path(world, private_receivers, redis_client,
                                                                       monkeypatch, login):
    enqueued: list[tuple[int, str, int]] = []
    monkeypatch.setattr(alerts_service, "_send", lambda *attempt: enqueued.append(attempt))
    client = login(world.member_a)
    # nothing set up yet: the page says what to do first, and nothing is sent
    response = client.post(f"/t/{world.tenant_a.slug}/alerts/test", follow=True)
    assert "Save e-mail recipients or a webhook URL first." in response.content.decode()
    assert 'id="send-test-alert"' not in response.content.decode()
    assert not Notification.objects.exists() and enqueued == []
    with CallbackReceiver(statuses=[204]) as receiver:
        # given recipients and a webhook, and no event chosen at all
        alert_settings_save(tenant=world.tenant_a, email_recipients="ops@acme.test", webhook_url=receiver.url("/alerts"),
                            events=[])
        assert 'id="send-test-alert"' in client.get(f"/t/{world.tenant_a.slug}/alerts").content.decode()
        # when the member presses "Send a test alert"
        response = client.post(f"/t/{world.tenant_a.slug}/alerts/test", follow=True)
        assert "Test alert sent by email and webhook" in response.content.decode()
        notification = Notification.objects.get(tenant=world.tenant_a)
        assert notification.kind == "alert_test" and world.member_a.username in notification.message
        # then each channel's first attempt is enqueued and delivers like a real alert
        assert enqueued == [(notification.id, "email", 1), (notification.id, "webhook", 1)]
        assert alert_deliver(notification_id=notification.id, channel="email", attempt=1) == "delivered"
        assert alert_deliver(notification_id=notification.id, channel="webhook", attempt=1) == "delivered"
        posts = receiver.received
    assert mail.outbox[-1].to == ["ops@acme.test"] and "Test alert" in mail.outbox[-1].subject
    assert len(posts) == 1
    body = json.loads(posts[0].body)
    assert (body["event"], body["kind"], body["tenant"]) == ("test", "alert_test", world.tenant_a.slug)
    assert posts[0].headers["x-sluice-event"] == "test"
    assert list(AlertDelivery.objects.order_by("channel").values_list("channel", "delivered")) == [
        ("email", True), ("webhook", True)]
    page = client.get(f"/t/{world.tenant_a.slug}/alerts").content.decode()
    assert page.count("Test alert") >= 2  # both deliveries in the log
    # finance reads the page but cannot send; another tenant's member cannot either
    for user in (world.finance, world.member_b):
        assert login(user).post(f"/t/{world.tenant_a.slug}/alerts/test").status_code in (403, 404)
    assert Notification.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("url, setting", [
    ("https://127.0.0.1/hook", "SLUICE_CALLBACK_ALLOW_PRIVATE=true"),
    ("https://10.1.2.3/hook", "SLUICE_CALLBACK_ALLOW_PRIVATE=true"),
    ("https://localhost/hook", "SLUICE_CALLBACK_ALLOW_PRIVATE=true"),
    ("https://hooks/x", "SLUICE_CALLBACK_ALLOW_PRIVATE=true"),
    ("http://hooks.example.com/x", "SLUICE_CALLBACK_ALLOW_HTTP=true"),
    ("https://169.254.169.254/latest", None),  # never allowed: no setting to name
    ("ftp://hooks.example.com/x", None),
])
def test_a_refused_webhook_url_names_the_setting_that_would_allow_it(world, url, setting):
    with pytest.raises(Exception) as refused:
        alert_settings_save(tenant=world.tenant_a, email_recipients="", webhook_url=url, events=EVENTS)
    message = refused.value.message_dict["webhook_url"][0]
    if setting is None:
        assert "SLUICE_CALLBACK_ALLOW" not in message
    else:
        assert setting in message and "platform operator" in message


@pytest.mark.django_db
def test_the_alerts_page_shows_the_setting_for_a_local_webhook(login, world):
    response = login(world.member_a).post(f"/t/{world.tenant_a.slug}/alerts", {
        "email_recipients": "", "webhook_url": "https://127.0.0.1/hook", "events": ["spend_hard"]})
    assert response.status_code == 400
    assert "SLUICE_CALLBACK_ALLOW_PRIVATE=true" in response.content.decode()
