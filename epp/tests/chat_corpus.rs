//! The chat templates of widely served model families
//! (`testdata/chat-templates/models/`, where each came from in its README),
//! and three of this repository's own in the shapes they take
//! (`chat_templates/*.jinja`: Python methods, tools, loop controls,
//! `raise_exception`), rendered by kvedge from a client's request body, and by transformers'
//! `apply_chat_template` from the chat as vLLM's OpenAI server hands it
//! over (`chat_templates/corpus.py`): the same text and the same token
//! ids, under a byte-level BPE or a SentencePiece-style tokenizer as the
//! family has, with no special tokens added (as vLLM tokenizes a chat).
//! Token ids are taken through the picker's whole path: body reader,
//! template, prefix cache.
//!
//! Needs Python with `transformers` (`KVEDGE_PYTHON`, else the
//! repository's `target/python-venv`, else `python3`); without it the
//! test says so and passes, unless `KVEDGE_REQUIRE_TOOLS` is set (as in
//! CI).

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use kvedge_epp::body::{self, Prompt, Route};
use kvedge_epp::tokenize::{ModelSpec, Models, Tokens};
use serde_json::{Value, json};

const MODELS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/chat-templates/models"
);
const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/chat_templates/corpus.py"
);
const OWN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/chat_templates");

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    ByteLevel,
    SentencePiece,
}

/// Each template, its tokenizer's kind, and its BOS and EOS tokens.
const FAMILIES: [(&str, Kind, &str, &str); 14] = [
    (
        "llama-3.1",
        Kind::ByteLevel,
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    ("qwen-2.5", Kind::ByteLevel, "", "<|im_end|>"),
    ("qwen-3", Kind::ByteLevel, "", "<|im_end|>"),
    ("mistral-nemo", Kind::ByteLevel, "<s>", "</s>"),
    ("gemma-2", Kind::SentencePiece, "<bos>", "<eos>"),
    ("gemma-3", Kind::SentencePiece, "<bos>", "<eos>"),
    ("phi-3.5", Kind::SentencePiece, "<s>", "<|endoftext|>"),
    ("phi-4", Kind::ByteLevel, "", "<|im_end|>"),
    (
        "deepseek-v3.1",
        Kind::ByteLevel,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
    (
        "deepseek-r1",
        Kind::ByteLevel,
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
    ),
    (
        "granite-3.3",
        Kind::ByteLevel,
        "<|end_of_text|>",
        "<|end_of_text|>",
    ),
    ("glm-4.6", Kind::ByteLevel, "", "<|endoftext|>"),
    ("gpt-oss", Kind::ByteLevel, "<|startoftext|>", "<|return|>"),
    ("tinyllama-zephyr", Kind::SentencePiece, "<s>", "</s>"),
];

/// Every template: the families', then this repository's own.
fn templates() -> Vec<(PathBuf, Kind, &'static str, &'static str)> {
    let mut all: Vec<_> = FAMILIES
        .iter()
        .map(|&(name, kind, bos, eos)| {
            (
                PathBuf::from(format!("{MODELS}/{name}.jinja")),
                kind,
                bos,
                eos,
            )
        })
        .collect();
    for name in ["multiline", "tools", "python_methods"] {
        all.push((
            PathBuf::from(format!("{OWN}/{name}.jinja")),
            Kind::ByteLevel,
            "<s>",
            "</s>",
        ));
    }
    all
}

/// The families' special tokens, all of them in both tokenizers.
const SPECIALS: &[&str] = &[
    "<s>",
    "</s>",
    "<bos>",
    "<eos>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_sep|>",
    "<|endoftext|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|observation|>",
    "[gMASK]",
    "<sop>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|end_of_text|>",
    "<|tool_call|>",
    "<|startoftext|>",
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
];

/// Requests of the shapes clients send, as their bodies.
fn requests() -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city, in °C", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}]);
    let chats = vec![
        json!({"messages": [{"role": "user", "content": "Hello there"}]}),
        json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Summarise: the daemon reads engines' events."},
            {"role": "assistant", "content": "It indexes KV blocks."},
            {"role": "user", "content": "Grüße, 東京 and emoji 🎉 — fine?"},
        ]}),
        json!({"tools": tools, "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "a1b2c3d4e", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"unit\": \"c\", \"city\": \"Zürich\"}"}}]},
            {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "{\"temperature\": 21.5}"},
        ]}),
        json!({"tools": tools, "messages": [{"role": "user", "content": "Weather in Oslo?"}]}),
        json!({"messages": [
            {"role": "user", "content": [{"type": "text", "text": "Two parts:"}, {"type": "text", "text": "one, two."}]},
            {"role": "assistant", "content": "Read."},
            {"role": "user", "content": "And now?"},
        ]}),
        json!({"messages": [
            {"role": "system", "content": "  Padded, with a newline.\n"},
            {"role": "user", "content": "# a comment turn"},
            {"role": "user", "content": "  padded  ", "name": "alice"},
            {"role": "assistant", "content": "ok"},
        ]}),
        json!({"chat_template_kwargs": {"enable_thinking": false, "unrelated": 1},
            "messages": [{"role": "user", "content": "No thinking, please."}]}),
    ];
    let mut out = Vec::new();
    for chat in chats {
        for generation in [true, false] {
            let mut r = chat.clone();
            r["model"] = json!("m");
            r["add_generation_prompt"] = json!(generation);
            out.push(r);
        }
    }
    out.push(
        json!({"model": "m", "add_generation_prompt": false, "continue_final_message": true,
        "messages": [{"role": "user", "content": "Count to three."},
                     {"role": "assistant", "content": "One, two,"}]}),
    );
    out
}

