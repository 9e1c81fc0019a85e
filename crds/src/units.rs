//! Value types with a string form in the API: durations (`800ms`, `2s`, `5m`), non-negative
//! decimals for money and percentages (`"2.00"`, `"99.9"`) and byte sizes (`16Mi`).
//!
//! Each type keeps the text the user wrote (so a round trip through the API server and back
//! is byte-identical) next to its parsed value, and publishes a JSON schema whose `pattern`
//! accepts exactly what the Rust parser accepts. Durations follow Go's syntax because the
//! API server's CEL `duration()` parses them, and the CRD's cross-field rules compare them.

use std::{borrow::Cow, fmt, str::FromStr, time::Duration};

use rust_decimal::Decimal as RustDecimal;
use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Regular expression (RE2 and Rust `regex` compatible) for [`DurationString`].
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$";
/// Regular expression for [`Decimal`].
pub const DECIMAL_PATTERN: &str = r"^[0-9]{1,12}(\.[0-9]{1,12})?$";
/// Regular expression for [`ByteSize`].
pub const BYTE_SIZE_PATTERN: &str = r"^[0-9]{1,15}(Ki|Mi|Gi|k|M|G)?$";

/// Why a unit string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error(
        "invalid duration {0:?}: expected a number and a unit (ns, us, ms, s, m, h), such as \"800ms\", \"2s\" or \"1m30s\""
    )]
    Duration(String),
    #[error("duration {0:?} is too large (the maximum is about 292 years)")]
    DurationTooLarge(String),
    #[error(
        "invalid decimal {0:?}: expected a non-negative decimal string such as \"2.00\" (at most 12 digits before and after the point)"
    )]
    Decimal(String),
    #[error(
        "invalid byte size {0:?}: expected digits with an optional suffix Ki, Mi, Gi, k, M or G, such as \"16Mi\""
    )]
    ByteSize(String),
    #[error("byte size {0:?} is too large")]
    ByteSizeTooLarge(String),
}

/// Parses a Go-style duration (`300ms`, `1.5s`, `2h45m`). Negative durations and a bare `0`
/// are rejected: the CRD pattern does not admit them, so the standalone sidecar must not either.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    let bad = || UnitError::Duration(text.to_owned());
    let bytes = text.as_bytes();
    if bytes.is_empty() {
        return Err(bad());
    }
    // Go's limit (i64 nanoseconds) is the CEL limit; stay inside it so both sides agree.
    const MAX_NANOS: u128 = i64::MAX as u128;
    let mut total: u128 = 0;
    let mut i = 0;
    while i < bytes.len() {
        let int_start = i;
        while i < bytes.len() && bytes[i].is_ascii_digit() {
            i += 1;
        }
        if i == int_start {
            return Err(bad());
        }
        let int_digits = &text[int_start..i];
        let mut frac_digits = "";
        if i < bytes.len() && bytes[i] == b'.' {
            i += 1;
            let frac_start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            if i == frac_start {
                return Err(bad());
            }
            frac_digits = &text[frac_start..i];
        }
        let unit_start = i;
        while i < bytes.len() && bytes[i].is_ascii_alphabetic() {
            i += 1;
        }
        let unit_nanos: u128 = match &text[unit_start..i] {
            "ns" => 1,
            "us" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            _ => return Err(bad()),
        };
        let too_large = || UnitError::DurationTooLarge(text.to_owned());
        // 20 digits already exceed i64 nanoseconds in any unit.
        if int_digits.len() > 20 {
            return Err(too_large());
        }
        let int: u128 = int_digits.parse().map_err(|_| bad())?;
        let mut nanos = int.checked_mul(unit_nanos).ok_or_else(too_large)?;
        // Fractions are truncated to whole nanoseconds, as Go does.
        let mut scale = unit_nanos;
        for d in frac_digits.bytes().take(30) {
            scale /= 10;
            if scale == 0 {
                break;
            }
            nanos += u128::from(d - b'0') * scale;
        }
        total = total.checked_add(nanos).ok_or_else(too_large)?;
        if total > MAX_NANOS {
            return Err(too_large());
        }
    }
    let secs = (total / 1_000_000_000) as u64;
    let sub = (total % 1_000_000_000) as u32;
    Ok(Duration::new(secs, sub))
}

/// Formats a duration in the shortest exact unit, for messages and rendered config.
pub fn format_duration(d: Duration) -> String {
    let nanos = d.as_nanos();
    for (unit, size) in [
        ("h", 3_600_000_000_000u128),
        ("m", 60_000_000_000),
        ("s", 1_000_000_000),
        ("ms", 1_000_000),
        ("us", 1_000),
    ] {
        if nanos != 0 && nanos.is_multiple_of(size) {
            return format!("{}{unit}", nanos / size);
        }
    }
    format!("{nanos}ns")
}

