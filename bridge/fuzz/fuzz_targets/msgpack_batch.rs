//! Fuzzes the KV-event batch decoder and the hash translator with
//! arbitrary engine payloads.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvedge_bridge::fuzzing::decode_hostile_batch(data);
});
