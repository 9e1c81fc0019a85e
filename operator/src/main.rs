//! `tailwarden-operator`: the control plane binary.
//!
//! `tailwarden-operator crd` prints the InferenceRoute CRD, generated from the Rust types.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tailwarden-operator",
    version,
    about = "The tailwarden control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the InferenceRoute CustomResourceDefinition as YAML.
    Crd,
    /// Print the Markdown field reference generated from the same schema.
    Reference,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crd => print!("{}", tailwarden_crds::crd::crd_yaml()?),
        Command::Reference => print!("{}", tailwarden_crds::crd::reference_markdown()?),
    }
    Ok(())
}
