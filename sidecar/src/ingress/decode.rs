//! Decoding a compressed request body (`Content-Encoding`) so the sidecar can read it,
//! with the body limit applied to the *decoded* bytes as they come out of the decoder: a
//! decompression bomb stops at `limit + 1` bytes and is a 413, and the output buffer never
//! grows past that. Which codings are accepted, and the errors, are
//! [`tailwarden_decide::encoding`]'s.
//!
//! The decoders' own memory is bounded too: gzip/deflate use a 32 KiB window, brotli at most
//! its format's 16 MiB, and zstd's window is capped at the limit's size, 8 MiB at least (a
//! frame asking for a larger one is a 400 instead of an allocation).

use std::io::Read;

use bytes::Bytes;
use tailwarden_decide::{
    encoding::{self, Coding},
    error::ApiError,
};

/// Bodies up to this size are decoded on the request's task; larger ones on tokio's
/// blocking pool, so a big body does not hold a runtime worker.
const INLINE_BYTES: usize = 16 * 1024;

/// The decoded body, at most `limit` bytes.
pub async fn decode(coding: Coding, body: Bytes, limit: u64) -> Result<Bytes, ApiError> {
    if body.len() <= INLINE_BYTES {
        return decode_blocking(coding, &body, limit);
    }
    tokio::task::spawn_blocking(move || decode_blocking(coding, &body, limit))
        .await
        .unwrap_or_else(|_| Err(ApiError::bad_request("The request body could not be read.")))
}

/// The decoding itself: synchronous, over the compressed bytes in hand.
pub fn decode_blocking(coding: Coding, body: &[u8], limit: u64) -> Result<Bytes, ApiError> {
    match coding {
        // Multi-member: a concatenation of gzip members is one valid gzip body.
        Coding::Gzip => capped(coding, flate2::read::MultiGzDecoder::new(body), limit),
        Coding::Deflate if encoding::is_zlib(body) => {
            capped(coding, flate2::read::ZlibDecoder::new(body), limit)
        }
        Coding::Deflate => capped(coding, flate2::read::DeflateDecoder::new(body), limit),
        Coding::Brotli => capped(coding, brotli::Decompressor::new(body, 16 * 1024), limit),
        Coding::Zstd => {
            let mut decoder = zstd::stream::read::Decoder::with_buffer(body)
                .map_err(|e| encoding::corrupt(coding, &e.to_string()))?;
            decoder
                .window_log_max(window_log(limit))
                .map_err(|e| encoding::corrupt(coding, &e.to_string()))?;
            capped(coding, decoder, limit)
        }
    }
}

/// zstd's largest window for a body of at most `limit` bytes: a window larger than the
/// whole body is never needed, and refusing it keeps a hostile frame from allocating it
/// (libzstd's own default allows 128 MiB). At least 8 MiB (log 23) all the same: a
/// streaming encoder that does not know the size picks its level's window (2 MiB at level
/// 3, 8 MiB at 19), larger than a small body needs.
fn window_log(limit: u64) -> u32 {
    (u64::BITS - limit.saturating_sub(1).leading_zeros()).clamp(23, 31)
}

