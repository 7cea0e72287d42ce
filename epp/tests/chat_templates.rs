//! Chat templates rendered by kvedge and by Python's jinja2 set up as
//! transformers' `apply_chat_template` sets it up (the renderer vLLM and
//! SGLang use): the same text for every template and conversation here, so
//! the picker's token ids are the engine's. Needs `python3` with `jinja2`;
//! without it the test says so and passes, unless `KVEDGE_REQUIRE_TOOLS`
//! is set (as in CI).

#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use serde_json::{Value, json};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/chat_templates");

/// Conversations of the shapes clients send.
fn conversations() -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Weather in a city, in °C", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello there"}]}),
        json!({"messages": [
            {"role": "system", "content": "  You are terse.\n"},
            {"role": "user", "content": "Summarise: the daemon reads engines' events."},
            {"role": "assistant", "content": "It indexes KV blocks."},
            {"role": "user", "content": "Grüße, 東京 and emoji 🎉 — fine?"},
        ]}),
        json!({"tools": tools, "messages": [
            {"role": "system", "content": "Use tools when useful."},
            {"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                "function": {"arguments": {"city": "Zürich"}, "name": "get_weather"}}]},
            {"role": "tool", "content": {"temperature": 21.5, "unit": "°C"}},
        ]}),
        json!({"messages": [
            {"role": "user", "content": "# a comment turn"},
            {"role": "user", "content": "  padded  ", "name": "alice"},
            {"role": "assistant", "content": "ok"},
        ]}),
    ]
}

/// Renders each job with `render.py`; `None` when Python or jinja2 is
/// missing.
fn python_renders(jobs: &[Value]) -> Option<Vec<Value>> {
    let mut child = Command::new("python3")
        .arg(format!("{DIR}/render.py"))
        .env("TZ", "UTC")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take().unwrap();
    for job in jobs {
        writeln!(stdin, "{job}").ok()?;
    }
    drop(stdin);
    let out: Vec<Value> = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect();
    let status = child.wait().ok()?;
    (status.success() && out.len() == jobs.len()).then_some(out)
}

#[test]
fn kvedge_renders_chat_templates_as_transformers_does() {
    let mut jobs = Vec::new();
    let mut ours = Vec::new();
    for name in ["multiline", "tools", "python_methods"] {
        let source = std::fs::read_to_string(format!("{DIR}/{name}.jinja")).unwrap();
        let env = kvedge_epp::template::environment(source.clone()).unwrap();
        let template = env.get_template("chat").unwrap();
        for conversation in conversations() {
            for generation in [true, false] {
                let mut context = conversation.clone();
                context["add_generation_prompt"] = json!(generation);
                context["bos_token"] = json!("<s>");
                context["eos_token"] = json!("</s>");
                if context.get("tools").is_none() {
                    context["tools"] = Value::Null;
                }
                let rendered = template
                    .render(minijinja::Value::from_serialize(&context))
                    .map_err(|e| e.to_string());
                ours.push((name, context.clone(), rendered));
                jobs.push(json!({"template": source, "context": context}));
            }
        }
    }
    let Some(theirs) = python_renders(&jobs) else {
        assert!(
            std::env::var_os("KVEDGE_REQUIRE_TOOLS").is_none(),
            "python3 with jinja2 is required (KVEDGE_REQUIRE_TOOLS)"
        );
        eprintln!("skipped: python3 with jinja2 is not installed");
        return;
    };
    let (mut same, mut both_failed) = (0, 0);
    for ((name, context, ours), theirs) in ours.iter().zip(&theirs) {
        match (ours, theirs.get("text").and_then(Value::as_str)) {
            (Ok(a), Some(b)) => {
                assert_eq!(a, b, "{name} over {context}");
                same += 1;
            }
            (Err(_), None) => both_failed += 1,
            (a, _) => panic!("{name} over {context}: kvedge {a:?}, transformers {theirs}"),
        }
    }
    // `python_methods` calls `startswith` on a tool result that is a
    // mapping: an error in both, with and without the generation prompt.
    assert_eq!((same, both_failed), (jobs.len() - 2, 2));
}

/// A template that raises fails in both, and kvedge says why.
#[test]
fn raise_exception_fails_the_render() {
    let source = std::fs::read_to_string(format!("{DIR}/python_methods.jinja")).unwrap();
    let env = kvedge_epp::template::environment(source).unwrap();
    let err = env
        .get_template("chat")
        .unwrap()
        .render(minijinja::Value::from_serialize(
            json!({"messages": [{"role": "robot", "content": "x"}]}),
        ))
        .unwrap_err();
    assert!(err.to_string().contains("unknown role robot"), "{err}");
}
