//! OpenAI-compatible request bodies, read for routing: the model, and the
//! prompt as the engine will see it (text to tokenize, chat messages to
//! render with the model's template, or token ids already). Nothing else in
//! the body matters to the pick, and the body is forwarded unchanged.

use serde::Deserialize;
use serde_json::Value;

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
    /// Chat messages (each an object with `role` and `content`), for the
    /// chat template.
    Messages(Vec<Value>),
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
}

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    prompt: Option<Value>,
    messages: Option<Value>,
}

/// Reads `body` for `route`.
pub fn parse(route: Route, body: &[u8]) -> Result<Parsed, BodyError> {
    let b: Body = serde_json::from_slice(body).map_err(|e| BodyError::NotJson(e.to_string()))?;
    let model = b
        .model
        .filter(|m| !m.is_empty())
        .ok_or(BodyError::NoModel)?;
    let prompt = match route {
        Route::Completions => completion_prompt(b.prompt.ok_or(BodyError::NoPrompt)?)?,
        Route::Chat => match b.messages {
            Some(Value::Array(m))
                if !m.is_empty()
                    && m.iter()
                        .all(|m| m.get("role").is_some_and(Value::is_string)) =>
            {
                Prompt::Messages(m)
            }
            _ => return Err(BodyError::BadMessages),
        },
    };
    Ok(Parsed { model, prompt })
}

fn completion_prompt(p: Value) -> Result<Prompt, BodyError> {
    match p {
        Value::String(s) => Ok(Prompt::Text(s)),
        Value::Array(items) => {
            if items.iter().all(Value::is_number) {
                return token_ids(&items).map(Prompt::Tokens);
            }
            match items.as_slice() {
                [Value::String(s)] => Ok(Prompt::Text(s.clone())),
                [Value::Array(ids)] => token_ids(ids).map(Prompt::Tokens),
                [] => Err(BodyError::BadPrompt),
                more => Err(BodyError::Batch(more.len())),
            }
        }
        _ => Err(BodyError::BadPrompt),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, BodyError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(BodyError::BadPrompt)
        })
        .collect()
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
    fn chat_takes_messages() {
        let p = parse(
            Route::Chat,
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        )
        .unwrap();
        assert!(matches!(p.prompt, Prompt::Messages(ref m) if m.len() == 1));
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
    fn routes_are_read_from_the_path() {
        assert_eq!(Route::of("/v1/completions"), Some(Route::Completions));
        assert_eq!(Route::of("/v1/chat/completions?x=1"), Some(Route::Chat));
        assert_eq!(Route::of("/v1/models"), None);
    }
}
