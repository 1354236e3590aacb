"""The OpenAPI schema documents /v1 (paths, the bearer key, error codes,
headers) beside /api, and a browser reads /api/schema/ instead of
downloading it."""

from __future__ import annotations

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,*/*;q=0.8"


def test_v1_is_in_the_schema_with_its_errors_and_headers():
    schema = Client().get("/api/schema/?format=json").json()
    v1 = {path: sorted(ops) for path, ops in schema["paths"].items() if path.startswith("/v1")}
    assert v1 == {"/v1/chat/completions": ["post"], "/v1/completions": ["post"], "/v1/embeddings": ["post"],
                  "/v1/jobs": ["get", "post"], "/v1/jobs/{job_id}": ["get"], "/v1/models": ["get"],
                  "/v1/files": ["get", "post"], "/v1/files/{file_id}": ["delete", "get"],
                  "/v1/files/{file_id}/content": ["get"], "/v1/batches": ["get", "post"],
                  "/v1/batches/{batch_id}": ["get"], "/v1/batches/{batch_id}/cancel": ["post"]}
    embeddings = schema["paths"]["/v1/embeddings"]["post"]
    body = embeddings["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "input"]
    assert body["properties"]["encoding_format"]["enum"] == ["float", "base64"]
    assert "model_not_found" in embeddings["responses"]["404"]["description"]
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"]["required"] == ["model", "prompt"]
    assert "workload_tpm" in completions["responses"]["429"]["description"]
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert chat["security"] == [{"SluiceApiKey": []}]
    assert schema["components"]["securitySchemes"]["SluiceApiKey"]["scheme"] == "bearer"
    too_many = chat["responses"]["429"]
    assert "workload_tpm" in too_many["description"] and "pool_saturated" in too_many["description"]
    assert {"Retry-After", "retry-after-ms", "x-ratelimit-limit-tokens"} <= set(too_many["headers"])
    assert {"x-ratelimit-remaining-tokens", "x-sluice-max-tokens-applied"} <= set(chat["responses"]["200"]["headers"])
    assert too_many["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/OpenAIError"}
    codes = schema["components"]["schemas"]["OpenAIError"]["properties"]["error"]["properties"]["code"]["enum"]
    assert {"invalid_api_key", "context_length_exceeded", "budget_unavailable", "invalid_cursor"} <= set(codes)
    listing = schema["paths"]["/v1/jobs"]["get"]
    assert [p["name"] for p in listing["parameters"]] == ["status", "after", "limit"]


def test_a_browser_reads_the_schema_and_tools_still_get_yaml():
    page = Client().get("/api/schema/", HTTP_ACCEPT=BROWSER_ACCEPT)
    assert page.status_code == 200 and page["Content-Type"] == "text/html; charset=utf-8"
    assert page.get("Content-Disposition", "inline").startswith("inline")
    body = page.content.decode()
    assert "<pre>openapi: 3.0.3" in body and "/v1/chat/completions:" in body
    tool = Client().get("/api/schema/", HTTP_ACCEPT="*/*")
    assert tool["Content-Type"].startswith("application/vnd.oai.openapi")
    assert tool.content.startswith(b"openapi: 3.0.3")
