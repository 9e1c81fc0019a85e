//! The route validation table: valid and invalid `InferenceRoute` documents, each invalid one
//! asserting the exact field path and message the loader (and the API server) reports.

use serde_json::{Value, json};
use tailwarden_crds::{InferenceRoute, LoadError, load_str};

const BASE: &str = r#"
apiVersion: tailwarden.io/v1alpha1
kind: InferenceRoute
metadata: {name: chat, namespace: shop}
spec:
  models: ["gpt-4.1", "gpt-4.1-mini"]
  providers:
  - name: primary
    baseUrl: https://api.openai.com/v1
    auth: {secretRef: {name: openai, key: apiKey}}
    weight: 90
    modelMap: {gpt-4.1: gpt-4.1}
    pricing: [{model: gpt-4.1, inputPerMTok: "2.00", outputPerMTok: "8.00", cachedInputPerMTok: "0.50"}]
  - name: backup
    baseUrl: https://backup.example/v1
    weight: 10
    priority: 1
  tiers:
  - name: small
    model: gpt-4.1-mini
    when: {maxPromptChars: 200, noneOfKeywords: ["analyse", "compare", "design"]}
  timeouts: {connect: 2s, firstByte: 10s, idle: 30s, total: 120s}
  retries: {maxAttempts: 3, backoff: {base: 100ms, max: 2s}, retryOn: [connect, reset, 5xx, 429, firstByteTimeout],
            budgetPercent: 20, honorRetryAfter: true, maxRetryAfter: 30s}
  hedging: {enabled: true, delay: auto, maxPercent: 10}
  circuitBreaker: {consecutiveFailures: 5, failureRatePercent: 50, window: 30s, minRequests: 20,
                   openFor: 30s, maxOpenFor: 5m, halfOpenProbes: 3, slowCallThreshold: 5s}
  slo: {ttftP99: 800ms, latencyP99: 5s, availabilityPercent: "99.9"}
  rateLimit: {requestsPerSecond: 50, tokensPerMinute: 200000, maxConcurrent: 256, queueTimeout: 500ms,
              tenantHeader: x-tenant-id, backend: local}
  cache: {exact: {enabled: true, ttl: 5m, maxEntries: 10000, scope: tenant}}
  limits: {maxBodyBytes: 16Mi}
"#;

fn base() -> Value {
    serde_norway::from_str(BASE).expect("base parses")
}

/// Sets `value` at a JSON pointer, creating objects on the way.
fn set(doc: &mut Value, pointer: &str, value: Value) {
    let mut cur = doc;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i == parts.len() - 1;
        cur = match cur {
            Value::Object(map) => {
                if last {
                    map.insert((*part).to_owned(), value);
                    return;
                }
                map.entry((*part).to_owned()).or_insert_with(|| json!({}))
            }
            Value::Array(items) => {
                let idx: usize = part.parse().expect("array index");
                if last {
                    if idx == items.len() {
                        items.push(value);
                    } else {
                        items[idx] = value;
                    }
                    return;
                }
                &mut items[idx]
            }
            _ => panic!("cannot descend into {pointer}"),
        };
    }
}

fn remove(doc: &mut Value, pointer: &str) {
    let (parent, key) = pointer.rsplit_once('/').expect("pointer");
    match doc.pointer_mut(parent).expect("parent exists") {
        Value::Object(map) => {
            map.remove(key);
        }
        Value::Array(items) => {
            items.remove(key.parse::<usize>().expect("index"));
        }
        _ => panic!("not a container"),
    }
}

fn load(doc: &Value) -> Result<Vec<InferenceRoute>, LoadError> {
    let yaml = serde_norway::to_string(doc).expect("yaml");
    load_str("route.yaml", &yaml)
}

type Edit = fn(&mut Value);

