//! tailwarden sidecar library: the data plane.
