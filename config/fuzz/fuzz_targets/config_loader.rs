//! Fuzzes the configuration loader (size and nesting bounds, UTF-8, the
//! YAML parser, every section's validation) with arbitrary files.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvedge_config::fuzzing::load_hostile_config(data);
});
