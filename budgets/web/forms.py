"""Forms of the web UI. They validate shape; services validate the domain."""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone as dt_timezone
from decimal import Decimal

from django import forms
from django.utils import timezone

from tenants.models import ApiKey, Tenant, Workload
from tenants.keys import KEY_EXPIRY_DAYS

from budgets.models import InferencePool, UsageRecord
from budgets.selectors.request_log import REJECTED
from budgets.selectors.usage import usage_day_problem
from budgets.web.ranges import INPUT_FORMATS

NEW = "new"


class BudgetRequestForm(forms.Form):
    workload = forms.ChoiceField(label="Workload")
    new_workload_name = forms.CharField(label="New workload name", max_length=200, required=False)
    new_workload_class = forms.ChoiceField(
        label="New workload class", choices=[("", "—")] + list(Workload.WorkloadClass.choices), required=False
    )
    pool = forms.ModelChoiceField(queryset=InferencePool.objects.none(), label="Pool", empty_label=None)
    reserved_tpm = forms.IntegerField(label="Reserved TPM", min_value=1, help_text="Guaranteed tokens per minute.")
    ceiling_tpm = forms.IntegerField(label="Ceiling TPM", min_value=1,
                                     help_text="The most it may reach by borrowing idle capacity.")
    rpm = forms.IntegerField(label="Requests per minute", min_value=1)
    lend_fraction = forms.FloatField(label="Lend fraction", min_value=0.0, max_value=1.0, initial=0.0,
                                     help_text="Share of the idle reservation others may borrow (0 = strictly yours).")
    ends_on = forms.DateField(label="End date (optional)", required=False,
                              widget=forms.DateInput(attrs={"type": "date"}))
    monthly_spend_budget = forms.DecimalField(label="Monthly spend budget (optional)", required=False,
                                              min_value=Decimal("0.01"), max_digits=18, decimal_places=6)
    spend_soft_threshold = forms.IntegerField(label="Soft threshold (%)", min_value=1, max_value=100, initial=80)
    spend_hard_cap = forms.BooleanField(label="Refuse requests once the budget is spent (hard cap)", required=False)
    justification = forms.CharField(widget=forms.Textarea(attrs={"rows": 4}), max_length=5000)

    def __init__(self, *args, tenant: Tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.fields["workload"].choices = [(str(w.id), w.slug) for w in Workload.objects.filter(tenant=tenant, is_active=True)] + [
            (NEW, "A new workload…")
        ]
        self.fields["pool"].queryset = InferencePool.objects.filter(is_active=True).order_by("slug")

    def clean_ends_on(self) -> date | None:
        ends_on = self.cleaned_data.get("ends_on")
        if ends_on and ends_on <= timezone.now().date():
            raise forms.ValidationError("The end date must be in the future.")
        if ends_on and ends_on > timezone.now().date() + timedelta(days=3 * 366):
            raise forms.ValidationError("Pick an end date within three years.")
        return ends_on

    def clean(self):
        data = super().clean()
        choice = data.get("workload")
        if choice and choice != NEW:
            data["workload_obj"] = Workload.objects.filter(tenant=self.tenant, pk=int(choice)).first()
            if data["workload_obj"] is None:
                self.add_error("workload", "Unknown workload.")
        else:
            data["workload_obj"] = None
            if not (data.get("new_workload_name") or "").strip():
                self.add_error("new_workload_name", "Name the new workload.")
            if not data.get("new_workload_class"):
                self.add_error("new_workload_class", "Choose the new workload's class.")
        reserved, ceiling = data.get("reserved_tpm"), data.get("ceiling_tpm")
        if reserved and ceiling and ceiling < reserved:
            self.add_error("ceiling_tpm", "The ceiling must be at least the reserved rate.")
        return data


class DecisionForm(forms.Form):
    comment = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False, max_length=5000)
    reserved_tpm = forms.IntegerField(
        label="Approve reserved TPM", required=False, min_value=1, max_value=10**12,
        help_text="Leave empty to approve what was asked; a smaller figure grants less.")


class ApiKeyForm(forms.Form):
    workload = forms.ChoiceField(label="Workload")
    name = forms.CharField(label="Name", max_length=200, required=False)
    expires_in_days = forms.TypedChoiceField(
        label="Expires", coerce=int, initial=0, required=False,
        choices=[(d, "never" if d == 0 else f"in {d} day{'s' if d > 1 else ''}") for d in KEY_EXPIRY_DAYS])

    def __init__(self, *args, tenant: Tenant, **kwargs):
        super().__init__(*args, **kwargs)
        self.tenant = tenant
        self.fields["workload"].choices = [(str(w.id), w.slug) for w in Workload.objects.filter(tenant=tenant)]


