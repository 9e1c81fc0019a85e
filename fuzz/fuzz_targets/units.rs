//! Fuzz target `units`: the unit strings of the API — durations (`1h30m`), decimals
//! (`"2.00"`) and byte sizes (`16Mi`) — parsed from arbitrary text.
//!
//! The input is the text (invalid UTF-8 is replaced). Asserted for every input, for each of
//! `DurationString`, `Decimal` and `ByteSize`:
//! - parsing returns a value or a `UnitError`; it never panics.
//! - The published schema pattern agrees with the parser: accepted text matches it, and text
//!   that matches it is accepted (or, for durations and byte sizes, rejected only as too
//!   large).
//! - Accepted text round-trips: the value keeps the text (`as_str`, `Display`), the text
//!   parses again to the same value, and JSON (serde) writes the text and reads it back.
//! - Durations: `format_duration` of the value parses back to the same value, as does
//!   `DurationString::from_duration`. Decimals: the value's own formatting parses back to
//!   the same value.

#![no_main]

use std::{fmt::Debug, str::FromStr, sync::LazyLock};

use libfuzzer_sys::fuzz_target;
use regex::Regex;
use serde::{Serialize, de::DeserializeOwned};
use tailwarden_crds::units::{
    BYTE_SIZE_PATTERN, ByteSize, DECIMAL_PATTERN, DURATION_PATTERN, Decimal, DurationString,
    UnitError, format_duration, parse_duration,
};

fn pattern(p: &str) -> Regex {
    Regex::new(p).expect("the published pattern compiles")
}

static DURATION: LazyLock<Regex> = LazyLock::new(|| pattern(DURATION_PATTERN));
static DECIMAL: LazyLock<Regex> = LazyLock::new(|| pattern(DECIMAL_PATTERN));
static BYTE_SIZE: LazyLock<Regex> = LazyLock::new(|| pattern(BYTE_SIZE_PATTERN));

/// Text round trips shared by the three types: `as_str`/`Display` keep the text, it parses
/// again to an equal value, and serde writes it as that JSON string and reads it back.
fn round_trip<T>(text: &str, value: &T, as_str: &str)
where
    T: FromStr<Err = UnitError> + PartialEq + Debug + Serialize + DeserializeOwned + ToString,
{
    assert_eq!(as_str, text, "the value keeps its text");
    assert_eq!(value.to_string(), text, "Display is the text");
    assert_eq!(text.parse::<T>().as_ref(), Ok(value), "parses again");
    let json = match serde_json::to_string(value) {
        Ok(json) => json,
        Err(e) => panic!("{value:?} does not serialise: {e}"),
    };
    assert_eq!(
        serde_json::from_str::<String>(&json).ok().as_deref(),
        Some(text),
        "serde writes the text"
    );
    match serde_json::from_str::<T>(&json) {
        Ok(back) => assert_eq!(&back, value, "serde round trip"),
        Err(e) => panic!("{json} does not deserialise: {e}"),
    }
}

fn durations(text: &str) {
    let parsed = parse_duration(text);
    let matches = DURATION.is_match(text);
    match &parsed {
        Ok(_) => assert!(matches, "{text:?} parses but the pattern rejects it"),
        Err(UnitError::DurationTooLarge(t)) => assert_eq!(t, text),
        Err(UnitError::Duration(t)) => {
            assert_eq!(t, text);
            assert!(!matches, "{text:?} matches the pattern but does not parse");
        }
        Err(other) => panic!("a duration error of the wrong kind: {other:?}"),
    }
    assert_eq!(
        DurationString::from_str(text).map(|d| d.get()),
        parsed,
        "DurationString and parse_duration agree"
    );
    let Ok(value) = parsed else {
        return;
    };
    let Ok(d) = DurationString::from_str(text) else {
        return;
    };
    round_trip(text, &d, d.as_str());
    let formatted = format_duration(value);
    assert_eq!(
        parse_duration(&formatted),
        Ok(value),
        "format_duration({value:?}) = {formatted:?} does not parse back"
    );
    assert!(DURATION.is_match(&formatted), "{formatted:?}");
    let from_value = DurationString::from_duration(value);
    assert_eq!(from_value.get(), value);
    assert_eq!(parse_duration(from_value.as_str()), Ok(value));
}

fn decimals(text: &str) {
    let matches = DECIMAL.is_match(text);
    match text.parse::<Decimal>() {
        Ok(d) => {
            assert!(matches, "{text:?} parses but the pattern rejects it");
            round_trip(text, &d, d.as_str());
            let own = d.get().to_string();
            match own.parse::<Decimal>() {
                Ok(again) => assert_eq!(again.get(), d.get(), "{own:?}"),
                Err(e) => panic!("the value of {text:?} formats as {own:?}, rejected: {e}"),
            }
        }
        Err(UnitError::Decimal(t)) => {
            assert_eq!(t, text);
            assert!(!matches, "{text:?} matches the pattern but does not parse");
        }
        Err(other) => panic!("a decimal error of the wrong kind: {other:?}"),
    }
}

fn byte_sizes(text: &str) {
    let matches = BYTE_SIZE.is_match(text);
    match text.parse::<ByteSize>() {
        Ok(b) => {
            assert!(matches, "{text:?} parses but the pattern rejects it");
            round_trip(text, &b, b.as_str());
        }
        Err(UnitError::ByteSizeTooLarge(t)) => {
            assert_eq!(t, text);
            assert!(matches, "{text:?} is too large but not a byte size");
        }
        Err(UnitError::ByteSize(t)) => {
            assert_eq!(t, text);
            assert!(!matches, "{text:?} matches the pattern but does not parse");
        }
        Err(other) => panic!("a byte size error of the wrong kind: {other:?}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    durations(&text);
    decimals(&text);
    byte_sizes(&text);
});
