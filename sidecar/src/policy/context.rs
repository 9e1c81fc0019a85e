//! The context budget of a request (`contextBudget`, per route, tier or tenant): runs
//! before the other policies, because what they see — the exact cache's key, the admission
//! token estimate — and what the providers receive is the trimmed body.
//!
//! The decision is [`tailwarden_decide::context`]; this module picks the budget that applies
//! (the tier's, else the route's; a tenant's `perTenant` entry overrides `maxTokens`), the
//! tokenizer for the model, and counts the outcome.

use bytes::Bytes;
use tailwarden_decide::{
    context::{self, Applied, ContextReport},
    error::ApiError,
    request::RequestBody,
};

use crate::app::Exchange;

/// Applies the request's context budget. `Ok(Some(body))` is the trimmed body to send in
/// place of the client's; `Ok(None)` leaves it as it is; `Err` is the 400 for a request
/// over its budget. Sets [`Exchange::context`].
pub fn apply(ex: &mut Exchange, body: &RequestBody<'_>) -> Result<Option<Bytes>, ApiError> {
    let route = ex.route.clone();
    let budgets = &route.context;
    if budgets.is_empty() || ex.endpoint != tailwarden_decide::request::Endpoint::ChatCompletions {
        return Ok(None);
    }
    let tenant = budgets
        .tenant_header()
        .and_then(|name| ex.headers.get(name))
        .and_then(|v| v.to_str().ok());
    let Some((budget, counter, field)) = budgets.resolve(ex.tier, tenant, ex.model(body)) else {
        return Ok(None);
    };
    let metrics = &ex.app.metrics;
    let count = |result: &str| {
        metrics
            .context_requests
            .with_label_values(&[&*route.name, result])
            .inc();
    };
    match context::apply(body, &budget, &counter, field) {
        Ok(Applied::Within { tokens }) => {
            count("within");
            ex.context = Some(ContextReport {
                tokens,
                trimmed: 0,
                dropped: 0,
                tokenizer: counter.label(),
            });
            Ok(None)
        }
        Ok(Applied::Trimmed {
            body,
            before,
            after,
            dropped,
        }) => {
            count("trimmed");
            metrics
                .context_trimmed_tokens
                .with_label_values(&[&*route.name])
                .inc_by(before - after);
            ex.context = Some(ContextReport {
                tokens: after,
                trimmed: before - after,
                dropped,
                tokenizer: counter.label(),
            });
            Ok(Some(Bytes::from(body)))
        }
        Err(error) => {
            count("rejected");
            Err(error)
        }
    }
}
