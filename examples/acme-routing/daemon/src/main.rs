//! `acme-kvedge`: the kvedge daemon and command line, with the ACME policy
//! types registered next to the shipped ones. The whole of it.

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut registry = kvedge_policies::router_plugin_registry();
    if let Err(e) = acme_routing_catalog::register(&mut registry) {
        eprintln!("acme-kvedge: {e}");
        return ExitCode::from(1);
    }
    kvedge_cli::main_with_registry(registry)
}