#[test]
fn valid_routes_load() {
    let cases: Vec<(&str, Edit)> = vec![
        ("the base route", |_| {}),
        ("default route with one provider and nothing else", |d| {
            *d.pointer_mut("/spec").unwrap() = json!({
                "models": ["*"],
                "providers": [{"name": "only", "baseUrl": "http://127.0.0.1:18000/v1"}]
            });
        }),
        (
            "zero weight inside a tier that has another weighted provider",
            |d| {
                set(d, "/spec/providers/1/priority", json!(0));
                set(d, "/spec/providers/1/weight", json!(0));
            },
        ),
        ("fixed hedge delay below firstByte", |d| {
            set(d, "/spec/hedging/delay", json!("250ms"))
        }),
        ("env auth with Azure header and empty scheme", |d| {
            set(
                d,
                "/spec/providers/1/auth",
                json!({"env": "AZURE_KEY", "header": "api-key", "scheme": ""}),
            )
        }),
        ("pricing a modelMap target", |d| {
            set(
                d,
                "/spec/providers/0/modelMap",
                json!({"gpt-4.1": "gpt-4.1-2025-04-14"}),
            );
            set(
                d,
                "/spec/providers/0/pricing/0/model",
                json!("gpt-4.1-2025-04-14"),
            );
        }),
        ("availability of 100", |d| {
            set(d, "/spec/slo/availabilityPercent", json!("100"))
        }),
        ("compound durations", |d| {
            set(d, "/spec/timeouts/total", json!("1m30s"))
        }),
        ("redis backend with an address", |d| {
            set(d, "/spec/rateLimit/backend", json!("redis"));
            set(
                d,
                "/spec/rateLimit/redis",
                json!({"address": "redis.shop:6379"}),
            );
        }),
        ("redis with AUTH, TLS and a client certificate", |d| {
            set(d, "/spec/rateLimit/backend", json!("redis"));
            set(
                d,
                "/spec/rateLimit/redis",
                json!({"address": "rediss://redis.shop:6380",
                       "auth": {"username": "tw", "password": {"secretRef": {"name": "redis", "key": "password"}}},
                       "tls": {"ca": {"file": "/etc/redis/ca.crt"}, "clientCertificate": {"secretName": "redis-client"},
                               "serverName": "redis.internal"}}),
            );
        }),
        ("a shared cache with a password from the environment", |d| {
            set(d, "/spec/cache/exact/enabled", json!(true));
            set(d, "/spec/cache/exact/backend", json!("redis"));
            set(
                d,
                "/spec/cache/exact/redis",
                json!({"address": "redis.shop:6379", "auth": {"password": {"env": "REDIS_PASSWORD"}},
                       "tls": {}}),
            );
        }),
        ("tiers on regex, headers and message counts", |d| {
            set(
                d,
                "/spec/tiers/0/when",
                json!({"regex": "(?i)\\bsql\\b", "headers": {"x-plan": "free"},
                       "minMessages": 1, "maxMessages": 4}),
            )
        }),
        ("per-tenant limits and a bounded queue", |d| {
            set(d, "/spec/rateLimit/maxQueued", json!(32));
            set(
                d,
                "/spec/rateLimit/perTenant",
                json!({"requestsPerSecond": 5, "tokensPerMinute": 20000, "maxConcurrent": 4}),
            );
        }),
        ("semantic cache on a route provider", |d| {
            set(
                d,
                "/spec/cache/semantic",
                json!({"enabled": true, "embeddingsProvider": "backup",
                       "embeddingsModel": "text-embedding-3-small", "threshold": "0.95",
                       "ttl": "10m", "maxEntries": 500, "scope": "shared", "timeout": "500ms"}),
            )
        }),
        ("semantic threshold of exactly 1", |d| {
            set(
                d,
                "/spec/cache/semantic",
                json!({"enabled": true, "embeddingsProvider": "primary",
                       "embeddingsModel": "e", "threshold": "1.0"}),
            )
        }),
        ("capability rules", |d| {
            set(
                d,
                "/spec/providers/1/capabilities",
                json!([{"models": ["llama-3"], "unsupported": ["tools", "tool_choice"], "onUnsupported": "reject"},
                       {"unsupported": ["response_format"]}]),
            )
        }),
        ("priorities from a header and a tier", |d| {
            set(
                d,
                "/spec/rateLimit/priority",
                json!({"header": "x-priority", "defaultPriority": 3, "starvationBound": "250ms"}),
            );
            set(d, "/spec/tiers/0/priority", json!(1));
        }),
        ("context budgets per route, tier and tenant", |d| {
            set(
                d,
                "/spec/contextBudget",
                json!({"maxTokens": 8000, "keepLastTurns": 4, "onOverflow": "reject",
                       "tokenizer": "o200kBase", "perTenant": {"acme": 32000}}),
            );
            set(d, "/spec/tiers/0/contextBudget", json!({"maxTokens": 2000}));
        }),
    ];
    for (name, edit) in cases {
        let mut doc = base();
        edit(&mut doc);
        if let Err(e) = load(&doc) {
            panic!("{name}: expected valid, got: {e}");
        }
    }
}

