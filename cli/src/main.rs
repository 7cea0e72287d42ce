//! The `kvedge` binary: the command line with the shipped policies. To add
//! your own, build a binary like this one that registers your catalog first
//! (see docs/custom-policies.md).

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    kvedge_cli::main_with_registry(kvedge_policies::router_plugin_registry())
}
