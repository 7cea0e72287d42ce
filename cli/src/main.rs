//! The `kvedge` binary: the command line with the shipped policies. To add
//! your own, build a binary like this one that registers your catalog first
//! (see docs/custom-policies.md).

#![forbid(unsafe_code)]

/// mimalloc rather than glibc's malloc: see the dependency's note in
/// Cargo.toml and BENCHMARKS.md (Gateway shoot-out).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    kvedge_cli::main_with_registry(kvedge_policies::router_plugin_registry())
}
