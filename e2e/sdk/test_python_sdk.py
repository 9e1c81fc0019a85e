"""The real OpenAI Python SDK against tailwarden-sidecar, configured only by its base URL.

Run by e2e/sdk/run.sh, which starts tailwarden-sim and tailwarden-sidecar and exports
OPENAI_BASE_URL. Model `sdk-chat` retries; model `sdk-errors` passes provider errors through;
model `sdk-fallback` serves streams from plain calls once the provider's streams fail
(`streaming.fallback`). Files,
moderations and response retrieval go through the sidecar's pass-through to the simulator.
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


# The simulator fails these streams before their first content (an error event first) and
# answers plain requests normally: the sidecar serves the stream from a plain call.
BROKEN_STREAMS = {"x-sim-fault": "stream-fail-before-content", "x-sim-tokens": "5"}


def test_stream_served_from_a_plain_call_is_well_formed_sse(client):
    raw = client.chat.completions.with_raw_response.create(
        model="sdk-fallback",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=BROKEN_STREAMS,
    )
    assert raw.headers["x-tailwarden-stream-fallback"] == "non-stream"
    assert raw.headers["content-type"].startswith("text/event-stream")
    chunks = list(raw.parse())
    assert chunks, "the SDK parsed chunks"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert len(text.split()) == 5, text
    assert finishes == ["stop"]
    # The usage chunk the client asked for comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_helper_accumulates_a_replayed_stream(client):
    with client.chat.completions.stream(
        model="sdk-fallback",
        messages=[{"role": "user", "content": "hello"}],
        extra_headers=BROKEN_STREAMS,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "".join(deltas)
    assert len(final.choices[0].message.content.split()) == 5
    assert final.choices[0].finish_reason == "stop"


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


def test_responses_non_streaming(client):
    r = client.responses.create(model="sdk-chat", input="hello there")
    assert r.object == "response"
    assert r.status == "completed"
    assert r.output_text
    assert r.usage.output_tokens > 0


def test_responses_streaming(client):
    stream = client.responses.create(model="sdk-chat", input="hello", stream=True)
    types, text, completed = [], "", None
    for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert text
    assert completed is not None and completed.usage.output_tokens > 0


def test_responses_retrieve_and_follow_up_reach_the_owner(client):
    first = client.responses.create(model="sdk-chat", input="remember this")
    got = client.responses.with_raw_response.retrieve(first.id)
    assert got.headers["x-tailwarden-provider"] == "sim"
    assert got.parse().id == first.id
    follow = client.responses.with_raw_response.create(
        model="sdk-chat", input="and then?", previous_response_id=first.id
    )
    assert follow.headers["x-tailwarden-provider"] == "sim"
    assert follow.parse().status == "completed"
    assert client.responses.input_items.list(first.id).data == []


def test_moderations_pass_through(client):
    m = client.moderations.create(model="sdk-chat", input=["hello", "world"])
    assert len(m.results) == 2
    assert m.results[0].flagged is False


def test_files_upload_pass_through(client):
    content = b'{"custom_id": "1"}\n' * 4096
    f = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert f.id.startswith("file-sim-")
    # What reached the provider: the whole multipart body, the file inside it.
    assert f.bytes > len(content)
    assert client.files.retrieve(f.id).id == f.id


def test_models_retrieve(client):
    assert client.models.retrieve("sdk-chat").id == "sdk-chat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
