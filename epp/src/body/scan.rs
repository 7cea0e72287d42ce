//! A request body read in one pass without serde_json's per-element path
//! through a token-id prompt. serde_json asks the visitor for each of a
//! long list's elements in turn, which was most of a front door's decision
//! with token ids; a byte loop reads the same list several times faster
//! (BENCHMARKS.md, "Endpoint picker").
//!
//! The body's top-level object is cut into its members here. A `prompt`
//! that is a list of plainly written `u32`s is read by the loop; every
//! other value is read where it stands by serde_json, as the type the
//! derived `Body<Strict>` gives it (each byte read once), so a body read
//! here comes out exactly as it would there. Anything unusual (an escape
//! in a key, a duplicate field, a number written `01` or `1e3` in the
//! list, `messages` or `tools` nested near serde_json's recursion limit, a top level
//! that is not an object) returns `None`, and the caller reads the body
//! with serde_json, which also words any error.

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::Value;

use super::{Body, PromptField, Strict};

/// `messages` nested deeper than this is left to serde_json: its
/// recursion limit (128) counts the body's own object when it reads the
/// whole body, and not when it reads the value alone.
const MAX_DEPTH: usize = 100;

/// What a read is for.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum Want {
    /// The body, whatever its prompt.
    Any,
    /// Only a body whose prompt is a list of token ids: any other gives
    /// up (`None`) as soon as its prompt is seen, or at the end when it
    /// has none.
    Ids,
}

