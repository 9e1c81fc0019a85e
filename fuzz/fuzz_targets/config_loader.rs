//! Fuzz target `config_loader`: a config file of `InferenceRoute` YAML documents, as the
//! standalone sidecar reads it (`--config`) and as the operator's ConfigMap hands it over.
//!
//! The input is the file's text (invalid UTF-8 is replaced, as no reader of a text file can
//! produce it).
//!
//! Asserted for every input:
//! - `load_str` returns routes or a `LoadError::Invalid` with at least one `ConfigIssue`,
//!   each naming the file and a document; it never panics, and the error renders.
//! - Every accepted route passes the CRD's CEL rules (`crd::validate`) on its own, and what
//!   those rules promise holds: a fixed `hedging.delay` is a duration the sidecar can read.
//! - Every accepted route, rendered the way the operator renders it into the sidecar's
//!   ConfigMap (name, namespace and spec, as YAML), loads back to the same route.
//! - The sidecar's tier compilation (`TierSet::compile`) never panics on an accepted route.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tailwarden_crds::{InferenceRoute, LoadError, crd, load_str};
use tailwarden_decide::tiers::TierSet;

const FILE: &str = "fuzz.yaml";

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let routes = match load_str(FILE, &text) {
        Ok(routes) => routes,
        Err(e) => {
            assert!(matches!(e, LoadError::Invalid { .. }), "{e:?}");
            assert!(!e.issues().is_empty(), "a rejection names its problems");
            for issue in e.issues() {
                assert_eq!(issue.file, FILE);
                assert!(issue.document >= 1, "{issue:?}");
                assert!(!issue.message.is_empty(), "{issue:?}");
            }
            let _ = e.to_string();
            return;
        }
    };
    for route in &routes {
        if let Err(errors) = crd::validate(route) {
            panic!("an accepted route fails its CEL rules: {errors:?}");
        }
        let _ = TierSet::compile(&route.spec.tiers);
        let hedging = &route.spec.hedging;
        assert!(
            hedging.delay == "auto" || hedging.fixed_delay().is_some(),
            "hedging.delay {:?} was accepted but the sidecar cannot read it",
            hedging.delay
        );

        // What `tailwarden-operator` puts in the ConfigMap (operator/src/render.rs).
        let name = route.metadata.name.as_deref().unwrap_or_default();
        let mut rendered = InferenceRoute::new(name, route.spec.clone());
        rendered.metadata.namespace = route.metadata.namespace.clone();
        let yaml = match serde_norway::to_string(&rendered) {
            Ok(yaml) => yaml,
            Err(e) => panic!("an accepted route cannot be rendered: {e}"),
        };
        match load_str("rendered.yaml", &yaml) {
            Ok(back) => match back.as_slice() {
                [one] => {
                    assert_eq!(
                        one.spec, rendered.spec,
                        "the rendered spec reloads unchanged"
                    );
                    assert_eq!(one.metadata.name, rendered.metadata.name);
                    assert_eq!(one.metadata.namespace, rendered.metadata.namespace);
                }
                _ => panic!("the rendered route loads as {} routes\n{yaml}", back.len()),
            },
            Err(e) => panic!("the rendered route is rejected: {e}\n{yaml}"),
        }
    }
});
