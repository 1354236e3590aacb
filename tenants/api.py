"""Management API for tenants and their API keys."""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from django.utils import timezone
from rest_framework import serializers
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from tenants.access import (
    api_key_of_tenant,
    api_keys_of_tenant,
    tenant_for_user_or_404,
    tenants_for_user,
    workload_of_tenant,
)
from tenants.api_permissions import ReadOnlyForFinance
from tenants.models import ApiKey, Tenant, Workload
from tenants.services import api_key_create, api_key_revoke, tenant_callback_secret_rotate


class TenantSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = ["id", "slug", "name", "cost_center", "created_at"]


class ApiKeySerializer(serializers.ModelSerializer):
    workload = serializers.SlugRelatedField(slug_field="slug", read_only=True)
    is_active = serializers.BooleanField(read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "workload", "name", "prefix", "created_at", "expires_at", "revoked_at", "last_used_at",
                  "is_active"]


class ApiKeyCreateSerializer(serializers.Serializer):
    """Needs ``context["tenant"]``; adds ``workload`` (one of that tenant's)."""

    workload_id = serializers.IntegerField(min_value=1)
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    expires_at = serializers.DateTimeField(required=False, allow_null=True, default=None,
                                           help_text="When the key stops working (ISO 8601, in the future); "
                                                     "empty: never.")

    def validate(self, data):
        if data.get("expires_at") is not None and data["expires_at"] <= timezone.now():
            raise serializers.ValidationError({"expires_at": ["The expiry must be in the future."]})
        try:
            data["workload"] = workload_of_tenant(tenant=self.context["tenant"], workload_id=data["workload_id"])
        except Workload.DoesNotExist:
            raise serializers.ValidationError({"workload_id": ["Unknown workload."]})
        return data


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The full key. Shown once; store it now.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class CallbackSecretSerializer(serializers.Serializer):
    callback_secret = serializers.CharField(read_only=True, help_text=(
        "Verify job callbacks with it: X-Sluice-Signature is t=<unix seconds>,v1=<hex HMAC-SHA256 of "
        "'<t>.' + the raw body, keyed with this secret>."))
    callback_secret_rotated_at = serializers.DateTimeField(read_only=True, allow_null=True)


def _secret_response(tenant: Tenant) -> Response:
    response = Response(CallbackSecretSerializer(tenant).data)
    response["Cache-Control"] = "no-store"
    return response


class TenantList(APIView):
    @extend_schema(responses=TenantSerializer(many=True), summary="Tenants you can see")
    def get(self, request):
        return Response(TenantSerializer(tenants_for_user(user=request.user).order_by("slug"), many=True).data)


class TenantDetail(APIView):
    @extend_schema(responses=TenantSerializer)
    def get(self, request, slug: str):
        return Response(TenantSerializer(tenant_for_user_or_404(user=request.user, slug=slug)).data)


class ApiKeyList(APIView):
    permission_classes = [IsAuthenticated, ReadOnlyForFinance]

    @extend_schema(responses=ApiKeySerializer(many=True), summary="The tenant's API keys (prefixes only)")
    def get(self, request, slug: str):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug)
        return Response(ApiKeySerializer(api_keys_of_tenant(tenant=tenant), many=True).data)

    @extend_schema(request=ApiKeyCreateSerializer, responses={201: ApiKeyCreatedSerializer},
                   summary="Create an API key (the full key is in this response only)")
    def post(self, request, slug: str):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
        payload = ApiKeyCreateSerializer(data=request.data, context={"tenant": tenant})
        payload.is_valid(raise_exception=True)
        created = api_key_create(workload=payload.validated_data["workload"], name=payload.validated_data["name"],
                                 expires_at=payload.validated_data["expires_at"])
        data = ApiKeySerializer(created.api_key).data
        data["key"] = created.raw_key
        response = Response(data, status=201)
        response["Cache-Control"] = "no-store"
        return response


class ApiKeyRevoke(APIView):
    permission_classes = [IsAuthenticated, ReadOnlyForFinance]

    @extend_schema(request=None, responses=ApiKeySerializer, summary="Revoke an API key")
    def post(self, request, slug: str, key_id: int):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
        # Another tenant's key raises DoesNotExist: the exception handler's 404.
        key = api_key_of_tenant(tenant=tenant, key_id=key_id)
        return Response(ApiKeySerializer(api_key_revoke(api_key=key)).data)


class CallbackSecret(APIView):
    """The tenant's job-callback signing secret: its members and platform
    admins (who may change the tenant) read it; others get a 404."""

    permission_classes = [IsAuthenticated, ReadOnlyForFinance]

    @extend_schema(responses=CallbackSecretSerializer, summary="The secret that signs the tenant's job callbacks")
    def get(self, request, slug: str):
        return _secret_response(tenant_for_user_or_404(user=request.user, slug=slug, write=True))


class CallbackSecretRotate(APIView):
    permission_classes = [IsAuthenticated, ReadOnlyForFinance]

    @extend_schema(request=None, responses=CallbackSecretSerializer,
                   summary="Replace the callback signing secret (the old one stops signing at once)")
    def post(self, request, slug: str):
        tenant = tenant_for_user_or_404(user=request.user, slug=slug, write=True)
        return _secret_response(tenant_callback_secret_rotate(tenant=tenant))
