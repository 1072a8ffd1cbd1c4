"""The server against its own OpenAPI schema, fuzzed by schemathesis (the ``dev`` extra).

Schemathesis reads ``/openapi.json`` and sends every operation requests made from the schema —
valid ones and, in its negative mode, ones that break it in every documented way — and checks
each answer: never a 5xx, a documented status code and content type, a body that matches the
documented response schema. The example count is bounded so that this stays well under a
minute on 2 cores; the schema itself is checked to document every body and error.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

import minifer as mf
from conftest import lively_model
from minifer.engine.llm_engine import LLMEngine
from minifer.serve import schema as S
from minifer_course.server import running_server

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

MAX_EXAMPLES = 60  # per operation and mode


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(lively_model("tiny"), mf.ByteTokenizer(), max_num_seqs=8)
    with running_server(engine=engine, model_name="tiny", max_tokens=24,
                        request_timeout_s=30) as url:
        yield url, engine


def stream_chunks_conform(ctx, response, case) -> None:
    """Each event of a stream is a chunk of the documented shape, then ``[DONE]`` (Open API
    before 3.2 cannot say what the JSON inside an event's data is: checked here)."""
    ctype = response.headers.get("content-type", [""])
    if not (ctype[0] if isinstance(ctype, list) else ctype).startswith("text/event-stream"):
        return None
    chunk = (S.ChatCompletionChunk if case.operation.path.endswith("/chat/completions")
             else S.CompletionResponse)
    events = [line[6:] for line in response.content.decode("utf-8", "replace").split("\n\n")
              if line.startswith("data: ")]
    if getattr(response, "stream_cut_short", False):  # schemathesis read only the start
        events = events[:-1] + ["[DONE]"]
    assert events and events[-1] == "[DONE]", events[-1:]
    for data in events[:-1]:
        body = json.loads(data)
        (S.ErrorResponse if "error" in body else chunk).model_validate(body)
    return None


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection, stream_chunks_conform]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_5xx_and_every_answer_as_documented(server, mode):
    """Valid requests (positive) and requests that break the schema (negative, which must be
    refused with a 4xx) for every operation."""
    url, engine = server
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 6
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not op.body:
            continue  # nothing to break (any string is a model id)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=op.as_strategy(generation_mode=mode))
        def check(case):
            case.call_and_validate(checks=CHECKS, timeout=30)

        check()
    deadline = time.monotonic() + 10
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.has_unfinished() and engine.block_manager.num_used_blocks == 0


def test_the_schema_documents_every_body_and_error(server):
    url, engine = server
    doc = httpx.get(f"{url}/openapi.json").json()
    paths = doc["paths"]
    assert set(paths) == {"/health", "/v1/models", "/v1/models/{model_id}", "/metrics",
                          "/v1/completions", "/v1/chat/completions"}
    schemas = doc["components"]["schemas"]
    for path, body in (("/v1/completions", "CompletionBody"),
                       ("/v1/chat/completions", "ChatCompletionBody")):
        op = paths[path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(f"/{body}") and op["requestBody"]["required"]
        assert {"200", "400", "401", "408", "413", "415", "429", "500"} <= set(op["responses"])
        assert set(op["responses"]["200"]["content"]) == {"application/json",
                                                         "text/event-stream"}
        assert "422" not in op["responses"]  # validation errors are 400s here
        err = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert err.endswith("/ErrorResponse")
        props = schemas[body]["properties"]
        assert schemas[body]["additionalProperties"] is False
        assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0,
                                                    "maximum": 2.0}
        assert "x-allowed" in props["seed"] and props["seed"]["anyOf"][0]["minimum"] == 0
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "HTTPValidationError" not in schemas
    # the two constraints the parser adds: priority 0 on a first come, first served server,
    # and top_logprobs only with logprobs true
    for body in ("CompletionBody", "ChatCompletionBody"):
        [integer] = [o for o in schemas[body]["properties"]["priority"]["anyOf"]
                     if o.get("type") == "integer"]
        assert integer["minimum"] == integer["maximum"] == 0
    chat_body = schemas["ChatCompletionBody"]
    assert chat_body["if"]["required"] == ["top_logprobs"]
    assert chat_body["then"] == {"required": ["logprobs"],
                                 "properties": {"logprobs": {"const": True}}}
    chat = schemas["ChatMessage"]["properties"]
    assert chat["role"]["enum"] == ["system", "developer", "user", "assistant"]
