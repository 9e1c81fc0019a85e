//! Which `Content-Encoding` of a request body the sidecar can decode, and the errors it
//! answers otherwise.
//!
//! The sidecar must read a routed body (`model`, `stream`, the tiers' content rules), so a
//! compressed one is decoded first; the decoder itself is I/O-free but lives in the
//! sidecar (`ingress/decode.rs`) with its crates. What is decided here: the header's
//! meaning (RFC 9110 §8.4: a comma-separated list of codings in the order they were
//! applied, `identity` meaning none), a 415 naming what the sidecar cannot decode — never
//! the 400 "not valid UTF-8" a compressed body would otherwise earn — and a 400 naming the
//! coding when its stream is corrupt.

use http::{HeaderMap, StatusCode, header};

use crate::error::ApiError;

/// A content coding the sidecar decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    /// HTTP's `deflate` is the zlib format (RFC 1950); some clients send a raw deflate
    /// stream under that name, which the decoder also accepts ([`is_zlib`]).
    Deflate,
    Brotli,
    Zstd,
}

impl Coding {
    /// The coding's name as it appears in the header.
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
            Coding::Brotli => "br",
            Coding::Zstd => "zstd",
        }
    }

    fn from_token(token: &str) -> Option<Self> {
        match token {
            "gzip" | "x-gzip" => Some(Coding::Gzip),
            "deflate" => Some(Coding::Deflate),
            "br" => Some(Coding::Brotli),
            "zstd" => Some(Coding::Zstd),
            _ => None,
        }
    }
}

