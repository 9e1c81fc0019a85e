//! Test and measurement tools for tailwarden: provider simulator and load generator.
