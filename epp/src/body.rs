//! OpenAI-compatible request bodies, read for routing: the model, and the
//! prompt as the engine will see it (text to tokenize, chat messages to
//! render with the model's template, or token ids already). Nothing else in
//! the body matters to the pick, and the body is forwarded unchanged.

use std::fmt;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

mod scan;

/// Which OpenAI route a request is on (from its `:path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// `/v1/completions`: `prompt` is text or token ids.
    Completions,
    /// `/v1/chat/completions`: `messages`, rendered by the chat template.
    Chat,
}

impl Route {
    /// The route of `path` (query string ignored); `None` for any other.
    pub fn of(path: &str) -> Option<Route> {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Route::Completions),
            "/v1/chat/completions" => Some(Route::Chat),
            _ => None,
        }
    }
}

/// What the pick needs from a body.
#[derive(Debug, PartialEq)]
pub struct Parsed {
    pub model: String,
    pub prompt: Prompt,
}

/// The prompt, before tokenization.
#[derive(Debug, PartialEq)]
pub enum Prompt {
    /// Completion text.
    Text(String),
    /// Completion token ids, used as they are.
    Tokens(Vec<u32>),
    /// A chat, for the chat template (boxed: the other prompts are a
    /// pointer and a length).
    Messages(Box<Chat>),
}

impl Prompt {
    /// A chat of `messages` with every other field at its default.
    pub fn chat(messages: Vec<Value>) -> Prompt {
        Prompt::Messages(Box::new(Chat::of(messages)))
    }
}

/// A chat request's fields that reach the chat template, as the client
/// sent them: the engine's OpenAI server turns them into the template's
/// context ([`crate::chat`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chat {
    /// Each an object with a string `role`.
    pub messages: Vec<Value>,
    /// `tools`: function definitions.
    pub tools: Option<Value>,
    /// `documents`: retrieval documents (dicts of strings).
    pub documents: Option<Value>,
    /// `chat_template_kwargs`: further variables for the template.
    pub kwargs: serde_json::Map<String, Value>,
    /// `add_generation_prompt` (default true).
    pub add_generation_prompt: bool,
    /// `continue_final_message` (default false).
    pub continue_final_message: bool,
    /// `reasoning_effort`, which templates read (and which turns thinking
    /// on or off where the template has `enable_thinking`).
    pub reasoning_effort: Option<String>,
    /// `tool_choice`: SGLang leaves the tools out of the template when it
    /// is `"none"`, and keeps only the named one.
    pub tool_choice: Option<Value>,
}

impl Chat {
    /// A chat of `messages` with every other field at its default.
    pub fn of(messages: Vec<Value>) -> Chat {
        Chat {
            messages,
            add_generation_prompt: true,
            ..Chat::default()
        }
    }
}

/// Why a body cannot be routed: answered to the client as a 400.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BodyError {
    #[error("the request body is not JSON: {0}")]
    NotJson(String),
    #[error("the request body has no `model`")]
    NoModel,
    #[error("`prompt` must be a string, a list of token ids, or a list holding one of either")]
    BadPrompt,
    #[error("a batch of {0} prompts cannot be routed to one worker; send them one at a time")]
    Batch(usize),
    #[error("`messages` must be a non-empty list of objects with a `role`")]
    BadMessages,
    #[error("the request has no `prompt`")]
    NoPrompt,
    #[error("`{field}` {expected}")]
    BadChatField {
        field: &'static str,
        expected: &'static str,
    },
    #[error("`chat_template_kwargs` may not set `{0}`")]
    ReservedKwarg(String),
}

#[derive(Debug, Deserialize, PartialEq)]
struct Body<P> {
    model: Option<String>,
    prompt: Option<P>,
    messages: Option<Value>,
    #[serde(default)]
    tools: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    #[serde(default)]
    add_generation_prompt: Option<Value>,
    #[serde(default)]
    continue_final_message: Option<Value>,
    #[serde(default)]
    reasoning_effort: Option<Value>,
    #[serde(default)]
    tool_choice: Option<Value>,
}

