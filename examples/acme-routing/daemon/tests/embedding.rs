//! The custom binary accepts a configuration using the custom type, which
//! the stock `kvedge` binary rejects.

use std::process::Command;

#[test]
fn the_custom_binary_knows_the_custom_type() {
    let yaml = concat!(env!("CARGO_MANIFEST_DIR"), "/../worker-selection.yaml");
    let ours = Command::new(env!("CARGO_BIN_EXE_acme-kvedge"))
        .args(["check-config", yaml])
        .output()
        .unwrap();
    assert_eq!(
        ours.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ours.stderr)
    );
    let stock = std::path::Path::new(env!("CARGO_BIN_EXE_acme-kvedge")).with_file_name("kvedge");
    if stock.exists() {
        let out = Command::new(stock)
            .args(["check-config", yaml])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(String::from_utf8_lossy(&out.stderr).contains("unknown type `acme-least-busy`"));
    }
}
