//! The `kvedge` command line: `run` (the daemon), the query client
//! (`query select|prefill-done|finish`, `workers`, `stats`, `reload`), the
//! tools (`sim`, `mock-engine`, `demo`, `publish`), and the offline helpers
//! `hash` (the sequence hashes of a token list, to debug engine/frontend
//! mismatches) and `check-config`.
//!
//! [`main_with_registry`] is the embedding entry point: an operator builds
//! their own `kvedge` binary whose `main` registers their policy catalog
//! next to the shipped policies and hands the registry over.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;

use clap::{Parser, Subcommand};
use kvedge_daemon::server::RuntimeDir;
use kvedge_policies::{RouterPluginRegistry, SelectionOverrides};
use kvedge_wire::{Ids, Request, Role, Select, Strs};

mod human;
pub mod top;

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
    /// Runs the daemon.
    Run {
        #[arg(long, default_value = "/etc/kvedge/kvedge.yaml")]
        config: PathBuf,
        #[arg(long, default_value = "/run/kvedge")]
        runtime_dir: PathBuf,
        #[command(flatten)]
        policies: PolicyOverrides,
    },
    /// Asks a running daemon.
    Query {
        #[command(subcommand)]
        query: QueryCommand,
        #[command(flatten)]
        target: Target,
    },
    /// Lists the registered workers of a running daemon.
    Workers {
        #[command(flatten)]
        target: Target,
    },
    /// Counters of a running daemon.
    Stats {
        #[command(flatten)]
        target: Target,
        /// Print the Prometheus / OpenMetrics text exposition instead.
        #[arg(long)]
        prometheus: bool,
    },
    /// A live view of a running daemon: its workers (state, sync, queue,
    /// KV usage, blocks, hit rate, picks a second, standing notices) and
    /// totals (decisions a second, decision latency, hit rate, rejects).
    /// Keys: q quit, s sort, / filter by model.
    Top {
        #[command(flatten)]
        target: Target,
        /// Print one frame as plain text and exit (two samples
        /// `--interval-ms` apart, for the rates).
        #[arg(long)]
        once: bool,
        /// Milliseconds between refreshes.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(50..=60_000))]
        interval_ms: u64,
        /// The rows' order.
        #[arg(long, value_enum, default_value_t = top::SortBy::Worker)]
        sort: top::SortBy,
        /// Only workers whose model contains this.
        #[arg(long, default_value = "")]
        model: String,
    },
    /// What the endpoint picker would do with an OpenAI request body: its
    /// prompt is read as the picker reads it (the configuration's model,
    /// tokenizer and chat template) and the running daemon answers a
    /// dry-run select with its explanation. Nothing is reserved.
    Explain {
        #[command(flatten)]
        target: Target,
        /// The daemon's configuration file (its `epp:` models).
        #[arg(long, default_value = "/etc/kvedge/kvedge.yaml")]
        config: PathBuf,
        /// The request's path.
        #[arg(long, default_value = "/v1/chat/completions")]
        path: String,
        /// The request body: a file, or `-` for standard input.
        body: PathBuf,
        #[command(flatten)]
        policies: PolicyOverrides,
    },
    /// Makes a running daemon load its configuration file again (as
    /// SIGHUP does); an invalid file is refused and the old one serves on.
    Reload {
        #[command(flatten)]
        target: Target,
    },
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
        /// Print `{"hashes": [...]}` instead of one hash a line.
        #[arg(long)]
        json: bool,
    },
    /// Registers as an engine and publishes KV events written as JSON lines,
    /// then holds the registration (answering resync requests) until stdin
    /// closes or `--hold` seconds pass.
    Publish(kvedge_mock::publish::PublishArgs),
    /// Replays a workload (a Mooncake trace or the synthetic generator)
    /// through the real router and engine models in virtual time, and
    /// prints a table per policy.
    Sim(kvedge_tools::sim_cmd::SimArgs),
    /// A simulated engine (the model of `kvedge sim`) as a real process:
    /// registers, publishes through its ring, serves requests on --listen.
    MockEngine(kvedge_mock::mock_engine::MockEngineArgs),
    /// The daemon, mock engines and a load generator on this machine, with
    /// a bundled configuration; prints the routing table at the end.
    Demo(kvedge_tools::demo::DemoArgs),
    /// Loads and validates a configuration file; exit code 1 on any error.
    CheckConfig {
        file: PathBuf,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Where a running daemon listens, and how to print its answer.
/// Which worker-selection instance serves which role, over the YAML's
/// `worker_selection`: a role's own option, else its environment variable,
/// else the all-roles option, else its variable, else the YAML.
#[derive(clap::Args, Debug, Default)]
struct PolicyOverrides {
    /// One instance (or `default`) for every role [env:
    /// KVEDGE_ROUTER_WORKER_SELECTION_POLICY]
    #[arg(long, value_name = "INSTANCE")]
    worker_selection_policy: Option<String>,
    /// The prefill role's instance [env: KVEDGE_ROUTER_PREFILL_POLICY]
    #[arg(long, visible_alias = "router-prefill-policy", value_name = "INSTANCE")]
    prefill_policy: Option<String>,
    /// The decode role's instance [env: KVEDGE_ROUTER_DECODE_POLICY]
    #[arg(long, visible_alias = "router-decode-policy", value_name = "INSTANCE")]
    decode_policy: Option<String>,
}

impl PolicyOverrides {
    /// The options, each completed from its environment variable.
    fn resolve(self) -> SelectionOverrides {
        SelectionOverrides {
            all_roles: self.worker_selection_policy,
            prefill: self.prefill_policy,
            decode: self.decode_policy,
        }
        .with_env_fallback()
    }
}

#[derive(clap::Args)]
struct Target {
    /// The daemon's runtime directory (its `query.sock`).
    #[arg(long, default_value = "/run/kvedge", global = true)]
    runtime_dir: PathBuf,
    /// The query socket itself (overrides `--runtime-dir`).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// Print the daemon's JSON reply as it is.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for the daemon's answer (a stopped or hung daemon
    /// is reported as unreachable after this long).
    #[arg(long, global = true, default_value_t = 10.0)]
    timeout: f64,
}

impl Target {
    fn query_socket(&self) -> PathBuf {
        self.socket.clone().unwrap_or_else(|| {
            RuntimeDir {
                dir: self.runtime_dir.clone(),
            }
            .query()
        })
    }
}

#[derive(Subcommand)]
enum QueryCommand {
    /// Which worker should serve this prompt?
    Select {
        #[arg(long)]
        model: String,
        /// Token ids, separated by commas or spaces.
        #[arg(long, conflicts_with = "hashes")]
        tokens: Option<String>,
        /// Sequence hashes, separated by commas or spaces.
        #[arg(long)]
        hashes: Option<String>,
        #[arg(long)]
        role: Option<String>,
        #[arg(long)]
        session: Option<String>,
        /// Tenant, for the rule language.
        #[arg(long)]
        tenant: Option<String>,
        /// A `type-degree` tag for the rule language (repeatable).
        #[arg(long = "tag")]
        tags: Vec<String>,
        /// Answer without reserving the worker.
        #[arg(long)]
        dry_run: bool,
        /// Include how the choice was made (candidates, stage counts,
        /// per-worker signals).
        #[arg(long)]
        explain: bool,
    },
    /// The request's prefill is done.
    PrefillDone { request_id: u64 },
    /// The request finished.
    Finish { request_id: u64 },
    /// Releases a request whose dispatch failed before any token: its
    /// session's binding goes back to what it was before the select.
    Abort { request_id: u64 },
}

/// Writes to stdout; a closed stdout (`kvedge stats | head -c 0`) ends
/// the command quietly instead of in a panic.
fn write_stdout(args: std::fmt::Arguments<'_>) {
    let mut stdout = std::io::stdout().lock();
    if stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

/// `print!` that survives a closed stdout.
macro_rules! out {
    ($($arg:tt)*) => { write_stdout(format_args!($($arg)*)) };
}

/// `println!` that survives a closed stdout.
macro_rules! outln {
    () => { write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// The largest body `kvedge explain` reads (the picker's own limit is
/// lower; a larger one is reported as the picker would).
const MAX_EXPLAIN_BODY: u64 = 256 << 20;

fn explain(
    target: &Target,
    config: &std::path::Path,
    path: &str,
    body: &std::path::Path,
    registry: &RouterPluginRegistry,
    overrides: &SelectionOverrides,
) -> ExitCode {
    let fail = |e: String| {
        eprintln!("kvedge explain: {e}");
        ExitCode::from(1)
    };
    let config = match kvedge_daemon::config::load(config, registry, overrides) {
        Ok(c) => c,
        Err(e) => return fail(e.to_string()),
    };
    let Some(section) = config.epp.as_ref() else {
        return fail("the configuration has no `epp:` section: the endpoint picker is off".into());
    };
    let loaded = match kvedge_daemon::epp::load(section, &config.engines) {
        Ok(l) => l,
        Err(e) => return fail(e.to_string()),
    };
    let mut bytes = Vec::new();
    let read = if body.as_os_str() == "-" {
        std::io::stdin()
            .take(MAX_EXPLAIN_BODY)
            .read_to_end(&mut bytes)
    } else {
        std::fs::File::open(body).and_then(|f| f.take(MAX_EXPLAIN_BODY).read_to_end(&mut bytes))
    };
    if let Err(e) = read {
        return fail(format!("{}: {e}", body.display()));
    }
    let prompted = match loaded.read_request(path, &bytes) {
        Ok(p) => p,
        Err((code, message)) => {
            return fail(format!("the gateway would answer {code}: {message}"));
        }
    };
    let mut s = prompted.select();
    s.dry_run = true;
    s.explain = true;
    if !target.json {
        match prompted.prompt_tokens {
            None => outln!(
                "model {}: {} prompt tokens",
                prompted.model,
                prompted.tokens.len()
            ),
            Some(n) => outln!(
                "model {} (no tokenizer): about {n} prompt tokens, {} text chunks (approximate mode)",
                prompted.model,
                prompted.approximate.len()
            ),
        }
    }
    ask(target, &Request::Select(s))
}

/// The code the CLI reports when the daemon cannot be reached (it is not a
/// daemon status: nothing answered).
const UNREACHABLE: &str = "unreachable";

/// Sends one request as a JSON line; the reply, or an `unreachable` error.
fn request(target: &Target, request: &Request<'_>) -> serde_json::Value {
    let path = target.query_socket();
    let mut line = Vec::new();
    if let Err(e) = kvedge_wire::json::encode_request(&mut line, request) {
        return serde_json::json!({"error": {"code": UNREACHABLE, "message": e}});
    }
    let timeout = std::time::Duration::try_from_secs_f64(target.timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .unwrap_or(std::time::Duration::from_secs(10));
    let result = (|| -> std::io::Result<String> {
        let mut stream = UnixStream::connect(&path)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        // A refused connection gets one error line and is closed, maybe
        // before the request is written: that line, not the failed
        // write, is the answer.
        let sent = stream.write_all(&line);
        let mut reply = String::new();
        let read = BufReader::new(stream).read_line(&mut reply);
        if !reply.is_empty() {
            return Ok(reply);
        }
        sent?;
        match read {
            Ok(_) => Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the daemon closed the connection without answering",
            )),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no answer within {timeout:?} (is the daemon stopped or hung?)"),
                ))
            }
            Err(e) => Err(e),
        }
    })();
    match result
        .map_err(|e| format!("{}: {e}", path.display()))
        .and_then(|line| {
            serde_json::from_str(&line).map_err(|e| format!("unreadable reply `{line}`: {e}"))
        }) {
        Ok(v) => v,
        Err(message) => {
            serde_json::json!({"error": {"code": UNREACHABLE, "message": message}})
        }
    }
}