impl<P> Body<P> {
    /// The same body with its prompt turned by `f`.
    fn map_prompt<Q>(self, f: impl FnOnce(P) -> Q) -> Body<Q> {
        Body {
            model: self.model,
            prompt: self.prompt.map(f),
            messages: self.messages,
            tools: self.tools,
            documents: self.documents,
            chat_template_kwargs: self.chat_template_kwargs,
            add_generation_prompt: self.add_generation_prompt,
            continue_final_message: self.continue_final_message,
            reasoning_effort: self.reasoning_effort,
            tool_choice: self.tool_choice,
        }
    }
}

/// Reads `body` for `route`.
pub fn parse(route: Route, body: &[u8]) -> Result<Parsed, BodyError> {
    // A body as nearly all are is read in one pass, its token ids (if
    // the prompt is a list of them) by a byte loop ([`scan`]); any other
    // by serde_json.
    let b = match scan::read(body, scan::Want::Any) {
        Some(b) => b,
        None => by_serde(body)?,
    };
    fields(route, b)
}

/// [`parse`] by serde_json alone: the reference [`scan`] is held to.
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn parse_by_serde(route: Route, body: &[u8]) -> Result<Parsed, BodyError> {
    fields(route, by_serde(body)?)
}

/// `body` read by serde_json: a prompt that is a text or a list of token
/// ids, as nearly all are, in one pass; any other shape fails that
/// reading, and the body is read again to say what is wrong with it.
fn by_serde(body: &[u8]) -> Result<Body<PromptField>, BodyError> {
    match serde_json::from_slice::<Body<Strict>>(body) {
        Ok(b) => Ok(b.map_prompt(|p| p.0)),
        Err(_) => serde_json::from_slice::<Body<PromptField>>(body)
            .map_err(|e| BodyError::NotJson(e.to_string())),
    }
}

/// A completion body whose prompt is a list of token ids, read as
/// [`parse`] reads it; `None` for any other body (or one that takes
/// serde_json to read), known as soon as its prompt is seen. Reading ids
/// costs about a nanosecond a byte, so such a body may be read where a
/// text to tokenize may not.
pub fn token_ids(body: &[u8]) -> Option<Result<Parsed, BodyError>> {
    scan::read(body, scan::Want::Ids).map(|b| fields(Route::Completions, b))
}

/// What the pick needs from a body's fields.
fn fields(route: Route, mut b: Body<PromptField>) -> Result<Parsed, BodyError> {
    let model = b
        .model
        .take()
        .filter(|m| !m.is_empty())
        .ok_or(BodyError::NoModel)?;
    let prompt = match route {
        Route::Completions => match b.prompt.take().ok_or(BodyError::NoPrompt)? {
            PromptField::Text(s) => Prompt::Text(s),
            PromptField::Ids(ids) => Prompt::Tokens(ids),
            PromptField::Batch(n) => return Err(BodyError::Batch(n)),
            PromptField::Bad => return Err(BodyError::BadPrompt),
        },
        Route::Chat => match b.messages.take() {
            Some(Value::Array(m))
                if !m.is_empty()
                    && m.iter()
                        .all(|m| m.get("role").is_some_and(Value::is_string)) =>
            {
                Prompt::Messages(Box::new(chat(m, b)?))
            }
            _ => return Err(BodyError::BadMessages),
        },
    };
    Ok(Parsed { model, prompt })
}