/// The coding the body must be decoded from: `None` when it is not encoded (no header,
/// empty, or only `identity`). One coding is decoded; a stack of two or more (`gzip, br`)
/// and any unknown coding is a 415 naming it.
pub fn request_coding(headers: &HeaderMap) -> Result<Option<Coding>, ApiError> {
    let mut found: Vec<String> = Vec::new();
    for value in headers.get_all(header::CONTENT_ENCODING) {
        let Ok(text) = value.to_str() else {
            return Err(unsupported(
                "The request's Content-Encoding header is not ASCII; the sidecar decodes gzip, deflate, br and zstd."
                    .to_string(),
            ));
        };
        for token in text.split(',') {
            let token = token.trim().to_ascii_lowercase();
            if token.is_empty() || token == "identity" {
                continue;
            }
            found.push(token);
        }
    }
    match found.as_slice() {
        [] => Ok(None),
        [one] => match Coding::from_token(one) {
            Some(coding) => Ok(Some(coding)),
            None => Err(unsupported(format!(
                "The request body's Content-Encoding `{}` is not supported; the sidecar decodes gzip, deflate, br and zstd.",
                printable(one)
            ))),
        },
        many => Err(unsupported(format!(
            "The request body's Content-Encoding `{}` applies more than one coding; the sidecar decodes one of gzip, deflate, br and zstd.",
            many.iter()
                .map(|t| printable(t))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// Whether a `deflate` body starts with a zlib header (RFC 1950: compression method 8,
/// the header's check bits a multiple of 31) rather than a raw deflate stream.
pub fn is_zlib(body: &[u8]) -> bool {
    match body {
        [cmf, flg, ..] => cmf & 0x0f == 8 && (u16::from(*cmf) << 8 | u16::from(*flg)) % 31 == 0,
        _ => false,
    }
}

/// The 400 for a body whose compressed stream cannot be decoded.
pub fn corrupt(coding: Coding, detail: &str) -> ApiError {
    let mut e = ApiError::bad_request(format!(
        "The request body is not valid {} data (Content-Encoding: {}): {detail}.",
        coding.name(),
        coding.name()
    ));
    e.code = Some("invalid_content_encoding");
    e
}

/// The 413 for a body whose decoded size passes the limit: the limit applies to what the
/// sidecar would hold, whatever the compressed size.
pub fn decoded_too_large(coding: Coding, limit: u64) -> ApiError {
    let mut e = ApiError::too_large(limit);
    e.message = format!(
        "The request body, decoded from {}, is larger than the route's limit of {limit} bytes (spec.limits.maxBodyBytes).",
        coding.name()
    );
    e
}

fn unsupported(message: String) -> ApiError {
    let mut e = ApiError::bad_request(message);
    e.status = StatusCode::UNSUPPORTED_MEDIA_TYPE;
    e.code = Some("unsupported_content_encoding");
    e
}

/// A client's token in a message: bounded, and only visible ASCII.
fn printable(token: &str) -> String {
    token
        .chars()
        .take(64)
        .map(|c| if c.is_ascii_graphic() { c } else { '?' })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append(header::CONTENT_ENCODING, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn no_header_or_identity_is_not_encoded() {
        assert_eq!(request_coding(&HeaderMap::new()), Ok(None));
        assert_eq!(request_coding(&headers(&["identity"])), Ok(None));
        assert_eq!(request_coding(&headers(&[""])), Ok(None));
        assert_eq!(request_coding(&headers(&[" , identity"])), Ok(None));
    }

    #[test]
    fn the_four_codings_case_insensitive() {
        assert_eq!(request_coding(&headers(&["gzip"])), Ok(Some(Coding::Gzip)));
        assert_eq!(
            request_coding(&headers(&["x-gzip"])),
            Ok(Some(Coding::Gzip))
        );
        assert_eq!(request_coding(&headers(&["GZip"])), Ok(Some(Coding::Gzip)));
        assert_eq!(
            request_coding(&headers(&["deflate"])),
            Ok(Some(Coding::Deflate))
        );
        assert_eq!(
            request_coding(&headers(&[" br "])),
            Ok(Some(Coding::Brotli))
        );
        assert_eq!(request_coding(&headers(&["zstd"])), Ok(Some(Coding::Zstd)));
        assert_eq!(
            request_coding(&headers(&["identity, zstd"])),
            Ok(Some(Coding::Zstd))
        );
    }

    #[test]
    fn unknown_coding_is_415_naming_it() {
        let e = request_coding(&headers(&["compress"])).unwrap_err();
        assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert_eq!(e.code, Some("unsupported_content_encoding"));
        assert_eq!(e.kind, "invalid_request_error");
        assert!(e.message.contains("`compress`"), "{}", e.message);
        assert!(!e.message.contains("UTF-8"));
    }

    #[test]
    fn stacked_codings_are_415_naming_them() {
        for h in [headers(&["gzip, br"]), headers(&["gzip", "br"])] {
            let e = request_coding(&h).unwrap_err();
            assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
            assert!(e.message.contains("`gzip, br`"), "{}", e.message);
        }
    }

    #[test]
    fn a_hostile_token_is_bounded_in_the_message() {
        let long = "a".repeat(500);
        let e = request_coding(&headers(&[&long])).unwrap_err();
        assert!(e.message.len() < 300, "{}", e.message);
        let bytes = HeaderValue::from_bytes(b"gz\xffip").unwrap();
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, bytes);
        assert_eq!(
            request_coding(&h).unwrap_err().status,
            StatusCode::UNSUPPORTED_MEDIA_TYPE
        );
    }

    #[test]
    fn zlib_header_detection() {
        // 0x78 0x9c: zlib, default compression.
        assert!(is_zlib(&[0x78, 0x9c, 0, 0]));
        assert!(is_zlib(&[0x78, 0x01]));
        assert!(is_zlib(&[0x78, 0xda]));
        // A raw deflate stream (a final stored block) is not.
        assert!(!is_zlib(&[0x01, 0x05, 0x00]));
        assert!(!is_zlib(&[0x78]));
        assert!(!is_zlib(&[]));
    }

    #[test]
    fn error_shapes() {
        let e = corrupt(Coding::Gzip, "invalid gzip header");
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("invalid_content_encoding"));
        assert!(e.message.contains("not valid gzip data"), "{}", e.message);
        let e = decoded_too_large(Coding::Brotli, 1024);
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(e.code, Some("request_too_large"));
        assert!(e.message.contains("decoded from br"), "{}", e.message);
        assert!(e.message.contains("1024"));
    }
}