/// Sends one request and prints the reply (as it is with `--json`, else
/// for people); exit code 1 on an error reply or an unreachable daemon.
fn ask(target: &Target, query: &Request<'_>) -> ExitCode {
    let reply = request(target, query);
    let failed = reply.get("error").is_some();
    if target.json {
        outln!("{reply}");
    } else if failed {
        eprintln!(
            "kvedge: {}: {}",
            reply["error"]["code"].as_str().unwrap_or("error"),
            reply["error"]["message"].as_str().unwrap_or("")
        );
    } else {
        out!("{}", human::render(query.op_name(), &reply));
    }
    if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn numbers<T: std::str::FromStr>(text: &str) -> Result<Vec<T>, String> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<T>().map_err(|_| format!("`{t}` is not a number")))
        .collect()
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

/// Runs the `kvedge` command line with `registry` (the shipped policies
/// plus whatever the caller registered) and returns the exit code.
pub fn main_with_registry(registry: RouterPluginRegistry) -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Run {
            config,
            runtime_dir,
            policies,
        } => ExitCode::from(kvedge_daemon::service::run(
            &config,
            runtime_dir,
            registry,
            policies.resolve(),
        )),
        Command::Query { query, target } => match query {
            QueryCommand::Select {
                model,
                tokens,
                hashes,
                role,
                session,
                tenant,
                tags,
                dry_run,
                explain,
            } => {
                let fail = |what: &str, e: String| {
                    eprintln!("kvedge query select: {what}: {e}");
                    ExitCode::from(2)
                };
                let role = match role.as_deref().map(|r| {
                    Role::parse(r).ok_or(format!(
                        "unknown role `{r}` (aggregated, prefill, decode, encode)"
                    ))
                }) {
                    None => Role::Aggregated,
                    Some(Ok(r)) => r,
                    Some(Err(e)) => return fail("--role", e),
                };
                let (token_ids, hash_ids) = match (tokens, hashes) {
                    (Some(t), None) => match numbers::<u32>(&t) {
                        Ok(v) => (v, Vec::new()),
                        Err(e) => return fail("--tokens", e),
                    },
                    (None, Some(h)) => match numbers::<u64>(&h) {
                        Ok(v) => (Vec::new(), v),
                        Err(e) => return fail("--hashes", e),
                    },
                    _ => {
                        eprintln!("kvedge query select: give --tokens or --hashes");
                        return ExitCode::from(2);
                    }
                };
                let ids = if hash_ids.is_empty() {
                    Ids::tokens(&token_ids)
                } else {
                    Ids::hashes(&hash_ids)
                };
                let mut s = Select::new(&model, role, ids);
                s.session = session.as_deref();
                s.tenant = tenant.as_deref();
                s.tags = Strs::strings(&tags);
                s.dry_run = dry_run;
                s.explain = explain;
                ask(&target, &Request::Select(s))
            }
            QueryCommand::PrefillDone { request_id } => {
                ask(&target, &Request::PrefillDone { request_id })
            }
            QueryCommand::Finish { request_id } => ask(&target, &Request::Finish { request_id }),
            QueryCommand::Abort { request_id } => ask(&target, &Request::Abort { request_id }),
        },
        Command::Workers { target } => ask(&target, &Request::Workers),
        Command::Stats {
            target,
            prometheus: false,
        } => ask(&target, &Request::Stats),
        Command::Stats {
            target,
            prometheus: true,
        } => {
            let reply = request(&target, &Request::Metrics);
            match reply["text"].as_str() {
                Some(text) => {
                    out!("{text}");
                    ExitCode::SUCCESS
                }
                None => {
                    eprintln!(
                        "kvedge: {}: {}",
                        reply["error"]["code"].as_str().unwrap_or("error"),
                        reply["error"]["message"].as_str().unwrap_or("")
                    );
                    ExitCode::from(1)
                }
            }
        }
        Command::Reload { target } => ask(&target, &Request::Reload),
        Command::Explain {
            target,
            config,
            path,
            body,
            policies,
        } => explain(
            &target,
            &config,
            &path,
            &body,
            &registry,
            &policies.resolve(),
        ),
        Command::Top {
            target,
            once,
            interval_ms,
            sort,
            model,
        } => {
            let interval = std::time::Duration::from_millis(interval_ms);
            let ask = |op: &str| {
                let r = match op {
                    "workers" => Request::Workers,
                    "stats" => Request::Stats,
                    "decisions" => Request::Decisions,
                    _ => Request::Metrics,
                };
                request(&target, &r)
            };
            let shown = if once {
                top::once(ask, interval, sort, &model).map(|text| out!("{text}"))
            } else {
                top::live(ask, interval, sort, model)
            };
            match shown {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("kvedge top: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Command::Hash {
            block_size,
            lora,
            namespace,
            tokens,
            json,
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
            let hashes = kvedge_schema::hash::sequence_hashes(
                &tokens,
                block_size,
                lora.as_deref(),
                namespace.as_deref(),
            );
            if json {
                outln!("{}", serde_json::json!({ "hashes": hashes }));
            } else {
                for h in hashes {
                    outln!("{h}");
                }
            }
            ExitCode::SUCCESS
        }
        Command::Publish(args) => {
            let json = args.json;
            match kvedge_mock::publish::run(args) {
                Ok(summary) => {
                    if json {
                        outln!("{summary}");
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    if json {
                        outln!(
                            "{}",
                            serde_json::json!({"error": {"code": "publish", "message": e}})
                        );
                    } else {
                        eprintln!("kvedge publish: {e}");
                    }
                    ExitCode::from(1)
                }
            }
        }
        Command::Sim(args) => match kvedge_tools::sim_cmd::execute(&args, &registry) {
            Ok(text) => {
                out!("{text}");
                if !text.ends_with('\n') {
                    outln!();
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvedge sim: {e}");
                ExitCode::from(1)
            }
        },
        Command::MockEngine(args) => match kvedge_mock::mock_engine::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("kvedge mock-engine: {e}");
                ExitCode::from(1)
            }
        },
        Command::Demo(args) => match kvedge_tools::demo::run(&args) {
            Ok(text) => {
                outln!("{}", text.trim_end());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvedge demo: {e}");
                ExitCode::from(1)
            }
        },
        Command::CheckConfig { file, json } => {
            match kvedge_daemon::config::load(
                &file,
                &registry,
                &SelectionOverrides::default().with_env_fallback(),
            ) {
                Ok(config) => {
                    let rules = config.rules.as_ref().map_or(0, |r| r.rules.len());
                    let warnings = kvedge_daemon::epp::template_warnings(config.epp.as_ref());
                    if json {
                        outln!(
                            "{}",
                            serde_json::json!({"ok": true, "rules": rules, "warnings": warnings})
                        );
                    } else {
                        for w in &warnings {
                            eprintln!("warning: {w}");
                        }
                        outln!("{}: ok ({rules} rules)", file.display());
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    if json {
                        outln!(
                            "{}",
                            serde_json::json!({"error": {"code": "config", "message": e.to_string()}})
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
