//! The picker's tokenization prefix cache gives exactly the token ids of a
//! fresh tokenization: for every chat template in `testdata/chat-templates`
//! and tokenizers of the three kinds models ship (byte-level BPE, a
//! SentencePiece-style one that marks spaces and the start of the text,
//! one that splits on whitespace), across the turns of conversations, after
//! an earlier turn is edited, and with a cache so small it evicts all the
//! time.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use kvedge_epp::body::Prompt;
use kvedge_epp::tokenize::{ModelSpec, Models, Tokens};
use serde_json::{Value, json};
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainer};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::whitespace::Whitespace;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

const SPECIAL: [&str; 10] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvedge-prefix-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A tokenizer with `pre` trained on the repository's docs, with the
/// special tokens added, saved as `name`.json.
fn tokenizer(name: &str, pre: PreTokenizerWrapper) -> PathBuf {
    let files: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .filter_map(|e| Some(e.ok()?.path().to_string_lossy().into_owned()))
        .filter(|p| p.ends_with(".md"))
        .collect();
    let byte_level = matches!(pre, PreTokenizerWrapper::ByteLevel(_));
    let mut builder = BpeTrainer::builder().vocab_size(2000).min_frequency(2);
    if byte_level {
        builder = builder.initial_alphabet(ByteLevel::alphabet().into_iter().collect());
    }
    let mut trainer: TrainerWrapper = builder.build().into();
    let mut t = Tokenizer::new(BPE::default());
    t.with_pre_tokenizer(Some(pre));
    t.train_from_files(&mut trainer, files).unwrap();
    let specials: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
    t.add_special_tokens(&specials);
    let path = dir().join(format!("{name}.json"));
    t.save(&path, false).unwrap();
    path
}

fn tokenizers() -> Vec<(&'static str, PathBuf)> {
    vec![
        (
            "byte-level",
            tokenizer("byte-level", ByteLevel::new(false, true, true).into()),
        ),
        (
            "metaspace",
            tokenizer(
                "metaspace",
                Metaspace::new('▁', PrependScheme::First, true).into(),
            ),
        ),
        ("whitespace", tokenizer("whitespace", Whitespace {}.into())),
    ]
}

fn templates() -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(root().join("testdata/chat-templates"))
        .unwrap()
        .filter_map(|e| {
            let p = e.ok()?.path();
            let name = p.file_name()?.to_str()?.strip_suffix(".jinja")?.to_owned();
            Some((name, p))
        })
        .collect();
    out.sort();
    assert_eq!(out.len(), 3, "{out:?}");
    out
}

fn models(tokenizer: &Path, template: &Path, cache_bytes: usize) -> Models {
    Models::load_with(
        &[ModelSpec {
            engine: Default::default(),
            name: "m".into(),
            tokenizer: Some(tokenizer.into()),
            chat_template: Some(template.into()),
            bos_token: "<s>".into(),
            eos_token: "</s>".into(),
        }],
        cache_bytes,
    )
    .unwrap()
}

fn ids(models: &Models, messages: &[Value]) -> Vec<u32> {
    match models
        .tokens("m", Prompt::chat(messages.to_vec()), 1 << 20)
        .unwrap()
    {
        Tokens::Ids(ids) => ids,
        Tokens::Text(_) => panic!("not tokenized"),
    }
}

/// A conversation of `turns` user turns, each answered, from the docs'
/// text (with spaces, newlines, punctuation and digits at the joins).
fn conversation(seed: usize, turns: usize) -> Vec<Value> {
    let docs = std::fs::read_to_string(root().join("docs/operations.md")).unwrap();
    let words: Vec<&str> = docs.split_whitespace().collect();
    let text = |i: usize, n: usize| -> String {
        let start = (seed * 7919 + i * 104_729) % (words.len() - n);
        let mut s = words[start..start + n].join(" ");
        if i.is_multiple_of(3) {
            s.push_str("\n\n  ");
        }
        if i % 4 == 1 {
            s.insert_str(0, "  ");
        }
        s
    };
    let mut out = vec![json!({"role": "system", "content": text(0, 30)})];
    for t in 0..turns {
        out.push(json!({"role": "user", "content": text(2 * t + 1, 20 + t * 5)}));
        out.push(json!({"role": "assistant", "content": text(2 * t + 2, 40)}));
    }
    out
}