fn string_schema(pattern: &str, max_length: u32) -> Schema {
    json_schema!({
        "type": "string",
        "pattern": pattern,
        "maxLength": max_length,
    })
}

/// A duration written as a string (`800ms`, `2s`, `5m`, `1h30m`).
#[derive(Clone, PartialEq, Eq)]
pub struct DurationString {
    text: String,
    value: Duration,
}

impl DurationString {
    /// The parsed value.
    pub fn get(&self) -> Duration {
        self.value
    }

    /// The text as the user wrote it.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// A duration from a value (formatted in its shortest exact unit).
    pub fn from_duration(value: Duration) -> Self {
        Self {
            text: format_duration(value),
            value,
        }
    }

    /// Used for compile-time-known defaults; the text is checked by the unit tests.
    pub(crate) fn lit(text: &str) -> Self {
        match text.parse() {
            Ok(d) => d,
            Err(_) => Self::from_duration(Duration::ZERO),
        }
    }
}

impl FromStr for DurationString {
    type Err = UnitError;
    fn from_str(text: &str) -> Result<Self, UnitError> {
        Ok(Self {
            value: parse_duration(text)?,
            text: text.to_owned(),
        })
    }
}

impl fmt::Debug for DurationString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

impl fmt::Display for DurationString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A non-negative decimal written as a string: prices (`"2.00"` per million tokens) and
/// percentages (`"99.9"`). Never a float, so money adds up exactly.
#[derive(Clone, PartialEq, Eq)]
pub struct Decimal {
    text: String,
    value: RustDecimal,
}

impl Decimal {
    /// The parsed value.
    pub fn get(&self) -> RustDecimal {
        self.value
    }

    /// The text as the user wrote it.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl FromStr for Decimal {
    type Err = UnitError;
    fn from_str(text: &str) -> Result<Self, UnitError> {
        let bad = || UnitError::Decimal(text.to_owned());
        let (int, frac) = match text.split_once('.') {
            Some((int, frac)) => (int, Some(frac)),
            None => (text, None),
        };
        let digits_ok = |s: &str, max: usize| {
            !s.is_empty() && s.len() <= max && s.bytes().all(|b| b.is_ascii_digit())
        };
        if !digits_ok(int, 12) || frac.is_some_and(|f| !digits_ok(f, 12)) {
            return Err(bad());
        }
        let value = RustDecimal::from_str_exact(text).map_err(|_| bad())?;
        Ok(Self {
            text: text.to_owned(),
            value,
        })
    }
}

impl fmt::Debug for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// A size in bytes written as a Kubernetes-style quantity string (`16Mi`, `512Ki`, `"1048576"`).
#[derive(Clone, PartialEq, Eq)]
pub struct ByteSize {
    text: String,
    value: u64,
}

impl ByteSize {
    /// The number of bytes.
    pub fn get(&self) -> u64 {
        self.value
    }

    /// The text as the user wrote it.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    pub(crate) fn lit(text: &str) -> Self {
        match text.parse() {
            Ok(b) => b,
            Err(_) => Self {
                text: "0".into(),
                value: 0,
            },
        }
    }
}

impl FromStr for ByteSize {
    type Err = UnitError;
    fn from_str(text: &str) -> Result<Self, UnitError> {
        let bad = || UnitError::ByteSize(text.to_owned());
        let digits_end = text
            .bytes()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(text.len());
        let (digits, suffix) = text.split_at(digits_end);
        if digits.is_empty() || digits.len() > 15 {
            return Err(bad());
        }
        let multiplier: u64 = match suffix {
            "" => 1,
            "k" => 1_000,
            "M" => 1_000_000,
            "G" => 1_000_000_000,
            "Ki" => 1 << 10,
            "Mi" => 1 << 20,
            "Gi" => 1 << 30,
            _ => return Err(bad()),
        };
        let number: u64 = digits.parse().map_err(|_| bad())?;
        let value = number
            .checked_mul(multiplier)
            .ok_or_else(|| UnitError::ByteSizeTooLarge(text.to_owned()))?;
        Ok(Self {
            text: text.to_owned(),
            value,
        })
    }
}

impl fmt::Debug for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.text)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

macro_rules! string_unit {
    ($ty:ident, $name:literal, $pattern:expr, $max:expr, $expecting:literal) => {
        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.text)
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Visit;
                impl de::Visitor<'_> for Visit {
                    type Value = $ty;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str($expecting)
                    }
                    fn visit_str<E: de::Error>(self, v: &str) -> Result<$ty, E> {
                        v.parse().map_err(E::custom)
                    }
                }
                d.deserialize_str(Visit)
            }
        }

        impl JsonSchema for $ty {
            fn schema_name() -> Cow<'static, str> {
                Cow::Borrowed($name)
            }
            fn inline_schema() -> bool {
                true
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                string_schema($pattern, $max)
            }
        }
    };
}

