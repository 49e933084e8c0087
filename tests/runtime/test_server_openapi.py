"""/openapi.json carries the request bodies' schemas (runtime/server_openapi.py), and schemathesis, driven by
it against the server on loopback, gets no 5xx from any route."""
import httpx
import pytest

from server_helpers import running_server
from uacompile.runtime.server_openapi import fuzz

BODIES = {"/v1/completions": "CompletionBody", "/v1/chat/completions": "ChatBody", "/completion": "LlamaCppBody",
          "/tokenize": "TokenizeBody", "/detokenize": "DetokenizeBody", "/apply-template": "ApplyTemplateBody"}
FUZZ_CASES = 300


@pytest.fixture(scope="module")
def server():
    # small outputs so that a fuzzed request finishes fast; the cap keeps n * max_tokens short
    with running_server(max_num_seqs=8, page_size=8, max_model_len=128) as (url, app):
        yield url


def test_openapi_has_the_request_schemas(server):
    spec = httpx.get(server + "/openapi.json").json()
    schemas = spec["components"]["schemas"]
    for path, name in BODIES.items():
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert schemas[name]["additionalProperties"] is False  # unknown fields are refused
    assert "prompt" in schemas["CompletionBody"]["required"] and "messages" in schemas["ChatBody"]["required"]
    assert "StreamOptions" in schemas and "Message" in schemas


def test_schemathesis_finds_no_5xx(server):
    got = fuzz(server, FUZZ_CASES)
    assert got["cases"] >= FUZZ_CASES // 2
    assert got["server_errors"] == []
    assert httpx.get(server + "/health").json()["kv_pages_in_use"] == 0
