//! Context budgets through the real request path over loopback: a long conversation is
//! trimmed under its budget with the system prompt and the last turn intact, a tool call
//! and its result stay together, an overflow is a clear 400 that reaches no provider, the
//! provider sees exactly the trimmed body, budgets differ per tier and tenant, and the
//! savings show in the headers and metrics. Token counts are OpenAI's own (`o200k_base`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{
    access::{access_line, log_lines},
    *,
};
use serde_json::{Value, json};
use tailwarden_decide::context::{Counter, TokenizerChoice};

/// POSTs a chat with its own request id (ids of different sidecars may repeat).
async fn post_with_id(sc: &Sidecar, id: &str, body: &str) -> Reply {
    use http_body_util::BodyExt;
    let req = http::Request::post(sc.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_owned(),
        )))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    Reply {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    }
}

fn long_chat(turns: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": "You are a terse assistant. Answer in one sentence."}),
    ];
    for i in 0..turns {
        messages.push(json!({"role": "user", "content": format!("Question {i}: what happened in the year {} and why does it still matter today?", 1900 + i)}));
        messages.push(json!({"role": "assistant", "content": format!("In {} several things happened; the most lasting was a change in how people travelled and traded.", 1900 + i)}));
    }
    messages.push(json!({"role": "user", "content": "Now summarise all of that in five words."}));
    json!({"model": "gpt-4o", "temperature": 0.3, "messages": messages})
}

fn config(url: &str, budget: &str) -> String {
    format!(
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: chat, namespace: t}}\nspec:\n  models: [gpt-4o, gpt-4o-vip]\n  providers:\n  - name: openai\n    baseUrl: '{url}'\n    pricing: [{{model: gpt-4o, inputPerMTok: '2.50', outputPerMTok: '10.00'}}]\n{budget}"
    )
}

/// Tokens of a request body as sent, counted the way the sidecar counts (OpenAI's
/// per-message framing), recomputed here independently of the trimming code.
fn count(body: &Value) -> u64 {
    let c = Counter::for_model(TokenizerChoice::Auto, "gpt-4o");
    3 + body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            3 + c.count(m["role"].as_str().unwrap())
                + m["content"].as_str().map_or(0, |t| c.count(t))
                + m["tool_calls"].as_array().map_or(0, |calls| {
                    calls
                        .iter()
                        .map(|call| {
                            c.count(call["function"]["name"].as_str().unwrap())
                                + c.count(call["function"]["arguments"].as_str().unwrap())
                        })
                        .sum()
                })
        })
        .sum::<u64>()
}

#[tokio::test]
async fn a_long_conversation_is_trimmed_under_its_budget_and_the_provider_sees_exactly_that() {
    log_lines();
    let up = upstream(|_, _| ok("Travel and trade changed.")).await;
    let sc = sidecar(&config(
        &up.base_url(),
        "  contextBudget: {maxTokens: 400, keepLastTurns: 2}\n",
    ))
    .await;
    let request = long_chat(30);
    let before = count(&request);
    assert!(before > 1000, "the conversation is long: {before}");
    let r = post_with_id(&sc, "ctx-trimmed-1", &request.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);

    let seen = up.seen.lock().unwrap()[0].body.clone();
    let sent: Value = serde_json::from_str(&seen).unwrap();
    let kept = sent["messages"].as_array().unwrap();
    let all = request["messages"].as_array().unwrap();
    assert_eq!(kept[0], all[0], "the system prompt is kept");
    assert_eq!(
        kept[kept.len() - 3..],
        all[all.len() - 3..],
        "the last two turns are kept whole"
    );
    // Oldest middle turns went first: what is kept after the system prompt is a suffix.
    assert_eq!(kept[1..], all[all.len() - (kept.len() - 1)..]);
    assert_eq!(sent["temperature"], json!(0.3), "other members untouched");
    let after = count(&sent);
    assert!(after <= 400, "under the budget: {after}");
    assert_eq!(r.header("x-tailwarden-context-tokens"), after.to_string());
    assert_eq!(
        r.header("x-tailwarden-context-trimmed"),
        (before - after).to_string()
    );
    assert_eq!(
        r.header("x-tailwarden-context-tokenizer"),
        "tiktoken:o200k_base"
    );
    let line = access_line("ctx-trimmed-1").await;
    assert_eq!(line["context_tokens"], json!(after));
    assert_eq!(line["context_trimmed_tokens"], json!(before - after));
    assert_eq!(
        line["context_dropped_messages"],
        json!(all.len() - kept.len())
    );
    assert_eq!(line["context_tokenizer"], "tiktoken:o200k_base");

    let metrics = String::from_utf8(sc.app.metrics.render()).unwrap();
    assert!(
        metrics.contains(r#"tailwarden_context_requests_total{result="trimmed",route="t/chat"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains(&format!(
        r#"tailwarden_context_trimmed_tokens_total{{route="t/chat"}} {}"#,
        before - after
    )));
    // The saving, at the provider's input price of 2.50 per million tokens.
    let saved = (before - after) as f64 * 2.5 / 1e6;
    let line = metrics
        .lines()
        .find(|l| l.starts_with("tailwarden_cost_saved_total{"))
        .expect("a cost_saved series");
    assert!(line.contains(r#"reason="context_trim""#), "{line}");
    let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!((value - saved).abs() < 1e-9, "{line} vs {saved}");

    // A conversation within its budget goes untouched, byte for byte.
    let short =
        json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}).to_string();
    let r = post(&sc, "/v1/chat/completions", &short).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.seen.lock().unwrap()[1].body, short);
    assert_eq!(r.header("x-tailwarden-context-trimmed"), "0");
}