string_unit!(
    DurationString,
    "Duration",
    DURATION_PATTERN,
    32,
    "a duration string such as \"800ms\" or \"2s\""
);
string_unit!(
    Decimal,
    "Decimal",
    DECIMAL_PATTERN,
    25,
    "a decimal string such as \"2.00\""
);
string_unit!(
    ByteSize,
    "ByteSize",
    BYTE_SIZE_PATTERN,
    17,
    "a byte size string such as \"16Mi\""
);

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn durations_parse_like_go() {
        let cases = [
            ("800ms", ms(800)),
            ("2s", ms(2000)),
            ("5m", ms(300_000)),
            ("1h30m", ms(5_400_000)),
            ("1.5s", ms(1500)),
            ("0.25ms", Duration::from_micros(250)),
            ("10us", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            ("0s", Duration::ZERO),
            ("1m0.5s", ms(60_500)),
        ];
        for (text, want) in cases {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn durations_reject_garbage() {
        for text in [
            "", "0", "5", "ms", "-1s", "1.s", ".5s", "1 s", "1d", "1S", "1sec", "2s ", "1e3ms",
            "1,5s",
        ] {
            assert_eq!(
                parse_duration(text),
                Err(UnitError::Duration(text.into())),
                "{text:?} should be rejected"
            );
        }
        assert!(matches!(
            parse_duration("9999999999h"),
            Err(UnitError::DurationTooLarge(_))
        ));
        assert!(matches!(
            parse_duration("99999999999999999999999999h"),
            Err(UnitError::DurationTooLarge(_))
        ));
    }

    #[test]
    fn duration_pattern_matches_the_parser() {
        // A tiny hand check instead of a regex dependency: every accepted example fits the
        // pattern's shape (digits, optional fraction, unit) and none of the rejects parse.
        for text in ["800ms", "1h30m", "1.5s"] {
            assert!(parse_duration(text).is_ok());
        }
        assert!(DURATION_PATTERN.contains("ns|us|ms|s|m|h"));
    }

    #[test]
    fn durations_format_in_shortest_exact_unit() {
        assert_eq!(format_duration(ms(800)), "800ms");
        assert_eq!(format_duration(ms(120_000)), "2m");
        assert_eq!(format_duration(ms(1500)), "1500ms");
        assert_eq!(format_duration(Duration::ZERO), "0ns");
        let d: DurationString = "1h30m".parse().unwrap();
        assert_eq!(d.as_str(), "1h30m");
        assert_eq!(DurationString::from_duration(d.get()).as_str(), "90m");
    }

    #[test]
    fn decimals_are_exact() {
        let d: Decimal = "2.00".parse().unwrap();
        assert_eq!(d.get(), RustDecimal::new(200, 2));
        assert_eq!(d.as_str(), "2.00");
        let d: Decimal = "0.000001".parse().unwrap();
        assert_eq!(d.get() * RustDecimal::from(1_000_000), RustDecimal::ONE);
        for text in [
            "",
            "-1",
            "1.",
            ".5",
            "1e3",
            "abc",
            "1.2.3",
            "1234567890123",
            " 1",
        ] {
            assert_eq!(
                text.parse::<Decimal>(),
                Err(UnitError::Decimal(text.into())),
                "{text:?}"
            );
        }
    }

    #[test]
    fn byte_sizes() {
        let cases = [
            ("16Mi", 16 << 20),
            ("512Ki", 512 << 10),
            ("1048576", 1_048_576),
            ("2G", 2_000_000_000),
            ("1k", 1000),
        ];
        for (text, want) in cases {
            assert_eq!(
                text.parse::<ByteSize>().map(|b| b.get()),
                Ok(want),
                "{text}"
            );
        }
        for text in ["", "Mi", "16mi", "16MB", "-1", "1.5Mi", "16 Mi"] {
            assert_eq!(
                text.parse::<ByteSize>(),
                Err(UnitError::ByteSize(text.into())),
                "{text:?}"
            );
        }
        assert!(matches!(
            "999999999999999Gi".parse::<ByteSize>(),
            Err(UnitError::ByteSizeTooLarge(_))
        ));
    }

    #[test]
    fn serde_round_trip_keeps_text() {
        let d: DurationString = serde_json::from_str("\"1h30m\"").unwrap();
        assert_eq!(serde_json::to_string(&d).unwrap(), "\"1h30m\"");
        let err = serde_json::from_str::<DurationString>("\"soon\"").unwrap_err();
        assert!(
            err.to_string().contains("invalid duration \"soon\""),
            "{err}"
        );
        let err = serde_json::from_str::<DurationString>("5").unwrap_err();
        assert!(err.to_string().contains("a duration string"), "{err}");
    }

    #[test]
    fn literal_defaults_parse() {
        assert_eq!(DurationString::lit("30s").get(), ms(30_000));
        assert_eq!(ByteSize::lit("16Mi").get(), 16 << 20);
    }
}