/// `body` as `serde_json::from_slice::<Body<Strict>>` would read it, or
/// `None` when it takes serde_json to say (or it is not what is wanted).
pub(super) fn read(body: &[u8], want: Want) -> Option<Body<PromptField>> {
    let mut s = Cursor { b: body, i: 0 };
    // Each field once: `Some(None)` is a field that was `null`.
    let mut model: Option<Option<String>> = None;
    let mut prompt: Option<Option<PromptField>> = None;
    let mut messages: Option<Option<Value>> = None;
    // The chat's other fields, each read as the derived `Body` reads it.
    let mut tools: Option<Option<Value>> = None;
    let mut documents: Option<Option<Value>> = None;
    let mut kwargs: Option<Option<Value>> = None;
    let mut add_generation_prompt: Option<Option<Value>> = None;
    let mut continue_final_message: Option<Option<Value>> = None;
    let mut reasoning_effort: Option<Option<Value>> = None;
    let mut tool_choice: Option<Option<Value>> = None;
    s.ws();
    s.eat(b'{')?;
    s.ws();
    if s.peek() == Some(b'}') {
        s.i += 1;
    } else {
        loop {
            let key = s.key()?;
            s.ws();
            s.eat(b':')?;
            s.ws();
            match key {
                b"model" => once(&mut model, s.serde()?)?,
                b"prompt" => once(&mut prompt, s.prompt(want)?)?,
                b"messages" => once(&mut messages, s.nested()?)?,
                b"tools" => once(&mut tools, s.nested()?)?,
                b"documents" => once(&mut documents, s.nested()?)?,
                b"chat_template_kwargs" => once(&mut kwargs, s.nested()?)?,
                b"add_generation_prompt" => once(&mut add_generation_prompt, s.serde()?)?,
                b"continue_final_message" => once(&mut continue_final_message, s.serde()?)?,
                b"reasoning_effort" => once(&mut reasoning_effort, s.serde()?)?,
                b"tool_choice" => once(&mut tool_choice, s.nested()?)?,
                _ => {
                    s.serde::<IgnoredAny>()?;
                }
            }
            s.ws();
            match s.next()? {
                b',' => s.ws(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    if want == Want::Ids && !matches!(prompt, Some(Some(PromptField::Ids(_)))) {
        return None;
    }
    (s.i == body.len()).then(|| Body {
        model: model.flatten(),
        prompt: prompt.flatten(),
        messages: messages.flatten(),
        tools: tools.flatten(),
        documents: documents.flatten(),
        chat_template_kwargs: kwargs.flatten(),
        add_generation_prompt: add_generation_prompt.flatten(),
        continue_final_message: continue_final_message.flatten(),
        reasoning_effort: reasoning_effort.flatten(),
        tool_choice: tool_choice.flatten(),
    })
}

/// How deeply `v` nests: 0 for a scalar.
fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Sets a field seen for the first time; `None` for a duplicate (which
/// serde_json refuses).
fn once<T>(slot: &mut Option<T>, v: T) -> Option<()> {
    match slot {
        Some(_) => None,
        None => {
            *slot = Some(v);
            Some(())
        }
    }
}

/// A position in the body.
struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.next()? == c).then_some(())
    }

    /// Past JSON's whitespace (and nothing else).
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.i += 1;
        }
    }

    /// A member's name without its quotes: UTF-8 with no escape and no
    /// control character, or `None`.
    fn key(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.i;
        loop {
            match self.next()? {
                b'"' => break,
                b'\\' | 0..0x20 => return None,
                _ => {}
            }
        }
        let key = &self.b[start..self.i - 1];
        std::str::from_utf8(key).ok()?;
        Some(key)
    }

    /// The value here, read by serde_json as `T` (and nothing after it
    /// but what may end a value), the cursor moved past it.
    fn serde<T: Deserialize<'a>>(&mut self) -> Option<T> {
        let mut values = serde_json::Deserializer::from_slice(&self.b[self.i..]).into_iter();
        let v = values.next()?.ok()?;
        self.i += values.byte_offset();
        Some(v)
    }

    /// A value that may nest (`messages`, `tools`), or `None` when it
    /// nests deeper than [`MAX_DEPTH`].
    fn nested(&mut self) -> Option<Option<Value>> {
        let v: Option<Value> = self.serde()?;
        match &v {
            Some(v) if depth(v) > MAX_DEPTH => None,
            _ => Some(v),
        }
    }

    /// The `prompt` member's value: a list of token ids by the loop, any
    /// other value (or a list the loop does not take) by serde_json, or
    /// `None` when only token ids are wanted.
    fn prompt(&mut self, want: Want) -> Option<Option<PromptField>> {
        let start = self.i;
        if self.peek() == Some(b'[') {
            // About five bytes an id ("1234,"): one allocation for most lists.
            let mut ids = Vec::with_capacity((self.b.len() - start) / 5 + 1);
            if self.ids(&mut ids).is_some() {
                return Some(Some(PromptField::Ids(ids)));
            }
            self.i = start;
        }
        if want == Want::Ids {
            return None;
        }
        let strict: Option<Strict> = self.serde()?;
        Some(strict.map(|s| s.0))
    }

    /// A non-empty list of `u32`s, each written as JSON writes an integer
    /// (no sign, no leading zero, no fraction or exponent), onto `ids`;
    /// `None` for anything else.
    fn ids(&mut self, ids: &mut Vec<u32>) -> Option<()> {
        self.eat(b'[')?;
        self.ws();
        loop {
            let b = self.b;
            let mut i = self.i;
            let id = match *b.get(i)? {
                b'0' => {
                    i += 1;
                    if b.get(i).is_some_and(u8::is_ascii_digit) {
                        return None;
                    }
                    0
                }
                d @ b'1'..=b'9' => {
                    i += 1;
                    let first = i;
                    let mut n = u64::from(d - b'0');
                    while let Some(&d @ b'0'..=b'9') = b.get(i) {
                        // Ten digits at most: u32::MAX has ten.
                        if i - first == 9 {
                            return None;
                        }
                        n = n * 10 + u64::from(d - b'0');
                        i += 1;
                    }
                    u32::try_from(n).ok()?
                }
                _ => return None,
            };
            ids.push(id);
            self.i = i;
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b']' => return Some(()),
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// serde_json's reading: the reference this reader is held to.
    fn by_serde(body: &[u8]) -> Option<Body<PromptField>> {
        serde_json::from_slice::<Body<Strict>>(body)
            .ok()
            .map(|b| b.map_prompt(|p| p.0))
    }

    fn ids(b: &str) -> Option<Vec<u32>> {
        match read(b.as_bytes(), Want::Any)?.prompt? {
            PromptField::Ids(ids) => Some(ids),
            _ => None,
        }
    }

    #[test]
    fn plain_token_id_bodies_are_read_here() {
        let body = r#" { "model" : "m", "stream":true, "prompt" : [ 0, 7,4294967295 ,12 ] ,"max_tokens":16}
"#;
        assert_eq!(ids(body), Some(vec![0, 7, u32::MAX, 12]));
        let b = read(body.as_bytes(), Want::Any).unwrap();
        assert_eq!(b.model.as_deref(), Some("m"));
        assert_eq!(Some(b), by_serde(body.as_bytes()));
        // Other values of every kind beside the prompt.
        let body = r#"{"model":"m","x":{"a":[1,{"b":"]}\"["}]},"y":-1.5e3,"z":null,"prompt":[1,2],"messages":[{"role":"user"}]}"#;
        assert_eq!(ids(body), Some(vec![1, 2]));
        assert_eq!(read(body.as_bytes(), Want::Any), by_serde(body.as_bytes()));
        // A text prompt and a null one are read by serde_json in place.
        let b = read(br#"{"model":"m","prompt":"a \"b\" \u00e9"}"#, Want::Any).unwrap();
        assert_eq!(b.prompt, Some(PromptField::Text("a \"b\" é".into())));
        assert_eq!(
            read(br#"{"model":null,"prompt":null}"#, Want::Any)
                .unwrap()
                .prompt,
            None
        );
        assert_eq!(read(b"{}", Want::Any).unwrap().model, None);
    }

    #[test]
    fn anything_unusual_is_left_to_serde_json() {
        for body in [
            // Not an integer as JSON writes one, or not a u32.
            r#"{"model":"m","prompt":[01]}"#,
            r#"{"model":"m","prompt":[-1]}"#,
            r#"{"model":"m","prompt":[1e3]}"#,
            r#"{"model":"m","prompt":[1.0]}"#,
            r#"{"model":"m","prompt":[4294967296]}"#,
            r#"{"model":"m","prompt":[12345678901]}"#,
            r#"{"model":"m","prompt":[]}"#,
            r#"{"model":"m","prompt":[1,]}"#,
            r#"{"model":"m","prompt":[1 2]}"#,
            r#"{"model":"m","prompt":[[1]]}"#,
            // Duplicates, escaped names, broken structure.
            r#"{"model":"m","model":"n","prompt":[1]}"#,
            r#"{"model":"m","prompt":null,"prompt":[1]}"#,
            r#"{"mod\u0065l":"m","prompt":[1]}"#,
            r#"{"model":"m","prompt":[1]"#,
            r#"{"model":"m","prompt":[1]} x"#,
            r#"{"model":"m","prompt":[1],}"#,
            r#"{"model":"m" "prompt":[1]}"#,
            r#"["m",[1],null]"#,
            "{\"model\":\"m\",\u{a0}\"prompt\":[1]}",
            "{\"model\":\"m\x01\",\"prompt\":[1]}",
        ] {
            let fast = read(body.as_bytes(), Want::Any);
            assert!(
                fast.is_none() || fast == by_serde(body.as_bytes()),
                "{body}: {fast:?}"
            );
            assert!(
                !matches!(
                    fast,
                    Some(Body {
                        prompt: Some(PromptField::Ids(_)),
                        ..
                    })
                ),
                "{body} was read as token ids here"
            );
        }
        // Messages nested near serde_json's limit are its to refuse or
        // not; other members it skips at any depth, as here.
        for (n, near) in [
            (100, false),
            (101, true),
            (127, true),
            (128, true),
            (300, false),
        ] {
            let nested = format!("{}1{}", "[".repeat(n), "]".repeat(n));
            for member in ["messages", "x"] {
                let body = format!(r#"{{"model":"m","{member}":{nested},"prompt":[1]}}"#);
                let fast = read(body.as_bytes(), Want::Any);
                if member == "messages" && near {
                    assert_eq!(fast, None, "{member} {n}");
                } else if member == "x" {
                    assert_eq!(fast, by_serde(body.as_bytes()), "{member} {n}");
                    assert!(fast.is_some(), "{member} {n}");
                } else {
                    assert!(
                        fast.is_none() || fast == by_serde(body.as_bytes()),
                        "{member} {n}"
                    );
                }
            }
        }
    }

    /// A member's value as text: token-id lists written every way JSON
    /// allows and some it does not, and other values.
    fn value() -> impl Strategy<Value = String> {
        let id = prop_oneof![
            30 => any::<u32>().prop_map(|n| n.to_string()),
            10 => (0u32..10).prop_map(|n| n.to_string()),
            1 => Just("4294967295".to_owned()),
            1 => Just("4294967296".to_owned()),
            1 => Just("99999999999".to_owned()),
            1 => Just("00".to_owned()),
            1 => Just("01".to_owned()),
            1 => Just("-0".to_owned()),
            1 => Just("-3".to_owned()),
            1 => Just("2.0".to_owned()),
            1 => Just("5e2".to_owned()),
            1 => Just("\"7\"".to_owned()),
            1 => Just("[1]".to_owned()),
            1 => Just("null".to_owned()),
            1 => Just(String::new()),
        ];
        let ws = "[ \t\n\r]{0,2}";
        let list = proptest::collection::vec((ws, id, ws), 0..5).prop_map(|items| {
            let items: Vec<String> = items
                .into_iter()
                .map(|(a, id, b)| format!("{a}{id}{b}"))
                .collect();
            format!("[{}]", items.join(","))
        });
        let plain_ids = proptest::collection::vec(any::<u32>(), 1..40)
            .prop_map(|ids| serde_json::to_string(&ids).unwrap());
        prop_oneof![
            6 => list,
            4 => plain_ids,
            1 => "\"[a-z\\\\\"\u{1}é\\]\\[{}]{0,5}\"",
            1 => "[a-z0-9\\[\\]{},:\" .-]{0,8}",
            1 => Just("null".to_owned()),
            1 => Just("{\"a\":[\"]\",{\"b\":\"}\"}]}".to_owned()),
            1 => Just("[[1,2]]".to_owned()),
            1 => Just("[\"x\"]".to_owned()),
        ]
    }

    /// A body: members in any order, named as routing reads them or not,
    /// spaced every way, sometimes cut short or with a byte put in.
    fn body() -> impl Strategy<Value = Vec<u8>> {
        // Names with values mostly of their kind: a model's a string.
        let model = prop_oneof![
            4 => "\"[a-z\\\\\"é]{0,3}\"",
            1 => Just("null".to_owned()),
            1 => value(),
        ];
        let named = prop_oneof![
            3 => (Just("model"), model),
            4 => (Just("prompt"), value()),
            1 => (Just("messages"), value()),
            1 => (Just("stream"), value()),
            1 => (Just("mod\\u0065l"), value()),
            1 => (Just("x"), value()),
        ];
        let ws = "[ \t\n\r]{0,2}";
        let member = (ws, named, ws, ws, ws)
            .prop_map(|(a, (n, v), b, c, d)| format!("{a}\"{n}\"{b}:{c}{v}{d}"));
        let edit = prop_oneof![
            4 => Just(None),
            1 => (any::<proptest::sample::Index>(), any::<u8>()).prop_map(Some),
        ];
        (proptest::collection::vec(member, 0..4), ws, edit).prop_map(|(members, ws, edit)| {
            let mut body = format!("{ws}{{{}}}{ws}", members.join(",")).into_bytes();
            match edit {
                // A byte put in, or (for a zero) the body cut there.
                Some((at, 0)) => body.truncate(at.index(body.len())),
                Some((at, c)) => body.insert(at.index(body.len() + 1), c),
                None => {}
            }
            body
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn a_body_read_here_reads_as_serde_json_reads_it(body in body()) {
            let any = read(&body, Want::Any);
            if any.is_some() {
                prop_assert_eq!(&any, &by_serde(&body), "{}", String::from_utf8_lossy(&body));
            }
            // Wanting only token ids reads the same body or gives up.
            let is_ids = matches!(any, Some(Body { prompt: Some(PromptField::Ids(_)), .. }));
            let ids = read(&body, Want::Ids);
            prop_assert_eq!(ids.as_ref(), any.as_ref().filter(|_| is_ids));
        }

        #[test]
        fn a_plainly_written_token_id_body_is_always_read_here(
            ids in proptest::collection::vec(any::<u32>(), 1..300),
            pretty: bool,
        ) {
            let v = serde_json::json!({"model": "m", "stream": true, "prompt": ids, "max_tokens": 8});
            let body = if pretty { serde_json::to_string_pretty(&v) } else { serde_json::to_string(&v) }.unwrap();
            let fast = read(body.as_bytes(), Want::Any);
            prop_assert_eq!(&read(body.as_bytes(), Want::Ids), &fast);
            prop_assert_eq!(fast.as_ref().and_then(|b| b.prompt.as_ref()), Some(&PromptField::Ids(ids)));
            prop_assert_eq!(fast, by_serde(body.as_bytes()));
        }
    }
}