#[test]
fn invalid_routes_are_rejected_with_exact_messages() {
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "no models",
            |d| {
                set(d, "/spec/models", json!([]));
                remove(d, "/spec/tiers");
                remove(d, "/spec/providers/0/modelMap");
                remove(d, "/spec/providers/0/pricing");
            },
            "spec.models",
            "at least one model is required (use \"*\" for a default route)",
        ),
        (
            "duplicate models",
            |d| {
                set(
                    d,
                    "/spec/models",
                    json!(["gpt-4.1", "gpt-4.1-mini", "gpt-4.1"]),
                )
            },
            "spec.models",
            "models must be unique",
        ),
        (
            "empty provider list",
            |d| set(d, "/spec/providers", json!([])),
            "spec.providers",
            "at least one provider is required",
        ),
        (
            "duplicate provider names",
            |d| set(d, "/spec/providers/1/name", json!("primary")),
            "spec.providers",
            "provider names must be unique",
        ),
        (
            "all weights zero in a tier",
            |d| set(d, "/spec/providers/1/weight", json!(0)),
            "spec.providers",
            "every priority tier needs at least one provider with a non-zero weight",
        ),
        (
            "weight over 100",
            |d| set(d, "/spec/providers/0/weight", json!(101)),
            "spec.providers[0].weight",
            "weight must be between 0 and 100",
        ),
        (
            "priority over 9",
            |d| set(d, "/spec/providers/1/priority", json!(10)),
            "spec.providers[1].priority",
            "priority must be between 0 and 9",
        ),
        (
            "provider name not a DNS label",
            |d| set(d, "/spec/providers/0/name", json!("Primary_1")),
            "spec.providers[0].name",
            "provider name must be a DNS label: lowercase letters, digits and '-', starting and ending with a letter or digit",
        ),
        (
            "baseUrl with userinfo",
            |d| {
                set(
                    d,
                    "/spec/providers/0/baseUrl",
                    json!("https://user:pw@api.openai.com/v1"),
                )
            },
            "spec.providers[0].baseUrl",
            "baseUrl must be an http:// or https:// URL with no user name, password, query or fragment",
        ),
        (
            "baseUrl not http",
            |d| {
                set(
                    d,
                    "/spec/providers/0/baseUrl",
                    json!("ftp://api.openai.com/v1"),
                )
            },
            "spec.providers[0].baseUrl",
            "baseUrl must be an http:// or https:// URL with no user name, password, query or fragment",
        ),
        (
            "baseUrl with query",
            |d| {
                set(
                    d,
                    "/spec/providers/0/baseUrl",
                    json!("https://api.openai.com/v1?key=1"),
                )
            },
            "spec.providers[0].baseUrl",
            "baseUrl must be an http:// or https:// URL with no user name, password, query or fragment",
        ),
        (
            "maxConnections zero",
            |d| set(d, "/spec/providers/0/maxConnections", json!(0)),
            "spec.providers[0].maxConnections",
            "maxConnections must be between 1 and 10000",
        ),
        (
            "auth with two sources",
            |d| set(d, "/spec/providers/0/auth/env", json!("OPENAI_API_KEY")),
            "spec.providers[0].auth",
            "auth needs exactly one of secretRef, env or file",
        ),
        (
            "auth with no source",
            |d| set(d, "/spec/providers/0/auth", json!({"header": "api-key"})),
            "spec.providers[0].auth",
            "auth needs exactly one of secretRef, env or file",
        ),
        (
            "auth env not a variable name",
            |d| set(d, "/spec/providers/1/auth", json!({"env": "1KEY"})),
            "spec.providers[1].auth.env",
            "env must be an environment variable name (letters, digits and '_', not starting with a digit)",
        ),
        (
            "auth file relative",
            |d| set(d, "/spec/providers/1/auth", json!({"file": "keys/openai"})),
            "spec.providers[1].auth.file",
            "file must be an absolute path",
        ),
        (
            "modelMap key not served",
            |d| set(d, "/spec/providers/0/modelMap", json!({"gpt-5": "gpt-5"})),
            "spec.providers",
            "modelMap keys must be models this route serves (listed in spec.models)",
        ),
        (
            "pricing unknown model",
            |d| set(d, "/spec/providers/0/pricing/0/model", json!("o3")),
            "spec.providers",
            "pricing entries must name a model the provider serves: a spec.models entry or a modelMap target",
        ),
        (
            "pricing listed twice",
            |d| {
                set(
                    d,
                    "/spec/providers/0/pricing/1",
                    json!({"model": "gpt-4.1", "inputPerMTok": "1", "outputPerMTok": "1"}),
                )
            },
            "spec.providers[0].pricing",
            "pricing must list each model once",
        ),
        (
            "tier model not served",
            |d| set(d, "/spec/tiers/0/model", json!("gpt-3.5")),
            "spec.tiers",
            "tier models must be models this route serves (listed in spec.models)",
        ),
        (
            "tier names repeated",
            |d| {
                set(
                    d,
                    "/spec/tiers/1",
                    json!({"name": "small", "model": "gpt-4.1"}),
                )
            },
            "spec.tiers",
            "tier names must be unique",
        ),
        (
            "tier min above max",
            |d| set(d, "/spec/tiers/0/when/minPromptChars", json!(500)),
            "spec.tiers[0].when.minPromptChars",
            "minPromptChars must not exceed maxPromptChars",
        ),
        (
            "firstByte above total",
            |d| set(d, "/spec/timeouts/firstByte", json!("3m")),
            "spec.timeouts.firstByte",
            "firstByte must not exceed total",
        ),
        (
            "idle above total",
            |d| set(d, "/spec/timeouts/idle", json!("121s")),
            "spec.timeouts.idle",
            "idle must not exceed total",
        ),
        (
            "connect above total",
            |d| set(d, "/spec/timeouts/connect", json!("1h")),
            "spec.timeouts.connect",
            "connect must not exceed total",
        ),
        (
            "zero timeout",
            |d| set(d, "/spec/timeouts/connect", json!("0s")),
            "spec.timeouts",
            "timeouts must be greater than zero",
        ),
        (
            "maxAttempts zero",
            |d| {
                set(d, "/spec/retries/maxAttempts", json!(0));
                set(d, "/spec/hedging/enabled", json!(false));
            },
            "spec.retries.maxAttempts",
            "maxAttempts must be between 1 and 10",
        ),
        (
            "maxAttempts eleven",
            |d| set(d, "/spec/retries/maxAttempts", json!(11)),
            "spec.retries.maxAttempts",
            "maxAttempts must be between 1 and 10",
        ),
        (
            "budgetPercent over 100",
            |d| set(d, "/spec/retries/budgetPercent", json!(150)),
            "spec.retries.budgetPercent",
            "budgetPercent must be between 0 and 100",
        ),
        (
            "backoff base above max",
            |d| set(d, "/spec/retries/backoff/base", json!("5s")),
            "spec.retries.backoff.base",
            "backoff.base must not exceed backoff.max",
        ),
        (
            "hedging with a single attempt",
            |d| set(d, "/spec/retries/maxAttempts", json!(1)),
            "spec.hedging.enabled",
            "hedging needs retries.maxAttempts of at least 2: a hedge is an extra attempt",
        ),
        (
            "hedge delay not a duration",
            |d| set(d, "/spec/hedging/delay", json!("soon")),
            "spec.hedging.delay",
            "delay must be \"auto\" or a duration such as \"250ms\"",
        ),
        (
            "hedge delay beyond firstByte",
            |d| set(d, "/spec/hedging/delay", json!("10s")),
            "spec.hedging.delay",
            "hedging.delay must be shorter than timeouts.firstByte, or the hedge can never start",
        ),
        (
            "hedge maxPercent over 100",
            |d| set(d, "/spec/hedging/maxPercent", json!(101)),
            "spec.hedging.maxPercent",
            "maxPercent must be between 0 and 100",
        ),
        (
            "breaker openFor above maxOpenFor",
            |d| set(d, "/spec/circuitBreaker/openFor", json!("10m")),
            "spec.circuitBreaker.openFor",
            "openFor must be greater than zero and not exceed maxOpenFor",
        ),
        (
            "breaker failure rate zero",
            |d| set(d, "/spec/circuitBreaker/failureRatePercent", json!(0)),
            "spec.circuitBreaker.failureRatePercent",
            "failureRatePercent must be between 1 and 100",
        ),
        (
            "breaker no probes",
            |d| set(d, "/spec/circuitBreaker/halfOpenProbes", json!(0)),
            "spec.circuitBreaker.halfOpenProbes",
            "halfOpenProbes must be between 1 and 100",
        ),
        (
            "breaker consecutive zero",
            |d| set(d, "/spec/circuitBreaker/consecutiveFailures", json!(0)),
            "spec.circuitBreaker.consecutiveFailures",
            "consecutiveFailures must be between 1 and 1000",
        ),
        (
            "availability over 100",
            |d| set(d, "/spec/slo/availabilityPercent", json!("100.5")),
            "spec.slo.availabilityPercent",
            "availabilityPercent must be a decimal string above 0 and at most 100, such as \"99.9\"",
        ),
        (
            "availability zero",
            |d| set(d, "/spec/slo/availabilityPercent", json!("0.0")),
            "spec.slo.availabilityPercent",
            "availabilityPercent must be a decimal string above 0 and at most 100, such as \"99.9\"",
        ),
        (
            "ttft SLO beyond firstByte",
            |d| set(d, "/spec/slo/ttftP99", json!("11s")),
            "spec.slo.ttftP99",
            "slo.ttftP99 must not exceed timeouts.firstByte",
        ),
        (
            "latency SLO beyond total",
            |d| set(d, "/spec/slo/latencyP99", json!("3m")),
            "spec.slo.latencyP99",
            "slo.latencyP99 must not exceed timeouts.total",
        ),
        (
            "redis backend without address",
            |d| set(d, "/spec/rateLimit/backend", json!("redis")),
            "spec.rateLimit.redis",
            "backend redis needs a redis section with the server address",
        ),
        (
            "redis address without port",
            |d| {
                set(d, "/spec/rateLimit/backend", json!("redis"));
                set(d, "/spec/rateLimit/redis", json!({"address": "redis"}));
            },
            "spec.rateLimit.redis.address",
            "address must be host:port, redis://host:port or rediss://host:port (no user name or password: use auth)",
        ),
        (
            "redis password in the address",
            |d| {
                set(d, "/spec/rateLimit/backend", json!("redis"));
                set(
                    d,
                    "/spec/rateLimit/redis",
                    json!({"address": "rediss://:hunter2@redis:6380"}),
                );
            },
            "spec.rateLimit.redis.address",
            "address must be host:port, redis://host:port or rediss://host:port (no user name or password: use auth)",
        ),
        (
            "redis tls on a plain redis:// address",
            |d| {
                set(d, "/spec/rateLimit/backend", json!("redis"));
                set(
                    d,
                    "/spec/rateLimit/redis",
                    json!({"address": "redis://redis:6379", "tls": {}}),
                );
            },
            "spec.rateLimit.redis.tls",
            "tls is set but the address says redis:// (plain); use rediss:// or host:port",
        ),
        (
            "redis password from two sources",
            |d| {
                set(d, "/spec/rateLimit/backend", json!("redis"));
                set(
                    d,
                    "/spec/rateLimit/redis",
                    json!({"address": "redis:6379", "auth": {"password": {"env": "P", "file": "/p"}}}),
                );
            },
            "spec.rateLimit.redis.auth.password",
            "needs exactly one of secretRef, env or file",
        ),
        (
            "redis CA from the environment",
            |d| {
                set(d, "/spec/rateLimit/backend", json!("redis"));
                set(
                    d,
                    "/spec/rateLimit/redis",
                    json!({"address": "redis:6379", "tls": {"ca": {"env": "CA"}}}),
                );
            },
            "spec.rateLimit.redis.tls.ca",
            "ca must be a secretRef or a file (a PEM bundle), not env",
        ),
        (
            "redis client certificate without its key",
            |d| {
                set(d, "/spec/cache/exact/enabled", json!(true));
                set(d, "/spec/cache/exact/backend", json!("redis"));
                set(
                    d,
                    "/spec/cache/exact/redis",
                    json!({"address": "redis:6379", "tls": {"clientCertificate": {"certFile": "/c.pem"}}}),
                );
            },
            "spec.cache.exact.redis.tls.clientCertificate",
            "clientCertificate needs either secretName or both certFile and keyFile",
        ),
        (
            "rate limit zero rps",
            |d| set(d, "/spec/rateLimit/requestsPerSecond", json!(0)),
            "spec.rateLimit.requestsPerSecond",
            "requestsPerSecond must be at least 1",
        ),
        (
            "tenant header with spaces",
            |d| set(d, "/spec/rateLimit/tenantHeader", json!("x tenant")),
            "spec.rateLimit.tenantHeader",
            "tenantHeader must be an HTTP header name",
        ),
        (
            "perTenant without tenantHeader",
            |d| {
                remove(d, "/spec/rateLimit/tenantHeader");
                set(
                    d,
                    "/spec/rateLimit/perTenant",
                    json!({"requestsPerSecond": 5}),
                );
            },
            "spec.rateLimit.perTenant",
            "perTenant limits need tenantHeader",
        ),
        (
            "perTenant zero tokens",
            |d| {
                set(
                    d,
                    "/spec/rateLimit/perTenant",
                    json!({"tokensPerMinute": 0}),
                )
            },
            "spec.rateLimit.perTenant.tokensPerMinute",
            "tokensPerMinute must be at least 1",
        ),
        (
            "tier header name with a space",
            |d| set(d, "/spec/tiers/0/when/headers", json!({"x plan": "free"})),
            "spec.tiers[0].when.headers",
            "headers keys must be HTTP header names",
        ),
        (
            "tier min messages above max",
            |d| {
                set(
                    d,
                    "/spec/tiers/0/when",
                    json!({"minMessages": 5, "maxMessages": 2}),
                )
            },
            "spec.tiers[0].when.minMessages",
            "minMessages must not exceed maxMessages",
        ),
        (
            "capability rule without parameters",
            |d| {
                set(
                    d,
                    "/spec/providers/1/capabilities",
                    json!([{"unsupported": []}]),
                )
            },
            "spec.providers[1].capabilities[0].unsupported",
            "unsupported must list at least one parameter",
        ),
        (
            "capability rule dropping messages",
            |d| {
                set(
                    d,
                    "/spec/providers/1/capabilities",
                    json!([{"unsupported": ["tools", "messages"], "onUnsupported": "drop"}]),
                )
            },
            "spec.providers[1].capabilities[0].unsupported",
            "model, messages, prompt, input and stream cannot be unsupported",
        ),
        (
            "cache zero entries",
            |d| set(d, "/spec/cache/exact/maxEntries", json!(0)),
            "spec.cache.exact.maxEntries",
            "maxEntries must be at least 1",
        ),
        (
            "semantic cache naming an unknown provider",
            |d| {
                set(
                    d,
                    "/spec/cache/semantic",
                    json!({"enabled": true, "embeddingsProvider": "openai",
                           "embeddingsModel": "text-embedding-3-small"}),
                )
            },
            "spec.cache.semantic.embeddingsProvider",
            "cache.semantic.embeddingsProvider must be the name of one of this route's providers",
        ),
        (
            "semantic cache enabled without a model",
            |d| {
                set(
                    d,
                    "/spec/cache/semantic",
                    json!({"enabled": true, "embeddingsProvider": "primary"}),
                )
            },
            "spec.cache.semantic.embeddingsModel",
            "embeddingsModel is required when the semantic cache is enabled",
        ),
        (
            "semantic cache enabled without a provider",
            |d| {
                set(
                    d,
                    "/spec/cache/semantic",
                    json!({"enabled": true, "embeddingsModel": "e"}),
                )
            },
            "spec.cache.semantic.embeddingsProvider",
            "embeddingsProvider is required when the semantic cache is enabled",
        ),
        (
            "semantic threshold zero",
            |d| set(d, "/spec/cache/semantic/threshold", json!("0.000")),
            "spec.cache.semantic.threshold",
            "threshold must be a decimal string above 0 and at most 1, such as \"0.92\"",
        ),
        (
            "semantic threshold above one",
            |d| set(d, "/spec/cache/semantic/threshold", json!("1.01")),
            "spec.cache.semantic.threshold",
            "threshold must be a decimal string above 0 and at most 1, such as \"0.92\"",
        ),
        (
            "semantic zero timeout",
            |d| set(d, "/spec/cache/semantic/timeout", json!("0s")),
            "spec.cache.semantic.timeout",
            "timeout must be greater than zero",
        ),
        (
            "semantic too many entries",
            |d| set(d, "/spec/cache/semantic/maxEntries", json!(10001)),
            "spec.cache.semantic.maxEntries",
            "maxEntries must be between 1 and 10000",
        ),
        (
            "default priority out of range",
            |d| {
                set(
                    d,
                    "/spec/rateLimit/priority",
                    json!({"defaultPriority": 10}),
                )
            },
            "spec.rateLimit.priority.defaultPriority",
            "defaultPriority must be between 0 and 9",
        ),
        (
            "tier priority out of range",
            |d| set(d, "/spec/tiers/0/priority", json!(12)),
            "spec.tiers[0].priority",
            "tier priority must be between 0 and 9",
        ),
        (
            "priority header not a header name",
            |d| {
                set(
                    d,
                    "/spec/rateLimit/priority",
                    json!({"header": "x priority"}),
                )
            },
            "spec.rateLimit.priority.header",
            "header must be an HTTP header name",
        ),
        (
            "starvation bound over the queue timeout",
            |d| {
                set(
                    d,
                    "/spec/rateLimit/priority",
                    json!({"starvationBound": "2s"}),
                )
            },
            "spec.rateLimit.priority.starvationBound",
            "priority.starvationBound must not exceed queueTimeout: no request waits longer than that",
        ),
        (
            "zero starvation bound",
            |d| {
                set(
                    d,
                    "/spec/rateLimit/priority",
                    json!({"starvationBound": "0s"}),
                )
            },
            "spec.rateLimit.priority.starvationBound",
            "starvationBound must be greater than zero",
        ),
        (
            "priority without a concurrency limit",
            |d| {
                remove(d, "/spec/rateLimit/maxConcurrent");
                set(d, "/spec/rateLimit/priority", json!({}));
            },
            "spec.rateLimit.priority",
            "priority orders the concurrency queue: it needs maxConcurrent (or perTenant.maxConcurrent)",
        ),
        (
            "context budget too small",
            |d| set(d, "/spec/contextBudget", json!({"maxTokens": 8})),
            "spec.contextBudget.maxTokens",
            "maxTokens must be between 16 and 10000000",
        ),
        (
            "context budget keeps no turn",
            |d| {
                set(
                    d,
                    "/spec/contextBudget",
                    json!({"maxTokens": 800, "keepLastTurns": 0}),
                )
            },
            "spec.contextBudget.keepLastTurns",
            "keepLastTurns must be between 1 and 1000: the turn being asked is always kept",
        ),
        (
            "context budget per tenant without a tenant header",
            |d| {
                remove(d, "/spec/rateLimit/tenantHeader");
                set(
                    d,
                    "/spec/tiers/0/contextBudget",
                    json!({"maxTokens": 800, "perTenant": {"acme": 9000}}),
                );
            },
            "spec.contextBudget",
            "contextBudget.perTenant needs rateLimit.tenantHeader: it names the header that says who the tenant is",
        ),
        (
            "context budget of a tenant too small",
            |d| {
                set(
                    d,
                    "/spec/contextBudget",
                    json!({"maxTokens": 800, "perTenant": {"acme": 1}}),
                )
            },
            "spec.contextBudget.perTenant",
            "perTenant budgets must be between 16 and 10000000 tokens",
        ),
        (
            "heartbeat too frequent",
            |d| set(d, "/spec/streaming", json!({"heartbeatInterval": "100ms"})),
            "spec.streaming.heartbeatInterval",
            "heartbeatInterval must be at least 1s",
        ),
        (
            "stream fallback after no failures",
            |d| {
                set(
                    d,
                    "/spec/streaming",
                    json!({"fallback": {"afterFailures": 0}}),
                )
            },
            "spec.streaming.fallback.afterFailures",
            "afterFailures must be between 1 and 100",
        ),
        (
            "stream fallback probing too often",
            |d| {
                set(
                    d,
                    "/spec/streaming",
                    json!({"fallback": {"probeAfter": "10ms"}}),
                )
            },
            "spec.streaming.fallback.probeAfter",
            "probeAfter must be between 1s and 1h",
        ),
        (
            "degradation to an unknown provider",
            |d| {
                set(
                    d,
                    "/spec/degradation",
                    json!({"model": "gpt-4.1-mini", "providers": ["nobody"]}),
                )
            },
            "spec.degradation.providers",
            "degradation.providers must name providers of this route",
        ),
        (
            "degradation to a model the route does not serve",
            |d| set(d, "/spec/degradation", json!({"model": "gpt-3"})),
            "spec.degradation.model",
            "degradation.model must be a model this route serves (listed in spec.models)",
        ),
        (
            "degradation on SLO burn without a P99 objective",
            |d| {
                set(d, "/spec/slo", json!({"availabilityPercent": "99.9"}));
                set(
                    d,
                    "/spec/degradation",
                    json!({"model": "gpt-4.1-mini", "sloBurn": {}}),
                );
            },
            "spec.degradation.sloBurn",
            "degradation.sloBurn needs slo.ttftP99 or slo.latencyP99: it measures how fast the normal tier misses them",
        ),
        (
            "degradation without a trigger",
            |d| {
                set(
                    d,
                    "/spec/degradation",
                    json!({"model": "gpt-4.1-mini", "onUnavailable": false}),
                )
            },
            "spec.degradation.sloBurn",
            "degradation needs a trigger: sloBurn, onUnavailable or manual",
        ),
        (
            "degradation burn rate out of range",
            |d| {
                set(
                    d,
                    "/spec/degradation",
                    json!({"model": "gpt-4.1-mini", "sloBurn": {"burnRate": 0}}),
                )
            },
            "spec.degradation.sloBurn.burnRate",
            "burnRate must be between 1 and 100",
        ),
        (
            "degradation probes too many",
            |d| {
                set(
                    d,
                    "/spec/degradation",
                    json!({"model": "gpt-4.1-mini", "probePercent": 60}),
                )
            },
            "spec.degradation.probePercent",
            "probePercent must be between 0 and 50",
        ),
    ];
    assert!(cases.len() >= 25);
    let mut failures = Vec::new();
    for (name, edit, field, message) in cases {
        let mut doc = base();
        edit(&mut doc);
        match load(&doc) {
            Ok(_) => failures.push(format!("{name}: accepted")),
            Err(e) => {
                let issues = e.issues();
                let hit = issues
                    .iter()
                    .any(|i| i.field == field && i.message == message);
                if !hit || issues.len() != 1 {
                    failures.push(format!(
                        "{name}: wanted exactly `{field}: {message}`, got:\n{e}"
                    ));
                }
                // The rendered message names the file, the document and the route.
                let text = e.to_string();
                if !text.starts_with("route.yaml: document 1 (route shop/chat): ") {
                    failures.push(format!("{name}: message lacks file/document/route: {text}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn type_errors_name_the_field() {
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "negative weight",
            |d| set(d, "/spec/providers/0/weight", json!(-5)),
            "spec.providers[0].weight",
            "invalid value: integer `-5`, expected u32",
        ),
        (
            "wrong type",
            |d| set(d, "/spec/retries/maxAttempts", json!("three")),
            "spec.retries.maxAttempts",
            "invalid type: string \"three\", expected u32",
        ),
        (
            "unknown field",
            |d| set(d, "/spec/providers/0/wieght", json!(5)),
            "spec.providers[0].wieght",
            "unknown field `wieght`, expected one of `name`, `baseUrl`",
        ),
        (
            "bad duration",
            |d| set(d, "/spec/timeouts/total", json!("2 minutes")),
            "spec.timeouts.total",
            "invalid duration \"2 minutes\"",
        ),
        (
            "bad decimal",
            |d| set(d, "/spec/providers/0/pricing/0/inputPerMTok", json!("$2")),
            "spec.providers[0].pricing[0].inputPerMTok",
            "invalid decimal \"$2\"",
        ),
        (
            "price as a float",
            |d| set(d, "/spec/providers/0/pricing/0/inputPerMTok", json!(2.5)),
            "spec.providers[0].pricing[0].inputPerMTok",
            "invalid type: floating point `2.5`, expected a decimal string",
        ),
        (
            "bad byte size",
            |d| set(d, "/spec/limits/maxBodyBytes", json!("16MB")),
            "spec.limits.maxBodyBytes",
            "invalid byte size \"16MB\"",
        ),
        (
            "unknown retryOn class",
            |d| set(d, "/spec/retries/retryOn", json!(["4xx"])),
            "spec.retries.retryOn[0]",
            "unknown retryOn class `4xx`, expected one of connect, reset, 5xx, 429, firstByteTimeout",
        ),
        (
            "missing provider name",
            |d| remove(d, "/spec/providers/0/name"),
            "spec.providers[0]",
            "missing field `name`",
        ),
    ];
    for (name, edit, field, message_start) in cases {
        let mut doc = base();
        edit(&mut doc);
        let err = load(&doc).expect_err(name);
        let issues = err.issues();
        assert_eq!(issues.len(), 1, "{name}: {err}");
        assert_eq!(issues[0].field, field, "{name}: {err}");
        assert!(
            issues[0].message.starts_with(message_start),
            "{name}: message {:?} should start with {message_start:?}",
            issues[0].message
        );
        assert_eq!(issues[0].document, 1);
    }
}

#[test]
fn file_level_errors_are_clear() {
    // YAML syntax error: names the file, the document and where.
    let err = load_str(
        "bad.yaml",
        "apiVersion: tailwarden.io/v1alpha1\nkind: [unclosed\n",
    )
    .expect_err("syntax error");
    let text = err.to_string();
    assert!(text.starts_with("bad.yaml: document 1: "), "{text}");
    assert!(text.contains("line 2"), "{text}");

    // Wrong kind and apiVersion.
    let err = load_str(
        "k.yaml",
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
    )
    .expect_err("wrong kind");
    assert_eq!(
        err.to_string(),
        "k.yaml: 2 problems:\n  document 1 (route default/x): apiVersion: must be \"tailwarden.io/v1alpha1\", found \"v1\"\n  document 1 (route default/x): kind: must be \"InferenceRoute\", found \"ConfigMap\""
    );

    // Missing name.
    let err = load_str(
        "n.yaml",
        "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nspec: {}\n",
    )
    .expect_err("no name");
    assert_eq!(
        err.to_string(),
        "n.yaml: document 1: metadata.name: required: every route needs a name"
    );

    // A scalar document.
    let err = load_str("s.yaml", "just text\n").expect_err("scalar");
    assert_eq!(
        err.to_string(),
        "s.yaml: document 1: expected an InferenceRoute object (a YAML mapping)"
    );

    // Unreadable file.
    let err = tailwarden_crds::load_file(std::path::Path::new("/nonexistent/routes.yaml"))
        .expect_err("missing file");
    assert!(
        err.to_string()
            .starts_with("/nonexistent/routes.yaml: cannot read: "),
        "{err}"
    );
}

#[test]
fn multi_document_files_check_across_routes() {
    let one = |name: &str, models: &str| {
        format!(
            "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: {name}}}\nspec:\n  models: {models}\n  providers: [{{name: p, baseUrl: 'http://127.0.0.1:1/v1'}}]\n"
        )
    };
    // Empty documents are skipped; two routes with distinct models load.
    let text = format!(
        "---\n{}---\n---\n{}",
        one("a", "[m1]"),
        one("b", "[m2, '*']")
    );
    let routes = load_str("multi.yaml", &text).expect("two routes");
    assert_eq!(routes.len(), 2);

    // The same model on two routes.
    let text = format!("{}---\n{}", one("a", "[m1]"), one("b", "[m2, m1]"));
    let err = load_str("multi.yaml", &text).expect_err("model twice");
    assert_eq!(
        err.to_string(),
        "multi.yaml: document 2 (route default/b): spec.models[1]: model \"m1\" is already served by route default/a (document 1)"
    );

    // The same route twice.
    let text = format!("{}---\n{}", one("a", "[m1]"), one("a", "[m2]"));
    let err = load_str("multi.yaml", &text).expect_err("route twice");
    assert_eq!(
        err.to_string(),
        "multi.yaml: document 2 (route default/a): metadata.name: route default/a is already defined in document 1"
    );

    // Problems in several documents are all reported.
    let text = format!("{}---\n{}", one("a", "[]"), one("b", "[x, x]"));
    let err = load_str("multi.yaml", &text).expect_err("two bad");
    assert_eq!(err.issues().len(), 2, "{err}");
    assert_eq!(err.issues()[1].document, 2);
}

#[test]
fn defaults_make_a_minimal_route_complete() {
    let text = "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {name: min}\nspec:\n  models: ['*']\n  providers: [{name: p, baseUrl: 'http://127.0.0.1:1/v1'}]\n";
    let routes = load_str("min.yaml", text).expect("minimal route");
    let spec = &routes[0].spec;
    let s = std::time::Duration::from_secs;
    assert_eq!(spec.providers[0].weight, 100);
    assert_eq!(spec.providers[0].priority, 0);
    assert_eq!(spec.providers[0].max_connections, 100);
    assert!(spec.providers[0].auth.is_none());
    assert_eq!(spec.timeouts.connect.get(), s(2));
    assert_eq!(spec.timeouts.first_byte.get(), s(30));
    assert_eq!(spec.timeouts.idle.get(), s(30));
    assert_eq!(spec.timeouts.total.get(), s(120));
    assert_eq!(spec.retries.max_attempts, 3);
    assert_eq!(spec.retries.budget_percent, 20);
    assert_eq!(spec.retries.retry_on.len(), 5);
    assert!(spec.retries.honor_retry_after);
    assert_eq!(spec.retries.max_retry_after.get(), s(30));
    assert_eq!(
        spec.retries.backoff.base.get(),
        std::time::Duration::from_millis(100)
    );
    assert!(!spec.hedging.enabled);
    assert_eq!(spec.hedging.fixed_delay(), None);
    assert!(spec.circuit_breaker.enabled);
    assert_eq!(spec.circuit_breaker.consecutive_failures, 5);
    assert_eq!(spec.circuit_breaker.max_open_for.get(), s(300));
    assert!(spec.slo.is_none());
    assert!(spec.rate_limit.is_none());
    assert!(!spec.cache.exact.enabled);
    let semantic = &spec.cache.semantic;
    assert!(!semantic.enabled);
    assert_eq!(semantic.threshold.as_str(), "0.92");
    assert_eq!(semantic.ttl.get(), s(300));
    assert_eq!(semantic.max_entries, 1000);
    assert_eq!(semantic.timeout.get(), s(2));
    assert!(semantic.deterministic_only);
    assert_eq!(semantic.scope, tailwarden_crds::CacheScope::Tenant);
    assert!(semantic.embeddings_provider.is_none() && semantic.embeddings_model.is_none());
    assert!(spec.streaming.include_usage);
    assert_eq!(spec.limits.max_body_bytes.get(), 16 << 20);

    // Auth defaults.
    let text = text.replace(
        "baseUrl: 'http://127.0.0.1:1/v1'",
        "baseUrl: 'http://127.0.0.1:1/v1', auth: {env: KEY}",
    );
    let routes = load_str("min.yaml", &text).expect("auth route");
    let auth = routes[0].spec.providers[0].auth.as_ref().expect("auth");
    assert_eq!(auth.header, "Authorization");
    assert_eq!(auth.scheme, "Bearer");
}

#[test]
fn every_example_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).expect("examples dir") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let routes = tailwarden_crds::load_file(&path)
                .unwrap_or_else(|e| panic!("example does not validate: {e}"));
            assert!(!routes.is_empty(), "{}", path.display());
            count += 1;
        }
    }
    assert!(
        count >= 3,
        "expected at least three examples, found {count}"
    );
}

