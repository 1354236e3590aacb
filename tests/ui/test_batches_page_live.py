"""The batches pages over a batch the real platform ran (the official SDK,
the pacer, the batch lane, the simulator, the ledger): the page's counts and
usage are the API's, its error table is the error file's, and the UI's
download is the bytes the SDK's ``files.content`` gets."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from budgets.web.templatetags.sluice_ui import money
from tests.gateway.sdk_calls import sdk
from tests.gateway.test_batches import batch_wait, batcher, chat_line, jsonl, submit  # noqa: F401 (fixture)
from tests.gateway.test_request_ids_live import member_of

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_batch_the_platform_ran_shows_as_the_api_and_the_files_say(platform, batcher, client, settings):  # noqa: F811
    # given a batch of 6 lines, one for a model the workload may not use, run to the end
    settings.MEDIA_ROOT = platform.env["SLUICE_FILES_DIR"]  # the web process's storage
    api = sdk(platform, batcher.api_key)
    items = [chat_line(f"line-{i}", text=f"question {i}") for i in range(5)]
    items.insert(2, chat_line("not-allowed", model="sim-large"))
    done = batch_wait(api, submit(api, jsonl(items), metadata={"purpose": "ui"}).id)
    assert done.status == "completed", done.errors
    # when a member of its tenant opens the workload's batches and the batch
    client.force_login(member_of(batcher.tenant))
    tenant, workload = batcher.tenant.slug, batcher.workload.slug
    listing = client.get(f"/t/{tenant}/workloads/{workload}/batches").content.decode()
    row = re.search(rf'<tr data-status="completed" id="{done.id}".*?</tr>', listing, re.S).group(0)
    detail = client.get(f"/t/{tenant}/batches/{done.id}").content.decode()
    # then the counts and usage are the API's (the ledger's)
    assert '<td class="num request-counts">6 / 5 / 1</td>' in row
    assert '<td class="num lines">0 / 0 / 0 / 6</td>' in row
    usage = httpx.get(f"{platform.base_url}/v1/batches/{done.id}",
                      headers={"Authorization": f"Bearer {batcher.api_key}"}).json()["usage"]
    assert usage["total_tokens"] > 0
    assert f'<td class="num tokens">{usage["total_tokens"]:,}</td>' in row
    assert f'<td class="num cost">{money(usage["cost"], 6)}</td>' in row
    assert "<tr><th>purpose</th><td>ui</td></tr>" in detail  # its metadata
    # and its error table is the error file's one line
    error_file = [json.loads(line) for line in api.files.content(done.error_file_id).text.splitlines() if line]
    table = re.search(r'<table id="error-lines">.*?</table>', detail, re.S).group(0)
    shown = re.findall(r'<tr data-custom-id="([^"]+)">(.*?)</tr>', table, re.S)
    assert [custom_id for custom_id, _ in shown] == [line["custom_id"] for line in error_file] == ["not-allowed"]
    status_code = error_file[0]["response"]["status_code"]
    code = error_file[0]["response"]["body"]["error"]["code"]
    assert f'<td class="num">{status_code}</td>' in shown[0][1] and code in shown[0][1]
    # and the UI's downloads are the bytes the SDK gets
    for file_id in (done.input_file_id, done.output_file_id, done.error_file_id):
        response = client.get(f"/t/{tenant}/files/{file_id}/content")
        assert response.status_code == 200
        with pytest.warns(Warning, match="asynchronous iterator"):  # WSGI test client; uvicorn iterates it async
            assert b"".join(response) == api.files.content(file_id).content
