//! Fuzzes the binary query decoder with arbitrary frame bodies; what it
//! decodes must round-trip through the encoder.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvedge_wire::fuzzing::decode_hostile_request(data);
});