PERIODS = {
    "last_hour": "Last hour",
    "last_24_hours": "Last 24 h",
    "last_7_days": "Last 7 days",
    "last_30_days": "Last 30 days",
    "this_month": "This month",
    "last_month": "Last month",
    "this_year": "This year",
}
# The presets that are a span back from now rather than whole UTC days.
PERIOD_SPANS = {"last_hour": timedelta(hours=1), "last_24_hours": timedelta(hours=24)}
GROUP_CHOICES = [
    ("tenant", "Tenant"), ("cost_center", "Cost center"), ("workload", "Workload"), ("model", "Model"),
    ("endpoint", "Endpoint"), ("day", "Day"), ("month", "Month"), ("pool", "Pool"),
]


def period_range(period: str, today: date) -> tuple[date, date]:
    """The UTC days (both included) of a day-based preset."""
    if period == "last_month":
        end = today.replace(day=1) - timedelta(days=1)
        return end.replace(day=1), end
    if period == "last_7_days":
        return today - timedelta(days=6), today
    if period == "last_30_days":
        return today - timedelta(days=29), today
    if period == "this_year":
        return today.replace(month=1, day=1), today
    return today.replace(day=1), today


def _usage_day(day: date | None) -> date | None:
    problem = usage_day_problem(day)
    if problem:
        raise forms.ValidationError(problem)
    return day


def _midnight(day: date) -> datetime:
    return datetime(day.year, day.month, day.day, tzinfo=dt_timezone.utc)


class UtcDateOrTimeField(forms.CharField):
    """A UTC day (YYYY-MM-DD) or day and time (YYYY-MM-DDTHH:MM); cleans to
    ``(datetime, day_only)``."""

    widget = forms.TextInput(attrs={"placeholder": "YYYY-MM-DD or YYYY-MM-DDTHH:MM", "size": 18})

    def to_python(self, value):
        raw = (super().to_python(value) or "").strip()
        if not raw:
            return None
        for fmt in INPUT_FORMATS:
            try:
                at = datetime.strptime(raw, fmt).replace(tzinfo=dt_timezone.utc)
            except ValueError:
                continue
            _usage_day(at.date())
            return at, fmt == "%Y-%m-%d"
        raise forms.ValidationError("Enter a UTC date (YYYY-MM-DD) or date and time (YYYY-MM-DDTHH:MM).")


