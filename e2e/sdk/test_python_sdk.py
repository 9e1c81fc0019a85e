"""The real OpenAI Python SDK against tailwarden-sidecar, configured only by its base URL.

Run by e2e/sdk/run.sh, which starts tailwarden-sim and tailwarden-sidecar and exports
OPENAI_BASE_URL. Model `sdk-chat` retries; model `sdk-errors` passes provider errors through.
"""

import openai
import pytest


@pytest.fixture()
def client():
    # The SDK's own retries would hide the status codes under test.
    return openai.OpenAI(max_retries=0, timeout=30)


def test_non_streaming_chat_completion(client):
    r = client.chat.completions.create(
        model="sdk-chat", messages=[{"role": "user", "content": "hello there"}]
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens > 0


def test_streaming_chat_completion(client):
    stream = client.chat.completions.create(
        model="sdk-chat", messages=[{"role": "user", "content": "hello"}], stream=True
    )
    text, finish, usage_chunks = "", None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text
    assert finish == "stop"
    # The sidecar asked for usage on the client's behalf and stripped the extra chunk.
    assert usage_chunks == 0


def test_streaming_usage_when_the_client_asks(client):
    stream = client.chat.completions.create(
        model="sdk-chat",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    usages = [c.usage for c in stream if c.usage is not None]
    assert len(usages) == 1
    assert usages[0].completion_tokens > 0


def test_raw_response_carries_tailwarden_headers(client):
    raw = client.chat.completions.with_raw_response.create(
        model="sdk-chat", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["x-tailwarden-provider"] == "sim"
    assert raw.headers["x-tailwarden-attempts"] == "1"
    assert int(raw.headers["x-tailwarden-overhead-us"]) >= 0


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=[])
    assert e.value.status_code == 404
    assert e.value.code == "model_not_found"


def test_bad_request_is_typed(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="sdk-chat", messages=[], extra_body={"stream_options": 5}
        )
    assert e.value.status_code == 400
    assert "stream_options" in e.value.message


def test_rate_limit_is_typed(client):
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(
            model="sdk-errors",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-sim-fault": "429", "x-sim-retry-after": "1"},
        )
    assert e.value.status_code == 429
    assert e.value.response.headers["retry-after"] == "1"


def test_unavailable_is_typed(client):
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(
            model="sdk-errors",
            messages=[{"role": "user", "content": "x"}],
            extra_headers={"x-sim-fault": "503"},
        )
    assert e.value.status_code == 503


def test_embeddings(client):
    r = client.embeddings.create(model="sdk-chat", input=["a", "b"])
    assert len(r.data) == 2
    assert len(r.data[0].embedding) > 0


def test_models_lists_the_routes(client):
    ids = {m.id for m in client.models.list()}
    assert {"sdk-chat", "sdk-errors"} <= ids
