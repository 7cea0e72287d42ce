//! The checked-in header is what the pinned cbindgen makes of the source.

#![forbid(unsafe_code)]

#[test]
fn header_is_fresh() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut generated);
    let path = format!("{dir}/include/kvedge.h");
    if std::env::var_os("KVEDGE_BLESS").is_some() {
        std::fs::write(&path, &generated).unwrap();
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/kvedge.h is stale: run `KVEDGE_BLESS=1 cargo test -p kvedge-c --test header` and commit it"
    );
}
