//! The `kvedge` command line. Today: the offline tools `hash` (the sequence
//! hashes of a token list, to debug engine/frontend mismatches) and
//! `check-config` (load and validate a configuration file without running).

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kvedge_daemon::config::Config;
use kvedge_policies::{SelectionOverrides, router_plugin_registry};

#[derive(Parser)]
#[command(
    name = "kvedge",
    version,
    about = "Per-node KV-cache-aware routing daemon"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Prints the sequence hashes of a token list, one per full block, in decimal.
    Hash {
        /// Tokens per block.
        #[arg(long)]
        block_size: usize,
        /// LoRA adapter name (changes the hash seed).
        #[arg(long)]
        lora: Option<String>,
        /// Cache namespace (changes the hash seed).
        #[arg(long)]
        namespace: Option<String>,
        /// Token ids, separated by commas or spaces (one or more arguments).
        #[arg(required = true)]
        tokens: Vec<String>,
    },
    /// Loads and validates a configuration file; exit code 1 on any error.
    CheckConfig {
        file: PathBuf,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn parse_tokens(args: &[String]) -> Result<Vec<u32>, String> {
    args.iter()
        .flat_map(|a| a.split(|c: char| c == ',' || c.is_whitespace()))
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| format!("`{t}` is not a token id (0..=4294967295)"))
        })
        .collect()
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Hash {
            block_size,
            lora,
            namespace,
            tokens,
        } => {
            if block_size == 0 {
                eprintln!("kvedge hash: --block-size must be positive");
                return ExitCode::from(2);
            }
            let tokens = match parse_tokens(&tokens) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("kvedge hash: {e}");
                    return ExitCode::from(2);
                }
            };
            let hashes = kvedge_shm::hash::sequence_hashes(
                &tokens,
                block_size,
                lora.as_deref(),
                namespace.as_deref(),
            );
            for h in hashes {
                println!("{h}");
            }
            ExitCode::SUCCESS
        }
        Command::CheckConfig { file, json } => {
            let registry = router_plugin_registry();
            match Config::load_file(
                &file,
                &registry,
                &SelectionOverrides::default().with_env_fallback(),
            ) {
                Ok(config) => {
                    let rules = config.rules.as_ref().map_or(0, |r| r.rules.len());
                    if json {
                        println!("{{\"ok\": true, \"rules\": {rules}}}");
                    } else {
                        println!("{}: ok ({rules} rules)", file.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    if json {
                        println!(
                            "{{\"error\": {{\"code\": \"config\", \"message\": {}}}}}",
                            json_string(&e.to_string())
                        );
                    } else {
                        eprintln!("{e}");
                    }
                    ExitCode::from(1)
                }
            }
        }
    }
}
