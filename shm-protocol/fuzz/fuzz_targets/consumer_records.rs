//! Fuzzes the ring consumer's record parser and message decoder with
//! arbitrary segment contents and claimed tails.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = kvedge_shm::fuzzing::consume_hostile_bytes(data);
});