class SpendFilterForm(forms.Form):
    """The finance page's filters, also used by its CSV export (GET). Cleans
    ``start_at``/``end_at`` (the half-open UTC range), ``start``/``end`` (the
    UTC days it touches) and ``whole_days``."""

    period = forms.ChoiceField(choices=[("", "Custom")] + list(PERIODS.items()), required=False)
    start = UtcDateOrTimeField(required=False, label="From (UTC)")
    end = UtcDateOrTimeField(required=False, label="To (UTC)", help_text="A date includes that whole day.")
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), required=False, to_field_name="slug")
    cost_center = forms.ChoiceField(required=False, label="Cost center")
    workload = forms.ModelChoiceField(queryset=Workload.objects.none(), required=False, to_field_name="slug")
    model = forms.ChoiceField(required=False)
    group_by = forms.ChoiceField(choices=GROUP_CHOICES, required=False, initial="tenant", label="Group by")

    MAX_DAYS = 400

    def __init__(self, *args, tenants, models: list[str], now: datetime | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.now = now or timezone.now()
        self.fields["tenant"].queryset = tenants
        self.fields["workload"].queryset = Workload.objects.filter(tenant__in=tenants).order_by("slug")
        centers = sorted({c for c in tenants.values_list("cost_center", flat=True) if c})
        self.fields["cost_center"].choices = [("", "All")] + [(c, c) for c in centers]
        self.fields["model"].choices = [("", "All")] + [(m, m) for m in models]
        self.fields["tenant"].empty_label = "All"
        self.fields["workload"].empty_label = "All"

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        now = self.now.astimezone(dt_timezone.utc)
        today = now.date()
        start, end = data.get("start"), data.get("end")
        period = data.get("period") or "this_month"
        if start or end:
            # Explicit dates win over the period preset; the Period dropdown
            # then says "Custom", so the page names one range, not two.
            self.data = self.data.copy()
            self.data["period"] = ""
            data["period"] = period = ""
        if not (start or end) and period in PERIOD_SPANS:
            # Whole seconds: the range the page prints is exactly the one it
            # sums, and the export and drill-down links repeat it as explicit
            # from/to times (range_params), not as a preset evaluated again.
            end_at = now.replace(microsecond=0)
            start_at = end_at - PERIOD_SPANS[period]
        elif not (start or end):  # explicit dates win over the period preset
            first, last = period_range(period, today)
            start_at, end_at = _midnight(first), _midnight(last) + timedelta(days=1)
        else:
            if end is None:
                end_at = _midnight(today) + timedelta(days=1)
            else:
                end_at = end[0] + timedelta(days=1) if end[1] else end[0]  # a day as "to" includes it
            start_at = start[0] if start else _midnight((end_at - timedelta(microseconds=1)).date().replace(day=1))
        if end_at <= start_at:
            self.add_error("end", "The end is not after the start.")
        elif end_at - start_at > timedelta(days=self.MAX_DAYS + 1):
            self.add_error("start", f"Choose at most {self.MAX_DAYS} days.")
        data["start_at"], data["end_at"] = start_at, end_at
        data["start"], data["end"] = start_at.date(), (end_at - timedelta(microseconds=1)).date()
        data["whole_days"] = start_at == _midnight(start_at.date()) and end_at == _midnight(end_at.date())
        data["group_by"] = data.get("group_by") or "tenant"
        return data

    def range_params(self) -> dict[str, str]:
        """The cleaned range as explicit UTC from/to (to the second where it
        has seconds): the CSV export
        and the drill-down links repeat the exact range the page shows, not a
        preset that would be evaluated again at a later "now"."""
        data = self.cleaned_data
        start_at, end_at = data["start_at"], data["end_at"]
        fmt = "%Y-%m-%dT%H:%M:%S" if start_at.second or end_at.second else "%Y-%m-%dT%H:%M"
        return {"start": start_at.strftime(fmt), "end": end_at.strftime(fmt)}

    def filter_params(self) -> dict[str, str]:
        """The chosen filters (not the range or the grouping) as GET parameters."""
        data = self.cleaned_data
        params = {}
        if data.get("tenant"):
            params["tenant"] = data["tenant"].slug
        if data.get("cost_center"):
            params["cost_center"] = data["cost_center"]
        if data.get("workload"):
            params["workload"] = data["workload"].slug
        if data.get("model"):
            params["model"] = data["model"]
        return params


LOG_STATUSES = [("", "any"), *UsageRecord.Status.choices, (REJECTED, "Rejected (before the pool)")]


class RequestLogForm(forms.Form):
    """The request log's filters (the range is parsed by budgets.web.ranges)."""

    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none(), required=False, empty_label="any",
                                    to_field_name="slug")
    workload = forms.ModelChoiceField(queryset=Workload.objects.none(), required=False, empty_label="any")
    key = forms.ModelChoiceField(queryset=ApiKey.objects.none(), required=False, empty_label="any", label="API key")
    status = forms.ChoiceField(choices=LOG_STATUSES, required=False)
    reason = forms.RegexField(regex=r"^[a-z0-9_]{1,64}$", required=False, label="Rejection reason",
                              error_messages={"invalid": "A reason is lower-case letters, digits and _."})
    lane = forms.RegexField(regex=r"^[a-z0-9_.-]{1,32}$", required=False,
                            error_messages={"invalid": "A lane is lower-case letters, digits, _, . and -."})
    model = forms.CharField(max_length=200, required=False)
    endpoint = forms.ChoiceField(choices=[("", "any"), *UsageRecord.ENDPOINT_LABELS.items()], required=False)

    def __init__(self, *args, tenant_ids: frozenset[int] | None, **kwargs):
        super().__init__(*args, **kwargs)
        workloads = Workload.objects.select_related("tenant").order_by("tenant__slug", "slug")
        keys = ApiKey.objects.select_related("workload").order_by("workload__slug", "prefix")
        if tenant_ids is not None:
            workloads = workloads.filter(tenant_id__in=tenant_ids)
            keys = keys.filter(workload__tenant_id__in=tenant_ids)
            del self.fields["tenant"]  # a tenant's own log: its tenant is the page's
        else:
            self.fields["tenant"].queryset = Tenant.objects.order_by("slug")
            self.fields["tenant"].label_from_instance = lambda t: t.slug
        self.fields["workload"].queryset = workloads
        self.fields["key"].queryset = keys
        self.fields["key"].label_from_instance = lambda k: f"{k.prefix}… ({k.workload.slug}{', ' + k.name if k.name else ''})"