#[test]
fn every_turn_gets_the_ids_of_a_fresh_tokenization() {
    for (tname, tok) in tokenizers() {
        for (name, template) in templates() {
            let cached = models(&tok, &template, 32 << 20);
            let fresh = models(&tok, &template, 0);
            for seed in 0..3 {
                let chat = conversation(seed, 6);
                // Turn by turn, as a frontend sends them: the user's
                // messages so far, with the replies in between.
                for end in (2..=chat.len()).step_by(2) {
                    let messages = &chat[..end];
                    assert_eq!(
                        ids(&cached, messages),
                        ids(&fresh, messages),
                        "{tname} tokenizer, {name} template, conversation {seed}, {end} messages"
                    );
                }
            }
            let c = cached.prefix_counts();
            assert!(
                c.hits >= 3 * 5,
                "{tname}/{name}: every turn after the first hits: {c:?}"
            );
            assert!(
                c.tokens_reused > c.tokens_encoded,
                "{tname}/{name}: most tokens come from the cache: {c:?}"
            );
            assert_eq!(fresh.prefix_counts(), Default::default(), "off at 0");
        }
    }
}

#[test]
fn an_edited_earlier_turn_misses_and_is_still_right() {
    let toks = tokenizers();
    let (_, tok) = &toks[0];
    for (name, template) in templates() {
        let cached = models(tok, &template, 32 << 20);
        let fresh = models(tok, &template, 0);
        let chat = conversation(7, 5);
        assert_eq!(ids(&cached, &chat), ids(&fresh, &chat));
        // The same conversation with its second user turn rewritten.
        let mut edited = chat.clone();
        edited[3] = json!({"role": "user", "content": "Something else entirely, 42 times."});
        let before = cached.prefix_counts();
        assert_eq!(ids(&cached, &edited), ids(&fresh, &edited), "{name}");
        let after = cached.prefix_counts();
        // Either nothing was reused or only the part before the edit.
        let reused = after.tokens_reused - before.tokens_reused;
        let upto_edit = ids(&fresh, &chat[..3]).len() as u64;
        assert!(
            reused <= upto_edit,
            "{name}: {reused} reused, {upto_edit} before the edit"
        );
        // A prompt that only shares the system message's first words.
        let mut other = chat.clone();
        other[0] = json!({"role": "system", "content": "A different system prompt."});
        assert_eq!(ids(&cached, &other), ids(&fresh, &other), "{name}");
    }
}

#[test]
fn a_small_cache_evicts_within_its_bound_and_stays_right() {
    let toks = tokenizers();
    let (_, tok) = &toks[1];
    let (_, template) = &templates()[0];
    let bound = 16 * 1024;
    let cached = models(tok, template, bound);
    let fresh = models(tok, template, 0);
    for round in 0..2 {
        for seed in 0..40 {
            let chat = conversation(seed, 4);
            for end in (2..=chat.len()).step_by(2) {
                assert_eq!(
                    ids(&cached, &chat[..end]),
                    ids(&fresh, &chat[..end]),
                    "round {round}, conversation {seed}, {end} messages"
                );
                let bytes = cached.prefix_counts().bytes;
                assert!(bytes <= bound as u64, "{bytes} bytes held, bound {bound}");
            }
        }
    }
    let c = cached.prefix_counts();
    assert!(c.bytes > 0);
    // Forty conversations do not fit: the second round finds most of them
    // evicted and tokenizes them whole again.
    assert!(c.misses > 40, "{c:?}");
}

/// A chat kvedge cannot render as the engine does (a template using a
/// filter kvedge's Jinja lacks, a picture in a message) is routed on its
/// text and counted, not refused and not routed on wrong token ids.
#[test]
fn chats_kvedge_cannot_render_fall_back_to_their_text_and_are_counted() {
    let (_, tokenizer) = tokenizers().remove(0);
    let template = dir().join("wordwrap.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}<|im_start|>{{ m.content | wordwrap(20) }}<|im_end|>{% endfor %}",
    )
    .unwrap();
    let m = models(&tokenizer, &template, 1 << 20);
    let chat = vec![serde_json::json!({"role": "user", "content": "some words to wrap"})];
    match m.tokens("m", Prompt::chat(chat), 1 << 20).unwrap() {
        Tokens::Text(text) => assert_eq!(text, "user\nsome words to wrap\n"),
        Tokens::Ids(_) => panic!("rendered without the filter"),
    }
    let (_, chatml) = templates()
        .into_iter()
        .find(|(n, _)| n == "chatml")
        .unwrap();
    let m2 = models(&tokenizer, &chatml, 1 << 20);
    let picture = vec![serde_json::json!({"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]})];
    assert!(matches!(
        m2.tokens("m", Prompt::chat(picture), 1 << 20).unwrap(),
        Tokens::Text(t) if t == "user\nwhat is this?\n"
    ));
    assert_eq!(m.prefix_counts().template_fallbacks, 1);
    assert_eq!(m2.prefix_counts().template_fallbacks, 1);
}
