//! Entry point shared by the cargo-fuzz target and the property tests of
//! the request-body reader: any bytes as an OpenAI body from a client.
//! Reading must not panic, must come out exactly as serde_json alone reads
//! the body (the same fields, or the same error in the same words), and
//! the serving thread's token-id reading must agree with both.

use crate::body::{Route, parse, parse_by_serde, token_ids};

/// Reads `body` on both routes; panics only if the readings disagree (a
/// bug the fuzzer should find).
pub fn read_hostile_body(body: &[u8]) {
    for route in [Route::Completions, Route::Chat] {
        let read = parse(route, body);
        let reference = parse_by_serde(route, body);
        assert_eq!(
            read,
            reference,
            "{route:?}: {:?}",
            String::from_utf8_lossy(body)
        );
    }
    if let Some(ids) = token_ids(body) {
        assert_eq!(ids, parse(Route::Completions, body));
        if let Ok(p) = ids {
            assert!(matches!(p.prompt, crate::body::Prompt::Tokens(_)), "{p:?}");
        }
    }
}
