//! Provider capability maps: which request parameters a provider's models do not support,
//! and whether such requests are sent without them (`drop`) or not sent there (`reject`).
//!
//! Self-hosted servers and some providers answer a request with an unknown parameter
//! (`response_format`, `tools`, `logprobs`, …) with a 400 — or worse, ignore it silently.
//! The route says per provider (and per provider model) what to do, and the decision is a
//! pure function of the provider model and the request's top-level member names, taken per
//! attempt because it depends on the provider chosen.
//!
//! A member whose value is `null` counts as absent: dropping it is always safe and a client
//! that sends `"tools": null` is not asking for tools.

use serde_json::value::RawValue;
use tailwarden_crds::{CapabilityRule, OnUnsupported};

use crate::error::ApiError;

/// A provider's capability rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapabilityMap {
    rules: Vec<Rule>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// Empty: every model.
    models: Vec<String>,
    unsupported: Vec<String>,
    reject: bool,
}

/// What to do with a request for one provider model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Send it as it is.
    Keep,
    /// Send it without these top-level members (in request order).
    Drop(Vec<String>),
    /// Do not send it to this provider: it uses these parameters, which the provider's
    /// rules reject. The message is for logs and, if no provider is left, the client.
    Reject {
        params: Vec<String>,
        message: String,
    },
}

impl CapabilityMap {
    pub fn new(rules: &[CapabilityRule]) -> Self {
        Self {
            rules: rules
                .iter()
                .map(|r| Rule {
                    models: r.models.clone(),
                    unsupported: r.unsupported.clone(),
                    reject: r.on_unsupported == OnUnsupported::Reject,
                })
                .collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether `param` may be sent to `provider_model`: no rule lists it as unsupported.
    /// For parameters the sidecar itself adds (`stream_options` for stream usage).
    pub fn supports(&self, provider_model: &str, param: &str) -> bool {
        !self.rules.iter().any(|r| {
            (r.models.is_empty() || r.models.iter().any(|m| m == provider_model))
                && r.unsupported.iter().any(|u| u == param)
        })
    }

    /// The decision for a request to `provider_model` (after `modelMap`) of provider
    /// `provider`, given the request's top-level members. Every rule whose `models` include
    /// the model applies; any rejected parameter that is present (and not `null`) rejects.
    pub fn check<'m>(
        &self,
        provider: &str,
        provider_model: &str,
        members: impl IntoIterator<Item = (&'m str, &'m RawValue)>,
    ) -> Decision {
        if self.rules.is_empty() {
            return Decision::Keep;
        }
        let applicable: Vec<&Rule> = self
            .rules
            .iter()
            .filter(|r| r.models.is_empty() || r.models.iter().any(|m| m == provider_model))
            .collect();
        if applicable.is_empty() {
            return Decision::Keep;
        }
        let mut drop = Vec::new();
        let mut rejected = Vec::new();
        for (name, value) in members {
            let hits: Vec<&&Rule> = applicable
                .iter()
                .filter(|r| r.unsupported.iter().any(|u| u == name))
                .collect();
            if hits.is_empty() {
                continue;
            }
            let is_null = value.get().trim() == "null";
            if !is_null && hits.iter().any(|r| r.reject) {
                rejected.push(name.to_owned());
            } else {
                drop.push(name.to_owned());
            }
        }
        if !rejected.is_empty() {
            let message = format!(
                "Provider {provider} (model {provider_model}) does not support {}; the route rejects such requests for it (spec.providers[].capabilities).",
                param_list(&rejected)
            );
            return Decision::Reject {
                params: rejected,
                message,
            };
        }
        if drop.is_empty() {
            Decision::Keep
        } else {
            Decision::Drop(drop)
        }
    }
}

/// "the parameter `tools`" / "the parameters `tools`, `tool_choice`".
fn param_list(params: &[String]) -> String {
    let quoted: Vec<String> = params.iter().map(|p| format!("`{p}`")).collect();
    if quoted.len() == 1 {
        format!("the parameter {}", quoted[0])
    } else {
        format!("the parameters {}", quoted.join(", "))
    }
}

/// The 400 for a request no provider of the route can take because of its parameters.
/// `reasons` are the [`Decision::Reject`] messages of the providers that refused it.
pub fn no_provider_supports(route: &str, params: &[String], reasons: &[String]) -> ApiError {
    let mut message = format!(
        "No provider of route {route} supports {} (spec.providers[].capabilities). Remove {} from the request.",
        param_list(params),
        if params.len() == 1 { "it" } else { "them" }
    );
    for r in reasons {
        message.push(' ');
        message.push_str(r);
    }
    let mut e = ApiError::bad_request(message);
    e.code = Some("unsupported_parameter");
    e
}

#[cfg(test)]
mod supports_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_parameter_listed_for_the_model_is_not_supported() {
        let rules: Vec<CapabilityRule> = serde_json::from_value(serde_json::json!([
            {"models": ["small"], "unsupported": ["stream_options"]},
            {"unsupported": ["logprobs"], "onUnsupported": "reject"}
        ]))
        .unwrap();
        let map = CapabilityMap::new(&rules);
        assert!(!map.supports("small", "stream_options"));
        assert!(map.supports("large", "stream_options"));
        assert!(!map.supports("large", "logprobs"));
        assert!(CapabilityMap::default().supports("any", "stream_options"));
    }
}
