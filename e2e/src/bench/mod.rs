//! `tailwarden-bench`: open-loop load generator (placeholder while the simulator lands).
