//! Fuzzes the request-body reader with arbitrary bodies; its reading must
//! agree with serde_json's alone.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    kvedge_epp::fuzzing::read_hostile_body(data);
});
