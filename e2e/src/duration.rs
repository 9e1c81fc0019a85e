//! Human duration syntax shared by the command lines: `500ms`, `10s`, `2m`, `1h`, `1.5s`.
//!
//! Kept deliberately small (no `humantime` dependency): the tools only need a number and one
//! unit, and a bare number is rejected because `--duration 10` is ambiguous.

use std::time::Duration;

/// Why a duration string was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DurationError {
    /// Nothing was given.
    #[error("empty duration (expected e.g. 500ms, 10s, 2m)")]
    Empty,
    /// The number part did not parse or is negative / not finite.
    #[error(
        "invalid duration '{0}' (expected a number followed by ms, s, m or h, e.g. 500ms, 10s, 2m)"
    )]
    Invalid(String),
    /// The unit is missing or unknown.
    #[error("invalid duration '{0}': missing or unknown unit (use ms, s, m or h)")]
    Unit(String),
}

/// Parses `500ms`, `10s`, `2m`, `1h` (decimals allowed, e.g. `1.5s`).
pub fn parse_duration(input: &str) -> Result<Duration, DurationError> {
    let s = input.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .ok_or_else(|| DurationError::Unit(s.to_owned()))?;
    let (num, unit) = s.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| DurationError::Invalid(s.to_owned()))?;
    let secs = match unit.trim() {
        "ms" => value / 1000.0,
        "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(DurationError::Unit(s.to_owned())),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| DurationError::Invalid(s.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(parse_duration("10"), Err(DurationError::Unit(_))));
        assert!(matches!(parse_duration("10x"), Err(DurationError::Unit(_))));
        assert!(matches!(
            parse_duration("abc"),
            Err(DurationError::Invalid(_))
        ));
        assert!(matches!(
            parse_duration("1.2.3s"),
            Err(DurationError::Invalid(_))
        ));
    }
}
