//! `glmcheck completions`: a shell completion script for the whole command line.

use super::Outcome;

/// Print a shell completion script.
#[derive(clap::Args, Debug)]
#[command(after_help = "Example:
  glmcheck completions zsh > ~/.zfunc/_glmcheck")]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// Writes the script for `cli` (the binary's whole command) to stdout.
pub fn run(a: &CompletionsArgs, mut cli: clap::Command) -> anyhow::Result<Outcome> {
    clap_complete::generate(a.shell, &mut cli, "glmcheck", &mut std::io::stdout());
    Ok(Outcome::Ok)
}
