//! The rest of `/v1`: which requests the sidecar passes through to a provider untouched,
//! where each goes, and which may be retried.
//!
//! The client only ever chooses the path after `/v1` (appended to the provider's configured
//! base URL, on the provider's host): [`check_path`] refuses paths that could climb out of
//! that base (`..`, encoded slashes or dots, backslashes, empty segments).
//!
//! Where a request goes ([`classify`]):
//! - `GET /v1/models/{id}` is answered by the sidecar for the models its routes list.
//! - `/v1/responses/{id}…` and `/v1/conversations/{id}…` go to the provider that created the
//!   object, when the sidecar knows it ([`Kind::Owned`]).
//! - The stateless families (`audio`, `images`, `moderations`) with a JSON body go by the
//!   body's `model`, like chat, and may fail over between the route's providers.
//! - Everything else — files, uploads, batches, vector stores, fine-tuning, containers,
//!   anything OpenAI adds, and multipart bodies — goes to the *home provider* (see
//!   [`Kind::Home`]): these objects live on one account and refer to each other (a batch
//!   names a file), so they must all land on the same one, whatever their body says.

use http::Method;

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadPath(pub &'static str);

/// Refuses a path (the part after `/v1`, starting with `/`) that could reach anything but
/// the provider's own `/v1` tree.
pub fn check_path(rest: &str) -> Result<(), BadPath> {
    if !rest.starts_with('/') || rest.len() < 2 {
        return Err(BadPath("the path must name an endpoint below /v1/"));
    }
    if rest.contains('\\') {
        return Err(BadPath("the path contains a backslash"));
    }
    let lower = rest.to_ascii_lowercase();
    if ["%2e", "%2f", "%5c", "%00"]
        .iter()
        .any(|p| lower.contains(p))
    {
        return Err(BadPath(
            "the path contains an encoded dot, slash, backslash or NUL",
        ));
    }
    for segment in rest[1..].split('/') {
        match segment {
            "" => return Err(BadPath("the path contains an empty segment")),
            "." | ".." => return Err(BadPath("the path contains a dot segment")),
            _ => {}
        }
    }
    Ok(())
}

/// What a pass-through request is, for routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind<'a> {
    /// `GET /v1/models/{id}`: the sidecar answers for the models its routes serve.
    Model(&'a str),
    /// A Responses object or a conversation (`/v1/responses/{id}`, `…/cancel`,
    /// `…/input_items`, `/v1/conversations/{id}…`): to the provider that created it.
    Owned {
        id: &'a str,
        /// `DELETE` of the object itself: on success the sidecar forgets the id.
        deletes: bool,
    },
    /// A stateless family (`audio`, `images`, `moderations`): by the JSON body's `model`.
    ByModel,
    /// Everything else: the home provider.
    Home,
}

/// How a pass-through request is routed. `rest` is the path after `/v1`.
pub fn classify<'a>(method: &Method, rest: &'a str) -> Kind<'a> {
    let mut segments = rest.trim_start_matches('/').split('/');
    let family = segments.next().unwrap_or("");
    let id = segments.next();
    let sub = segments.next();
    match (family, id) {
        ("models", Some(id)) if *method == Method::GET && sub.is_none() => Kind::Model(id),
        ("responses" | "conversations", Some(id)) if !id.is_empty() => Kind::Owned {
            id,
            deletes: *method == Method::DELETE && sub.is_none(),
        },
        ("audio" | "images" | "moderations", _) => Kind::ByModel,
        _ => Kind::Home,
    }
}

/// The endpoint family, a bounded label for metrics and logs: the first path segment when
/// it is one OpenAI documents, else `other`.
pub fn family(rest: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "audio",
        "images",
        "moderations",
        "files",
        "uploads",
        "batches",
        "vector_stores",
        "fine_tuning",
        "models",
        "responses",
        "conversations",
        "chat",
        "containers",
        "evals",
        "assistants",
        "threads",
        "realtime",
        "videos",
        "organization",
    ];
    let first = rest.trim_start_matches('/').split('/').next().unwrap_or("");
    KNOWN
        .iter()
        .find(|k| **k == first)
        .copied()
        .unwrap_or("other")
}

