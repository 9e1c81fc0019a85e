//! Test and measurement tools for tailwarden.
//!
//! * [`sim`] — `tailwarden-sim`, a fake OpenAI-compatible provider whose latency and faults
//!   follow a profile, so the sidecar can be tested against tails it cannot get on demand
//!   from a real provider.
//! * [`bench`] — `tailwarden-bench`, an open-loop load generator that reports latency, TTFT
//!   and inter-token percentiles measured from each request's *scheduled* start.
//! * [`demo`] — `tailwarden-demo` (`make demo`): the same load straight at a flaky simulated
//!   provider and through the real sidecar, side by side.
//! * [`benchmark`] — `tailwarden-benchmark` (`make bench`): the sidecar's overhead next to
//!   nginx, LiteLLM and Portkey, the tail-cut scenario and the battery; writes
//!   `docs/benchmarks.md`.
//! * [`oracle`] — the best latency and error rate any proxy could reach on a profile at a
//!   given amplification, evaluated on keyed fates (`sim::fate`); pure.
//! * [`battery`] — `tailwarden-battery`: direct / sidecar / limit on every profile ×
//!   topology × upstream stack (hyper and aiohttp), with the never-worse verdict per cell.
//! * [`vtime`] — the sidecar's own attempt policy (the decision crate's scheduler, balancer,
//!   breakers) run over a battery cell's keyed fates in virtual time: the battery's verdict
//!   without sockets, in milliseconds.
//! * [`controlplane`] — a real kube-apiserver, etcd, controller-manager, scheduler and kwok
//!   on loopback for the operator and end-to-end tests, or with a real node instead of kwok.
//! * [`node`] — running a test inside `e2e/controlplane/sandbox.sh` (namespaces of its own)
//!   for the real node, and checking from outside that it left the machine as it was.
//! * [`duration`] — the `10s` / `500ms` / `2m` duration syntax the command lines share.
//! * [`proc`], [`sidecar`], [`fetch`], [`machine`] — child processes (process groups, RSS),
//!   the sidecar binary, a blocking control-plane HTTP client, and the machine description
//!   printed with every table.
//!
//! The binaries in `src/bin` are thin wrappers; everything is a library so tests and the
//! demo can run the tools in-process.

pub mod battery;
pub mod bench;
pub mod benchmark;
pub mod controlplane;
pub mod demo;
pub mod duration;
pub mod fetch;
pub mod machine;
pub mod node;
pub mod oracle;
pub mod proc;
pub mod sidecar;
pub mod sim;
pub mod vtime;
