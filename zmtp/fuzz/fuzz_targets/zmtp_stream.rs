//! Fuzzes the ZMTP greeting check and frame decoder with arbitrary peer
//! bytes in arbitrary read sizes; every message it yields must be within
//! the caps and round-trip through the encoder.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvedge_zmtp::fuzzing::decode_hostile_stream(data);
});