/// A chat's fields, checked as the engine checks them: a field of the
/// wrong type is the client's error (the engine answers it with a 400
/// too), and `null` is the field's default.
fn chat(messages: Vec<Value>, b: Body<PromptField>) -> Result<Chat, BodyError> {
    fn flag(v: Option<Value>, field: &'static str, default: bool) -> Result<bool, BodyError> {
        match v {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(b),
            Some(_) => Err(BodyError::BadChatField {
                field,
                expected: "must be a boolean",
            }),
        }
    }
    let list = |v: Option<Value>, field: &'static str| match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) if items.iter().all(Value::is_object) => {
            Ok(Some(Value::Array(items)))
        }
        Some(_) => Err(BodyError::BadChatField {
            field,
            expected: "must be a list of objects",
        }),
    };
    let kwargs = match b.chat_template_kwargs {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(BodyError::BadChatField {
                field: "chat_template_kwargs",
                expected: "must be an object",
            });
        }
    };
    // The engine refuses these: the template is its own to choose, and
    // it decides whether to tokenize.
    if let Some(k) = ["chat_template", "tokenize"]
        .into_iter()
        .find(|k| kwargs.contains_key(*k))
    {
        return Err(BodyError::ReservedKwarg(k.to_owned()));
    }
    let reasoning_effort = match b.reasoning_effort {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => {
            return Err(BodyError::BadChatField {
                field: "reasoning_effort",
                expected: "must be a string",
            });
        }
    };
    let add_generation_prompt = flag(b.add_generation_prompt, "add_generation_prompt", true)?;
    let continue_final_message = flag(b.continue_final_message, "continue_final_message", false)?;
    if add_generation_prompt && continue_final_message {
        return Err(BodyError::BadChatField {
            field: "continue_final_message",
            expected: "cannot be true while `add_generation_prompt` is",
        });
    }
    Ok(Chat {
        messages,
        tools: list(b.tools, "tools")?,
        documents: list(b.documents, "documents")?,
        tool_choice: b.tool_choice.filter(|v| !v.is_null()),
        kwargs,
        add_generation_prompt,
        continue_final_message,
        reasoning_effort,
    })
}

/// A completion's `prompt` as the body has it, read without a JSON tree
/// in between: token ids go straight into their list (a tree of 2,000
/// numbers cost more than the rest of a decision). A prompt of the wrong
/// shape is read to its end and said to be one, so that the body's other
/// errors and this one are told apart as before.
#[derive(Debug, PartialEq)]
enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    /// A list of `n` > 1 prompts.
    Batch(usize),
    /// Anything else: not a string, a list of token ids, or a list holding
    /// one of either.
    Bad,
}

impl<'de> Deserialize<'de> for PromptField {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FieldVisitor)
    }
}

/// A prompt that is a text or a non-empty list of token ids, or an error
/// (which [`PromptField`] then explains). Token ids are read as `u32`s by
/// the parser's own integer path: a third faster than asking each element
/// what it is.
struct Strict(PromptField);

impl<'de> Deserialize<'de> for Strict {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Strict;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a text or a list of token ids")
            }

            fn visit_str<E: de::Error>(self, s: &str) -> Result<Strict, E> {
                Ok(Strict(PromptField::Text(s.to_owned())))
            }

            fn visit_string<E: de::Error>(self, s: String) -> Result<Strict, E> {
                Ok(Strict(PromptField::Text(s)))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Strict, A::Error> {
                let mut ids = Vec::with_capacity(256);
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                if ids.is_empty() {
                    return Err(de::Error::invalid_length(0, &self));
                }
                Ok(Strict(PromptField::Ids(ids)))
            }
        }
        d.deserialize_any(V)
    }
}

/// One element of a `prompt` list.
enum Item {
    /// A number: a token id, or `None` for one that is not a `u32`.
    Id(Option<u32>),
    Text(String),
    /// A list: of token ids, or `None` when anything else is in it.
    Ids(Option<Vec<u32>>),
    Other,
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ItemVisitor)
    }
}

/// Token ids from the rest of `seq` onto `ids`; whether every one was one.
fn read_ids<'de, A: SeqAccess<'de>>(mut seq: A, ids: &mut Vec<u32>) -> Result<bool, A::Error> {
    let mut all = true;
    while let Some(item) = seq.next_element::<Item>()? {
        match item {
            Item::Id(Some(id)) if all => ids.push(id),
            _ => all = false,
        }
    }
    Ok(all)
}