#[tokio::test]
async fn a_tool_call_and_its_result_are_dropped_or_kept_together() {
    let up = upstream(|_, _| ok("Tomorrow: rain.")).await;
    let sc = sidecar(&config(
        &up.base_url(),
        "  contextBudget: {maxTokens: 120}\n",
    ))
    .await;
    let request = json!({"model": "gpt-4o", "messages": [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "What is the weather in Paris? ".repeat(10)},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny and 24 degrees ".repeat(10)},
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "user", "content": "And in Lyon?"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_b", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Lyon\"}"}}]},
        {"role": "tool", "tool_call_id": "call_b", "content": "rain"}
    ]});
    let r = post(&sc, "/v1/chat/completions", &request.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let sent: Value = serde_json::from_str(&up.seen.lock().unwrap()[0].body).unwrap();
    let kept: Vec<&Value> = sent["messages"].as_array().unwrap().iter().collect();
    let ids: Vec<&str> = kept
        .iter()
        .filter_map(|m| m["tool_call_id"].as_str())
        .collect();
    assert_eq!(ids, ["call_b"], "the Paris call went with its result");
    assert!(
        kept.iter().any(|m| m["tool_calls"][0]["id"] == "call_b"),
        "the Lyon call stays with its result"
    );
    assert!(!kept.iter().any(|m| m["tool_calls"][0]["id"] == "call_a"));
    assert_eq!(kept[0]["role"], "system");
    assert!(count(&sent) <= 120);
}

#[tokio::test]
async fn over_the_budget_is_a_clear_400_and_reaches_no_provider() {
    let up = upstream(|_, _| ok("never")).await;
    let sc = sidecar(&config(
        &up.base_url(),
        "  contextBudget: {maxTokens: 300, onOverflow: reject}\n",
    ))
    .await;
    let request = long_chat(10);
    let size = count(&request);
    let r = post(&sc, "/v1/chat/completions", &request.to_string()).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let e = &r.json()["error"];
    assert_eq!(e["code"], "context_budget_exceeded");
    assert_eq!(e["param"], "messages");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("The conversation is {size} tokens"))
            && message.contains("context budget of 300 tokens")
            && message.contains("tiktoken:o200k_base"),
        "{message}"
    );
    assert_eq!(up.count(), 0, "nothing was sent upstream");

    // trim, but even the last turn is over the budget: a 400 naming the minimum.
    let sc = sidecar(&config(
        &up.base_url(),
        "  contextBudget: {maxTokens: 16}\n",
    ))
    .await;
    let r = post(&sc, "/v1/chat/completions", &request.to_string()).await;
    assert_eq!(r.status, 400);
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("even trimmed to the system prompt and the last 1 turn(s)"),
        "{message}"
    );
    assert_eq!(up.count(), 0);
}

#[tokio::test]
async fn budgets_differ_per_tier_and_per_tenant() {
    let up = upstream(|_, _| ok("ok")).await;
    let spec = "  rateLimit: {tenantHeader: x-tenant}\n  contextBudget: {maxTokens: 200, perTenant: {acme: 100000}}\n  tiers:\n  - name: vip\n    model: gpt-4o-vip\n    when: {headers: {x-plan: vip}}\n    contextBudget: {maxTokens: 100000}\n";
    let sc = sidecar(&config(&up.base_url(), spec)).await;
    let body = long_chat(20).to_string();
    let send = |headers: Vec<(&'static str, &'static str)>| {
        let body = body.clone();
        let url = sc.url("/v1/chat/completions");
        async move {
            let mut req = http::Request::post(url).header("content-type", "application/json");
            for (k, v) in headers {
                req = req.header(k, v);
            }
            let resp = client()
                .request(
                    req.body(http_body_util::Full::new(bytes::Bytes::from(body)))
                        .unwrap(),
                )
                .await
                .unwrap();
            resp.headers()
                .get("x-tailwarden-context-trimmed")
                .unwrap()
                .to_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        }
    };
    assert!(send(vec![]).await > 0, "the route's budget trims");
    assert_eq!(send(vec![("x-plan", "vip")]).await, 0, "the tier has room");
    assert_eq!(
        send(vec![("x-tenant", "acme")]).await,
        0,
        "the tenant has room"
    );
    assert!(send(vec![("x-tenant", "other")]).await > 0);
}