/// Whether a request may be sent again after a failure that may have reached the
/// provider (a reset, a 502/503/504): only idempotent methods. A request that failed to
/// connect may be resent whenever its body is still in hand.
pub fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::DELETE | Method::PUT
    )
}

/// Percent-decoding of one path segment (the SDKs encode ids: `ft%3Agpt-4o`). Invalid
/// escapes are kept as they are.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(h) = bytes.get(i + 1..i + 3)
            && let Ok(h) = std::str::from_utf8(h)
            && let Ok(b) = u8::from_str_radix(h, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_cannot_leave_the_providers_tree() {
        for ok in [
            "/files",
            "/files/file-abc/content",
            "/models/ft:gpt-4o:org:x",
        ] {
            assert_eq!(check_path(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "/",
            "files",
            "/files/../admin",
            "/./files",
            "/files/%2e%2e/x",
            "/files/%2E%2e",
            "/files%2fx",
            "/a\\b",
            "/files//x",
            "/files/",
            "/x%00",
        ] {
            assert!(check_path(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn routing_kinds() {
        assert_eq!(classify(&Method::GET, "/models/m1"), Kind::Model("m1"));
        assert_eq!(classify(&Method::DELETE, "/models/ft:x"), Kind::Home);
        assert_eq!(
            classify(&Method::GET, "/responses/resp_1"),
            Kind::Owned {
                id: "resp_1",
                deletes: false
            }
        );
        assert_eq!(
            classify(&Method::DELETE, "/responses/resp_1"),
            Kind::Owned {
                id: "resp_1",
                deletes: true
            }
        );
        assert_eq!(
            classify(&Method::POST, "/responses/resp_1/cancel"),
            Kind::Owned {
                id: "resp_1",
                deletes: false
            }
        );
        assert_eq!(
            classify(&Method::GET, "/responses/resp_1/input_items"),
            Kind::Owned {
                id: "resp_1",
                deletes: false
            }
        );
        assert_eq!(
            classify(&Method::DELETE, "/conversations/conv_1/items/msg_1"),
            Kind::Owned {
                id: "conv_1",
                deletes: false
            }
        );
        assert_eq!(classify(&Method::POST, "/conversations"), Kind::Home);
        assert_eq!(classify(&Method::POST, "/moderations"), Kind::ByModel);
        assert_eq!(
            classify(&Method::POST, "/audio/transcriptions"),
            Kind::ByModel
        );
        assert_eq!(
            classify(&Method::POST, "/images/generations"),
            Kind::ByModel
        );
        assert_eq!(classify(&Method::POST, "/files"), Kind::Home);
        assert_eq!(classify(&Method::POST, "/batches"), Kind::Home);
        assert_eq!(classify(&Method::POST, "/fine_tuning/jobs"), Kind::Home);
        assert_eq!(classify(&Method::GET, "/something_new"), Kind::Home);
    }

    #[test]
    fn ids_are_decoded() {
        assert_eq!(percent_decode("ft%3Agpt-4o%3Aorg"), "ft:gpt-4o:org");
        assert_eq!(percent_decode("resp_1"), "resp_1");
        assert_eq!(percent_decode("bad%zz%4"), "bad%zz%4");
        assert_eq!(percent_decode("%ff"), "%ff", "not UTF-8: kept as sent");
    }

    #[test]
    fn families_are_bounded() {
        assert_eq!(family("/files/file-1/content"), "files");
        assert_eq!(family("/audio/speech"), "audio");
        assert_eq!(family("/made_up_123"), "other");
    }

    #[test]
    fn only_idempotent_methods_are_resent() {
        assert!(idempotent(&Method::GET) && idempotent(&Method::DELETE));
        assert!(!idempotent(&Method::POST) && !idempotent(&Method::PATCH));
    }
}