/// Reads `reader` to its end, failing with a 413 as soon as it yields more than `limit`
/// bytes. The buffer grows by doubling but never past `limit + 1`.
fn capped(coding: Coding, mut reader: impl Read, limit: u64) -> Result<Bytes, ApiError> {
    let cap = usize::try_from(limit)
        .unwrap_or(usize::MAX)
        .saturating_add(1);
    let mut out: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = match reader.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(encoding::corrupt(coding, &e.to_string())),
        };
        let wanted = out.len().saturating_add(n);
        if wanted > cap.saturating_sub(1) {
            return Err(encoding::decoded_too_large(coding, limit));
        }
        if wanted > out.capacity() {
            let grown = out.capacity().saturating_mul(2).max(wanted).min(cap);
            out.reserve_exact(grown - out.len());
        }
        out.extend_from_slice(&chunk[..n]);
    }
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use http::StatusCode;

    use super::*;

    const JSON: &[u8] = br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}"#;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn encode(coding: Coding, data: &[u8]) -> Vec<u8> {
        match coding {
            Coding::Gzip => gzip(data),
            Coding::Deflate => {
                let mut e =
                    flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
                e.write_all(data).unwrap();
                e.finish().unwrap()
            }
            Coding::Brotli => {
                let mut out = Vec::new();
                let mut w = brotli::CompressorWriter::new(&mut out, 4096, 5, 22);
                w.write_all(data).unwrap();
                drop(w);
                out
            }
            Coding::Zstd => zstd::stream::encode_all(data, 3).unwrap(),
        }
    }

    #[test]
    fn every_coding_round_trips() {
        for coding in [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd] {
            let encoded = encode(coding, JSON);
            let decoded = decode_blocking(coding, &encoded, 1 << 20).unwrap();
            assert_eq!(&decoded[..], JSON, "{coding:?}");
        }
    }

    #[test]
    fn raw_deflate_is_accepted_as_deflate() {
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(JSON).unwrap();
        let raw = e.finish().unwrap();
        assert!(!encoding::is_zlib(&raw));
        assert_eq!(
            &decode_blocking(Coding::Deflate, &raw, 1 << 20).unwrap()[..],
            JSON
        );
    }

    #[test]
    fn exactly_the_limit_passes_one_more_byte_is_413() {
        let data = vec![b'a'; 4096];
        for coding in [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd] {
            let encoded = encode(coding, &data);
            assert_eq!(decode_blocking(coding, &encoded, 4096).unwrap().len(), 4096);
            let e = decode_blocking(coding, &encoded, 4095).unwrap_err();
            assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE, "{coding:?}");
        }
    }

    #[test]
    fn a_bomb_stops_at_the_limit() {
        // 16 MiB of zeros compress to ~16 KiB; against a 1 MiB limit the decoder stops
        // after about 1 MiB of output.
        let bomb = gzip(&vec![0u8; 16 << 20]);
        assert!(bomb.len() < 32 * 1024, "{}", bomb.len());
        let e = decode_blocking(Coding::Gzip, &bomb, 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
        assert!(e.message.contains("decoded from gzip"), "{}", e.message);
    }

    #[test]
    fn a_corrupt_stream_is_400_naming_the_coding() {
        for coding in [Coding::Gzip, Coding::Deflate, Coding::Brotli, Coding::Zstd] {
            let e = decode_blocking(coding, b"this is not compressed at all", 1 << 20).unwrap_err();
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{coding:?}");
            assert_eq!(e.code, Some("invalid_content_encoding"));
            assert!(e.message.contains(coding.name()), "{}", e.message);
        }
        // A truncated gzip body is corrupt too, not a shorter JSON.
        let encoded = gzip(JSON);
        let e = decode_blocking(Coding::Gzip, &encoded[..encoded.len() - 6], 1 << 20).unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
    }

    #[test]
    fn zstd_window_is_capped_by_the_limit() {
        assert_eq!(window_log(1), 23);
        assert_eq!(window_log(1 << 20), 23);
        assert_eq!(window_log(8 << 20), 23);
        assert_eq!(window_log((8 << 20) + 1), 24);
        assert_eq!(window_log(16 << 20), 24);
        assert_eq!(window_log(u64::MAX), 31);
    }

    #[test]
    fn a_zstd_frame_asking_for_a_larger_window_is_refused() {
        // A 32 MiB window (log 25) over a 16 MiB limit (log 24): refused, not allocated.
        let mut e = zstd::stream::write::Encoder::new(Vec::new(), 3).unwrap();
        e.set_parameter(zstd::stream::raw::CParameter::WindowLog(25))
            .unwrap();
        e.write_all(&vec![b'x'; 1 << 20]).unwrap();
        let frame = e.finish().unwrap();
        let err = decode_blocking(Coding::Zstd, &frame, 16 << 20).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST, "{}", err.message);
        // The same frame under a 64 MiB limit decodes.
        assert_eq!(
            decode_blocking(Coding::Zstd, &frame, 64 << 20)
                .unwrap()
                .len(),
            1 << 20
        );
    }
}