#[test]
fn a_directory_of_route_files_loads_as_one_config() {
    let dir = std::env::temp_dir().join(format!("tw-crds-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let route = |name: &str, model: &str| {
        format!(
            "apiVersion: tailwarden.io/v1alpha1\nkind: InferenceRoute\nmetadata: {{name: {name}}}\nspec:\n  models: [{model}]\n  providers: [{{name: p, baseUrl: 'http://127.0.0.1:1/v1'}}]\n"
        )
    };
    std::fs::write(dir.join("a.yaml"), route("a", "m1")).expect("write");
    std::fs::write(dir.join("b.yaml"), route("b", "m2")).expect("write");
    std::fs::write(dir.join("notes.txt"), "ignored").expect("write");
    std::fs::write(dir.join(".hidden.yaml"), "ignored: [").expect("write");
    let routes = tailwarden_crds::load_file(&dir).expect("two files");
    assert_eq!(routes.len(), 2);

    std::fs::write(dir.join("b.yaml"), route("b", "m1")).expect("write");
    let err = tailwarden_crds::load_file(&dir).expect_err("model twice");
    let a = dir.join("a.yaml").display().to_string();
    let b = dir.join("b.yaml").display().to_string();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: {b}: document 1 (route default/b): spec.models[0]: model \"m1\" is already served by route default/a ({a} document 1)",
            dir.display()
        )
    );
    // An empty directory is a valid, empty config.
    for f in ["a.yaml", "b.yaml"] {
        std::fs::remove_file(dir.join(f)).expect("rm");
    }
    assert!(tailwarden_crds::load_file(&dir).expect("empty").is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
