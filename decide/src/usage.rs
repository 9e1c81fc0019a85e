//! Token usage and cost: what a response used, read from the provider's body, and what it
//! cost at the provider model's prices.

use rust_decimal::Decimal;

/// Token counts of one response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub input: u64,
    pub cached_input: u64,
    pub output: u64,
    pub reasoning: u64,
    /// True when the provider reported no usage and these are estimates.
    pub estimated: bool,
}

/// Prices per million tokens for the provider model that served the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Price {
    pub input: Decimal,
    pub cached_input: Decimal,
    pub output: Decimal,
}

impl Price {
    /// Cost in currency units; exact decimal arithmetic, no floats.
    pub fn cost(&self, usage: &Usage) -> Decimal {
        let uncached = usage.input.saturating_sub(usage.cached_input);
        let per_m = Decimal::from(1_000_000u32);
        (Decimal::from(uncached) * self.input
            + Decimal::from(usage.cached_input) * self.cached_input
            + Decimal::from(usage.output) * self.output)
            / per_m
    }
}

/// Usage of a non-stream response body (`usage.prompt_tokens`, …, or the Responses API's
/// `usage.input_tokens`, …), if it reports one.
pub fn parse_usage(body: &[u8]) -> Option<Usage> {
    #[derive(serde::Deserialize)]
    struct Body {
        usage: Option<RawUsage>,
    }
    #[derive(serde::Deserialize)]
    // The Responses API names the same counts `input_tokens`, `output_tokens`, ….
    struct RawUsage {
        #[serde(alias = "input_tokens")]
        prompt_tokens: Option<u64>,
        #[serde(alias = "output_tokens")]
        completion_tokens: Option<u64>,
        #[serde(alias = "input_tokens_details")]
        prompt_tokens_details: Option<PromptDetails>,
        #[serde(alias = "output_tokens_details")]
        completion_tokens_details: Option<CompletionDetails>,
    }
    #[derive(serde::Deserialize)]
    struct PromptDetails {
        cached_tokens: Option<u64>,
    }
    #[derive(serde::Deserialize)]
    struct CompletionDetails {
        reasoning_tokens: Option<u64>,
    }
    let parsed: Body = serde_json::from_slice(body).ok()?;
    let u = parsed.usage?;
    Some(Usage {
        input: u.prompt_tokens.unwrap_or(0),
        cached_input: u
            .prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0),
        output: u.completion_tokens.unwrap_or(0),
        reasoning: u
            .completion_tokens_details
            .and_then(|d| d.reasoning_tokens)
            .unwrap_or(0),
        estimated: false,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cost_is_exact_decimal() {
        let price = Price {
            input: "2.00".parse().unwrap(),
            cached_input: "0.50".parse().unwrap(),
            output: "8.00".parse().unwrap(),
        };
        let usage = Usage {
            input: 1_500,
            cached_input: 500,
            output: 250,
            reasoning: 0,
            estimated: false,
        };
        // 1000 × 2 + 500 × 0.5 + 250 × 8 = 4250 per million.
        assert_eq!(price.cost(&usage), "0.00425".parse::<Decimal>().unwrap());
    }

    #[test]
    fn responses_usage_names() {
        let u = parse_usage(br#"{"id":"resp_1","usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":3},"output_tokens":4,"output_tokens_details":{"reasoning_tokens":2},"total_tokens":14}}"#).unwrap();
        assert_eq!(
            (u.input, u.cached_input, u.output, u.reasoning),
            (10, 3, 4, 2)
        );
    }
}