struct FieldVisitor;

impl<'de> Visitor<'de> for FieldVisitor {
    type Value = PromptField;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptField, E> {
        Ok(PromptField::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<PromptField, E> {
        Ok(PromptField::Text(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptField, A::Error> {
        let first = match seq.next_element::<Item>()? {
            None => return Ok(PromptField::Bad),
            Some(Item::Id(Some(id))) => {
                let mut ids = Vec::with_capacity(256);
                ids.push(id);
                let all = read_ids(seq, &mut ids)?;
                return Ok(if all {
                    PromptField::Ids(ids)
                } else {
                    PromptField::Bad
                });
            }
            Some(first) => first,
        };
        let mut n = 1;
        while seq.next_element::<de::IgnoredAny>()?.is_some() {
            n += 1;
        }
        Ok(match first {
            // A list of several numbers, the first not a token id.
            Item::Id(_) | Item::Other => PromptField::Bad,
            _ if n > 1 => PromptField::Batch(n),
            Item::Text(s) => PromptField::Text(s),
            Item::Ids(Some(ids)) => PromptField::Ids(ids),
            Item::Ids(None) => PromptField::Bad,
        })
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PromptField, A::Error> {
        skip_map(map)?;
        Ok(PromptField::Bad)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<PromptField, E> {
        Ok(PromptField::Bad)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<PromptField, E> {
        Ok(PromptField::Bad)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<PromptField, E> {
        Ok(PromptField::Bad)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<PromptField, E> {
        Ok(PromptField::Bad)
    }

    fn visit_unit<E: de::Error>(self) -> Result<PromptField, E> {
        Ok(PromptField::Bad)
    }
}

/// Reads past an object where a prompt or its element was expected.
fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map
        .next_entry::<de::IgnoredAny, de::IgnoredAny>()?
        .is_some()
    {}
    Ok(())
}

struct ItemVisitor;

impl<'de> Visitor<'de> for ItemVisitor {
    type Value = Item;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt's element")
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Item, E> {
        Ok(Item::Id(u32::try_from(n).ok()))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Item, E> {
        Ok(Item::Id(u32::try_from(n).ok()))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Item, E> {
        Ok(Item::Id(None))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
        Ok(Item::Text(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Item, E> {
        Ok(Item::Text(s))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Item, A::Error> {
        let mut ids = Vec::with_capacity(256);
        let all = read_ids(seq, &mut ids)?;
        Ok(Item::Ids(all.then_some(ids)))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Item, A::Error> {
        skip_map(map)?;
        Ok(Item::Other)
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item, E> {
        Ok(Item::Other)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
        Ok(Item::Other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_take_text_or_token_ids() {
        let p = parse(Route::Completions, br#"{"model":"m","prompt":"hi"}"#).unwrap();
        assert_eq!(p.model, "m");
        assert_eq!(p.prompt, Prompt::Text("hi".into()));
        let p = parse(Route::Completions, br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(p.prompt, Prompt::Tokens(vec![1, 2, 3]));
        let p = parse(Route::Completions, br#"{"model":"m","prompt":[[4,5]]}"#).unwrap();
        assert_eq!(p.prompt, Prompt::Tokens(vec![4, 5]));
        let p = parse(Route::Completions, br#"{"model":"m","prompt":["x"]}"#).unwrap();
        assert_eq!(p.prompt, Prompt::Text("x".into()));
    }

    #[test]
    fn prompts_of_the_wrong_shape_are_told_apart() {
        let e = |b: &str| parse(Route::Completions, b.as_bytes()).unwrap_err();
        for bad in [
            "[1.5]",
            "[1, \"x\"]",
            "[[1, \"x\"]]",
            "[[1, [2]]]",
            "[]",
            "true",
            "7",
            "{\"a\": [1]}",
            "[{\"a\": 1}]",
            "[null]",
        ] {
            assert_eq!(
                e(&format!(r#"{{"model":"m","prompt":{bad}}}"#)),
                BodyError::BadPrompt,
                "{bad}"
            );
        }
        assert_eq!(
            e(r#"{"model":"m","prompt":[[1,2],[3]]}"#),
            BodyError::Batch(2)
        );
        assert_eq!(
            e(r#"{"model":"m","prompt":["a",[1],3]}"#),
            BodyError::Batch(3)
        );
        assert_eq!(e(r#"{"model":"m","prompt":null}"#), BodyError::NoPrompt);
        // Broken JSON inside the prompt is still broken JSON.
        assert!(matches!(
            e(r#"{"model":"m","prompt":[1,2"#),
            BodyError::NotJson(_)
        ));
        let p = parse(Route::Completions, br#"{"model":"m","prompt":[[]]}"#).unwrap();
        assert_eq!(p.prompt, Prompt::Tokens(vec![]));
    }

    /// The prompt as a JSON tree reads it: the reference the direct
    /// reader is held to.
    fn by_tree(p: Value) -> Result<Prompt, BodyError> {
        let ids = |items: &[Value]| -> Result<Vec<u32>, BodyError> {
            items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|n| u32::try_from(n).ok())
                        .ok_or(BodyError::BadPrompt)
                })
                .collect()
        };
        match p {
            Value::String(s) => Ok(Prompt::Text(s)),
            Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
                ids(&items).map(Prompt::Tokens)
            }
            Value::Array(items) => match items.as_slice() {
                [Value::String(s)] => Ok(Prompt::Text(s.clone())),
                [Value::Array(inner)] => ids(inner).map(Prompt::Tokens),
                [] | [_] => Err(BodyError::BadPrompt),
                [
                    Value::Number(_) | Value::Bool(_) | Value::Null | Value::Object(_),
                    ..,
                ] => Err(BodyError::BadPrompt),
                more => Err(BodyError::Batch(more.len())),
            },
            _ => Err(BodyError::BadPrompt),
        }
    }

    fn json_prompt() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            (0u64..10).prop_map(Value::from),
            any::<u32>().prop_map(Value::from),
            (u64::from(u32::MAX)..u64::MAX).prop_map(Value::from),
            (i64::MIN..0).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-z\\\\\"é]{0,4}".prop_map(Value::from),
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(("[a-c]", inner), 0..3)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn the_direct_reader_reads_every_prompt_as_a_json_tree_would(p in json_prompt()) {
            let body = serde_json::json!({"model": "m", "prompt": p}).to_string();
            let direct = parse(Route::Completions, body.as_bytes()).map(|p| p.prompt);
            let expected = if p.is_null() { Err(BodyError::NoPrompt) } else { by_tree(p) };
            proptest::prop_assert_eq!(direct, expected);
        }
    }

    #[test]
    fn token_id_bodies_are_told_apart_and_read_as_parse_reads_them() {
        for body in [
            r#"{"model":"m","prompt":[1,2,3],"stream":true}"#,
            r#"{"prompt":[1, 2]}"#,
            r#"{"model":"","prompt":[7]}"#,
        ] {
            assert_eq!(
                token_ids(body.as_bytes()),
                Some(parse(Route::Completions, body.as_bytes())),
                "{body}"
            );
        }
        for body in [
            r#"{"model":"m","prompt":"text"}"#,
            r#"{"model":"m","prompt":[[1,2]]}"#,
            r#"{"model":"m","prompt":[1.5]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            r#"{"model":"m"}"#,
            r#"{"model":"m","prompt":[1,2"#,
        ] {
            assert_eq!(token_ids(body.as_bytes()), None, "{body}");
        }
    }

    #[test]
    fn chat_takes_messages() {
        let p = parse(
            Route::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        )
        .unwrap();
        assert!(
            matches!(p.prompt, Prompt::Messages(ref c) if c.messages.len() == 1 && c.add_generation_prompt)
        );
    }

    #[test]
    fn bad_bodies_say_what_is_wrong() {
        let e = |route, b: &[u8]| parse(route, b).unwrap_err();
        assert!(matches!(e(Route::Completions, b"{"), BodyError::NotJson(_)));
        assert_eq!(
            e(Route::Completions, br#"{"prompt":"x"}"#),
            BodyError::NoModel
        );
        assert_eq!(
            e(Route::Completions, br#"{"model":"m"}"#),
            BodyError::NoPrompt
        );
        assert_eq!(
            e(Route::Completions, br#"{"model":"m","prompt":[-1]}"#),
            BodyError::BadPrompt
        );
        assert_eq!(
            e(
                Route::Completions,
                br#"{"model":"m","prompt":[1, 4294967296]}"#
            ),
            BodyError::BadPrompt
        );
        assert_eq!(
            e(Route::Completions, br#"{"model":"m","prompt":["a","b"]}"#),
            BodyError::Batch(2)
        );
        assert_eq!(
            e(Route::Chat, br#"{"model":"m","messages":[]}"#),
            BodyError::BadMessages
        );
        assert_eq!(
            e(
                Route::Chat,
                br#"{"model":"m","messages":[{"content":"x"}]}"#
            ),
            BodyError::BadMessages
        );
    }

    #[test]
    fn a_chats_template_fields_are_read_and_checked() {
        let chat = |extra: &str| {
            let body =
                format!(r#"{{"model":"m","messages":[{{"role":"user","content":"x"}}]{extra}}}"#);
            match parse(Route::Chat, body.as_bytes()) {
                Ok(Parsed {
                    prompt: Prompt::Messages(c),
                    ..
                }) => Ok(*c),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e),
            }
        };
        let c = chat(
            r#","tools":[{"type":"function","function":{"name":"f"}}],"documents":[{"title":"t"}],"chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":false,"reasoning_effort":"low","tool_choice":"none""#,
        )
        .unwrap();
        assert!(c.tools.is_some() && c.documents.is_some());
        assert_eq!(c.kwargs.get("enable_thinking"), Some(&Value::Bool(false)));
        assert!(!c.add_generation_prompt && !c.continue_final_message);
        assert_eq!(c.reasoning_effort.as_deref(), Some("low"));
        assert_eq!(c.tool_choice, Some(Value::from("none")));
        // `null` is the default.
        assert!(
            chat(r#","add_generation_prompt":null,"tools":null"#)
                .unwrap()
                .add_generation_prompt
        );
        for (extra, field) in [
            (r#","tools":{"f":1}"#, "tools"),
            (r#","documents":["x"]"#, "documents"),
            (r#","chat_template_kwargs":[1]"#, "chat_template_kwargs"),
            (r#","add_generation_prompt":"yes""#, "add_generation_prompt"),
            (r#","reasoning_effort":3"#, "reasoning_effort"),
            (
                r#","continue_final_message":true"#,
                "continue_final_message",
            ),
        ] {
            match chat(extra) {
                Err(BodyError::BadChatField { field: f, .. }) => assert_eq!(f, field, "{extra}"),
                other => panic!("{extra}: {other:?}"),
            }
        }
        assert_eq!(
            chat(r#","chat_template_kwargs":{"chat_template":"{{ 1 }}"}"#),
            Err(BodyError::ReservedKwarg("chat_template".into()))
        );
    }

    #[test]
    fn routes_are_read_from_the_path() {
        assert_eq!(Route::of("/v1/completions"), Some(Route::Completions));
        assert_eq!(Route::of("/v1/chat/completions?x=1"), Some(Route::Chat));
        assert_eq!(Route::of("/v1/models"), None);
    }
}
