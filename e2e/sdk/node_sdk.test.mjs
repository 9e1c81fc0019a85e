// The real OpenAI Node SDK against tailwarden-sidecar, configured only by OPENAI_BASE_URL.
// Run by e2e/sdk/run.sh (node --test).
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI, { toFile } from "openai";

const client = new OpenAI({ maxRetries: 0, timeout: 30_000 });

test("non-streaming chat completion", async () => {
  const r = await client.chat.completions.create({
    model: "sdk-chat",
    messages: [{ role: "user", content: "hello there" }],
  });
  assert.equal(r.object, "chat.completion");
  assert.ok(r.choices[0].message.content.length > 0);
  assert.ok(r.usage.total_tokens > 0);
});

test("streaming chat completion", async () => {
  const stream = await client.chat.completions.create({
    model: "sdk-chat",
    messages: [{ role: "user", content: "hello" }],
    stream: true,
  });
  let text = "";
  let finish = null;
  let usageChunks = 0;
  for await (const chunk of stream) {
    if (chunk.usage) usageChunks += 1;
    for (const c of chunk.choices) {
      text += c.delta.content ?? "";
      finish = c.finish_reason ?? finish;
    }
  }
  assert.ok(text.length > 0);
  assert.equal(finish, "stop");
  assert.equal(usageChunks, 0);
});

test("streaming usage when the client asks", async () => {
  const stream = await client.chat.completions.create({
    model: "sdk-chat",
    messages: [{ role: "user", content: "hello" }],
    stream: true,
    stream_options: { include_usage: true },
  });
  const usages = [];
  for await (const chunk of stream) if (chunk.usage) usages.push(chunk.usage);
  assert.equal(usages.length, 1);
  assert.ok(usages[0].completion_tokens > 0);
});

test("unknown model is NotFoundError", async () => {
  await assert.rejects(
    client.chat.completions.create({ model: "no-such-model", messages: [] }),
    (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === "model_not_found",
  );
});

test("bad request is BadRequestError", async () => {
  await assert.rejects(
    client.chat.completions.create({ model: "sdk-chat", messages: [], stream_options: 5 }),
    (e) => e instanceof OpenAI.BadRequestError && e.status === 400,
  );
});

test("429 is RateLimitError", async () => {
  await assert.rejects(
    client.chat.completions.create(
      { model: "sdk-errors", messages: [{ role: "user", content: "x" }] },
      { headers: { "x-sim-fault": "429", "x-sim-retry-after": "1" } },
    ),
    (e) => e instanceof OpenAI.RateLimitError && e.status === 429,
  );
});

test("503 is InternalServerError", async () => {
  await assert.rejects(
    client.chat.completions.create(
      { model: "sdk-errors", messages: [{ role: "user", content: "x" }] },
      { headers: { "x-sim-fault": "503" } },
    ),
    (e) => e instanceof OpenAI.InternalServerError && e.status === 503,
  );
});

test("responses: non-streaming", async () => {
  const r = await client.responses.create({ model: "sdk-chat", input: "hello there" });
  assert.equal(r.object, "response");
  assert.equal(r.status, "completed");
  assert.ok(r.output_text.length > 0);
  assert.ok(r.usage.output_tokens > 0);
});

test("responses: streaming", async () => {
  const stream = await client.responses.create({ model: "sdk-chat", input: "hello", stream: true });
  const types = [];
  let text = "";
  let completed = null;
  for await (const event of stream) {
    types.push(event.type);
    if (event.type === "response.output_text.delta") text += event.delta;
    if (event.type === "response.completed") completed = event.response;
  }
  assert.equal(types[0], "response.created");
  assert.equal(types.at(-1), "response.completed");
  assert.ok(text.length > 0);
  assert.ok(completed.usage.output_tokens > 0);
});

test("responses: retrieve and a follow-up reach the owner", async () => {
  const first = await client.responses.create({ model: "sdk-chat", input: "remember this" });
  const { data: got, response } = await client.responses.retrieve(first.id).withResponse();
  assert.equal(got.id, first.id);
  assert.equal(response.headers.get("x-tailwarden-provider"), "sim");
  const follow = await client.responses.create({
    model: "sdk-chat",
    input: "and then?",
    previous_response_id: first.id,
  });
  assert.equal(follow.status, "completed");
});

test("moderations pass through", async () => {
  const m = await client.moderations.create({ model: "sdk-chat", input: "hello" });
  assert.equal(m.results.length, 1);
  assert.equal(m.results[0].flagged, false);
});

test("files upload passes through", async () => {
  const content = '{"custom_id": "1"}\n'.repeat(4096);
  const f = await client.files.create({
    file: await toFile(Buffer.from(content), "in.jsonl"),
    purpose: "batch",
  });
  assert.ok(f.id.startsWith("file-sim-"));
  assert.ok(f.bytes > content.length);
});

test("models retrieve", async () => {
  const m = await client.models.retrieve("sdk-chat");
  assert.equal(m.id, "sdk-chat");
});
