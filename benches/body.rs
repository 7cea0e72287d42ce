//! Reading an OpenAI request body for the pick (`kvedge_epp::body::parse`):
//! a completion whose prompt is 2,048 token ids of a 128 k vocabulary
//! (about 12 KB), read by the picker's byte loop, beside serde_json
//! reading the same list alone into a `Vec<u32>` (the path the picker
//! took before, one visitor call an element); and a chat of three
//! messages, which serde_json reads.
//!
//! `cargo bench --bench body`

#![forbid(unsafe_code)]

use std::hint::black_box;
use std::time::Duration;

use criterion::Criterion;
use kvedge_epp::body::{Prompt, Route, parse};

fn main() {
    let mut c = Criterion::default().configure_from_args();
    // Ids spread over a Llama-3-sized vocabulary, as a tokenizer gives them.
    let ids: Vec<u32> = (0..2048u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_256)
        .collect();
    let completion =
        serde_json::json!({"model": "m", "stream": true, "max_tokens": 64, "prompt": ids})
            .to_string()
            .into_bytes();
    let list = serde_json::to_vec(&ids).unwrap();
    let chat = serde_json::json!({
        "model": "m",
        "stream": true,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. ".repeat(40)},
            {"role": "user", "content": "Summarise the routing daemon's design. ".repeat(60)},
            {"role": "assistant", "content": "It routes each request to the worker that holds its prefix. ".repeat(30)},
        ],
    })
    .to_string()
    .into_bytes();
    let read = parse(Route::Completions, &completion).unwrap();
    assert_eq!(read.prompt, Prompt::Tokens(ids.clone()));
    assert!(
        matches!(parse(Route::Chat, &chat).unwrap().prompt, Prompt::Messages(c) if c.messages.len() == 3)
    );

    let mut g = c.benchmark_group("body");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("completion_2048_token_ids", |b| {
        b.iter(|| parse(Route::Completions, black_box(&completion)))
    });
    g.bench_function("serde_json_the_same_ids_alone", |b| {
        b.iter(|| serde_json::from_slice::<Vec<u32>>(black_box(&list)).unwrap())
    });
    g.bench_function("chat_three_messages", |b| {
        b.iter(|| parse(Route::Chat, black_box(&chat)))
    });
    g.finish();
    c.final_summary();
    eprintln!(
        "bodies: completion {} bytes, the list alone {} bytes, chat {} bytes",
        completion.len(),
        list.len(),
        chat.len()
    );
}