fn python() -> String {
    if let Ok(p) = std::env::var("KVEDGE_PYTHON") {
        return p;
    }
    let venv = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../target/python-venv/bin/python"
    );
    if Path::new(venv).exists() {
        return venv.into();
    }
    "python3".into()
}

struct Reference {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Reference {
    /// The script, when Python has transformers.
    fn start() -> Option<Reference> {
        let py = python();
        let has = Command::new(&py)
            .args(["-c", "import transformers, tokenizers, jinja2"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has {
            return None;
        }
        let mut child = Command::new(&py)
            .arg(SCRIPT)
            // transformers' strftime_now reads the local clock; kvedge's
            // is UTC.
            .env("TZ", "UTC")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        let stdin = child.stdin.take()?;
        let stdout = BufReader::new(child.stdout.take()?);
        Some(Reference {
            child,
            stdin,
            stdout,
        })
    }

    fn ask(&mut self, job: &Value) -> Value {
        writeln!(self.stdin, "{job}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("reference said {line:?}: {e}"))
    }
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What the tokenizers are trained on: the templates and the chats.
fn training_text() -> String {
    let mut text = String::new();
    for (path, ..) in templates() {
        text.push_str(&std::fs::read_to_string(path).unwrap());
    }
    for r in requests() {
        text.push_str(&r.to_string());
    }
    text
}

#[test]
fn kvedge_renders_and_tokenizes_model_templates_as_vllm_hands_them_to_transformers() {
    let Some(mut reference) = Reference::start() else {
        assert!(
            std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
            "KVEDGE_REQUIRE_TOOLS is set but {} has no transformers",
            python()
        );
        eprintln!("skipped: no Python with transformers ({})", python());
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let made = reference.ask(&json!({"op": "tokenizers", "dir": dir.path(),
        "specials": SPECIALS, "text": training_text()}));
    assert_eq!(made["ok"], true);
    let tokenizer = |kind| -> PathBuf {
        dir.path().join(match kind {
            Kind::ByteLevel => "byte_level.json",
            Kind::SentencePiece => "sentencepiece.json",
        })
    };

    let mut failures = Vec::new();
    let mut compared = 0;
    for (template, kind, bos, eos) in templates() {
        let name = template.file_stem().unwrap().to_string_lossy().into_owned();
        let models = Models::load(&[ModelSpec {
            engine: Default::default(),
            name: "m".into(),
            tokenizer: Some(tokenizer(kind)),
            chat_template: Some(template.clone()),
            bos_token: bos.into(),
            eos_token: eos.into(),
        }])
        .unwrap();
        let source = std::fs::read_to_string(&template).unwrap();
        let warnings = kvedge_epp::template::unsupported(&source);
        assert!(
            warnings.iter().all(|w| w.contains("strftime_now")),
            "{name}: check-config would warn of {warnings:?}"
        );
        let ours_template = kvedge_epp::chat::Template::new(source).unwrap();
        let parts = reference.ask(&json!({"op": "parts", "template": template}));
        assert_eq!(
            json!(ours_template.takes_parts()),
            parts["parts"],
            "{name}: whether the template loops over a message's content"
        );
        let mut rendered = 0;
        for request in requests() {
            let theirs = reference.ask(&json!({"template": template, "tokenizer": tokenizer(kind),
                "bos": bos, "eos": eos, "request": request}));
            let body = request.to_string();
            let Prompt::Messages(chat) = body::parse(Route::Chat, body.as_bytes()).unwrap().prompt
            else {
                panic!("a chat body");
            };
            let ours = ours_template.render(&chat, bos, eos);
            let ids = models.tokens(
                "m",
                body::parse(Route::Chat, body.as_bytes()).unwrap().prompt,
                1 << 20,
            );
            compared += 1;
            match (&ours, theirs.get("text").and_then(Value::as_str)) {
                (Ok(text), Some(expected)) => {
                    rendered += 1;
                    if text != expected {
                        failures.push(format!(
                            "{name}: text differs for {request}\n--- kvedge\n{text}\n--- transformers\n{expected}"
                        ));
                        continue;
                    }
                    let expected: Vec<u32> = serde_json::from_value(theirs["ids"].clone()).unwrap();
                    match ids {
                        Ok(Tokens::Ids(ids)) if ids == expected => {}
                        other => failures.push(format!(
                            "{name}: token ids differ for {request}: {other:?} against {expected:?}"
                        )),
                    }
                }
                // The template refuses the chat on both sides (roles that
                // must alternate, a system message it does not take).
                (Err(_), None) => {}
                (ours, _) => failures.push(format!(
                    "{name}: one side failed for {request}: kvedge {ours:?}, transformers {theirs}"
                )),
            }
        }
        eprintln!(
            "{name}: {rendered} of {} chats rendered on both sides (content as parts: {})",
            requests().len(),
            ours_template.takes_parts()
        );
        assert!(rendered >= 2, "{name}: only {rendered} chats rendered");
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} renderings differ:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}
