//! A chat request turned into the text its engine computes: the request's
//! messages, tools, documents and `chat_template_kwargs` prepared as
//! vLLM's OpenAI server prepares them, then rendered through transformers'
//! `apply_chat_template` ([`crate::template`]'s environment), whose text
//! vLLM tokenizes without adding special tokens.
//!
//! What vLLM does before the template sees a chat, and this module does
//! alike:
//! - every message becomes `{role, content}` plus what its role keeps
//!   (an assistant's `tool_calls` and `reasoning`, a tool's
//!   `tool_call_id`, any `name`); a content of text parts is joined with
//!   newlines, or, when the template loops over a message's content, every
//!   content (a plain string too) becomes a list of `{type: text}` parts;
//! - a tool call is `{id, function: {arguments, name}, type}` (the OpenAI
//!   SDK's field order), its `arguments` string parsed into an object
//!   (`{}` when it is not one);
//! - `developer` messages become `system` ones, merged at the front, when
//!   the template never names the developer role;
//! - each tool is `{type, function: {name, description, parameters}}`,
//!   absent fields as `null`;
//! - `chat_template_kwargs` reach the template only where it reads them,
//!   under `add_generation_prompt`, `documents` and `reasoning_effort`
//!   (which also sets `enable_thinking` unless the client did);
//! - `continue_final_message` cuts the text where the last message ends.
//!
//! SGLang prepares a chat its own way ([`Engine::Sglang`], for models
//! its engines serve): messages keep the fields its request model has
//! (those without a value dropped), text parts are joined with spaces, a
//! plain string stays a string, tools keep the client's key order and are
//! left out when `tool_choice` is `"none"`, `chat_template_kwargs` all
//! reach the template, the generation prompt is always added, a final
//! assistant message is continued (its text tokenized on its own and
//! appended) or else read as the user's, and a template that fails with
//! tools is tried again with bare function definitions.
//!
//! A chat with a picture, a sound or any other non-text part is not
//! rendered: its tokens depend on the model's processor.

use std::collections::HashSet;

use minijinja::Environment;
use serde_json::{Map, Value};

use crate::body::Chat;

/// Whose OpenAI server a model's chats are rendered as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Engine {
    #[default]
    Vllm,
    Sglang,
}

/// A rendered chat.
#[derive(Debug, PartialEq)]
pub struct Rendered {
    /// The text to tokenize without special tokens.
    pub text: String,
    /// SGLang continuing the final assistant message: its text, tokenized
    /// on its own (a leading BOS dropped) and appended.
    pub continued: Option<String>,
}

/// A chat template, with what vLLM and SGLang read of its source.
pub struct Template {
    env: Environment<'static>,
    /// The template loops over a message's content: vLLM then hands it
    /// every content as a list of parts.
    parts: bool,
    /// SGLang's reading of the same: a loop over `message.content` (or
    /// `msg`'s, or `m`'s), or any mention of images, audio, video or
    /// vision.
    sglang_parts: bool,
    /// The template names the `developer` role.
    developer: bool,
    /// The names the template reads but does not set: the only
    /// `chat_template_kwargs` that reach it.
    variables: HashSet<String>,
    /// The source mentions `content`, which `continue_final_message`
    /// needs.
    names_content: bool,
}

impl std::fmt::Debug for Template {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Template")
            .field("parts", &self.parts)
            .field("developer", &self.developer)
            .field("variables", &self.variables)
            .finish_non_exhaustive()
    }
}

/// Why a chat was not rendered.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RenderError {
    /// The template (or the request, as the template sees it) failed: the
    /// engine refuses such a request too.
    #[error("{0}")]
    Failed(String),
    /// The chat has a part kvedge cannot render as the engine would.
    #[error("{0}")]
    Unsupported(String),
}

/// The keywords `apply_chat_template` takes for itself: vLLM passes them
/// on from `chat_template_kwargs` whatever the template reads, and the
/// template never sees them.
const CONSUMED: [&str; 9] = [
    "conversation",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
    "continue_final_message",
];

/// transformers marks the final message with this to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

impl Template {
    /// Compiles `source`.
    pub fn new(source: String) -> Result<Template, minijinja::Error> {
        let parts = crate::template::loops_over_content(&source);
        let sglang_parts = ["image", "audio", "video", "vision"]
            .iter()
            .any(|k| source.contains(k))
            || crate::template::loops_over_content_of(&source, &["message", "msg", "m"]);
        let developer = source.contains("\"developer\"") || source.contains("'developer'");
        let names_content = source.contains("content");
        let env = crate::template::environment(source)?;
        let variables = env
            .get_template("chat")?
            .undeclared_variables(false)
            .into_iter()
            .collect();
        Ok(Template {
            env,
            parts,
            sglang_parts,
            developer,
            variables,
            names_content,
        })
    }

    /// Whether vLLM hands this template each content as a list of parts.
    pub fn takes_parts(&self) -> bool {
        self.parts
    }

    /// `chat` rendered as `engine`'s OpenAI server renders it.
    ///
    /// The messages' contents are moved into the template's context, not
    /// copied: `chat` keeps them only when the answer is
    /// [`RenderError::Unsupported`] (for the caller to route on them).
    pub fn render_for(
        &self,
        engine: Engine,
        chat: &mut Chat,
        bos: &str,
        eos: &str,
    ) -> Result<Rendered, RenderError> {
        if let Some(why) = non_text_part(chat, engine) {
            return Err(RenderError::Unsupported(why));
        }
        match engine {
            Engine::Vllm => Ok(Rendered {
                text: self.render_vllm(chat, bos, eos)?,
                continued: None,
            }),
            Engine::Sglang => self.render_sglang(chat, bos, eos),
        }
    }

    /// The text `chat` renders to as vLLM renders it, with `bos` and `eos`
    /// as the tokenizer's special tokens.
    pub fn render(&self, chat: &Chat, bos: &str, eos: &str) -> Result<String, RenderError> {
        self.render_for(Engine::Vllm, &mut chat.clone(), bos, eos)
            .map(|r| r.text)
    }

    fn render_vllm(&self, chat: &mut Chat, bos: &str, eos: &str) -> Result<String, RenderError> {
        let mut messages = chat
            .messages
            .iter_mut()
            .map(|m| message(m, self.parts))
            .collect::<Result<Vec<_>, _>>()?;
        if !self.developer && messages.iter().any(|m| role(m) == "developer") {
            messages = developer_as_system(messages);
        }
        let final_text = if chat.continue_final_message {
            Some(self.mark_final(&mut messages)?)
        } else {
            None
        };

        // The keywords as vLLM merges them: the request's tools, then the
        // client's kwargs (`null` and "auto" leave a value unset; only
        // those the template reads, or `apply_chat_template` takes, pass),
        // then the request's own fields. The template's context is the
        // special tokens, overridden by those keywords, then the four it is
        // always given (later entries win).
        use minijinja::Value as J;
        let reads = |k: &str| self.variables.contains(k);
        let mut tools_value = chat.tools.as_ref().map(tools);
        let mut documents = None;
        let mut context: Vec<(J, J)> = vec![
            (J::from("bos_token"), J::from(bos)),
            (J::from("eos_token"), J::from(eos)),
        ];
        for (k, v) in &chat.kwargs {
            if v.is_null() || v.as_str() == Some("auto") {
                continue;
            }
            match k.as_str() {
                "tools" => tools_value = Some(v.clone()),
                "documents" => documents = Some(v.clone()),
                "add_generation_prompt" => {}
                k if CONSUMED.contains(&k) => {}
                k if reads(k) => context.push((J::from(k), J::from_serialize(v))),
                _ => {}
            }
        }
        if let Some(d) = &chat.documents {
            documents = Some(d.clone());
        }
        if let Some(effort) = &chat.reasoning_effort {
            if reads("reasoning_effort") {
                context.push((J::from("reasoning_effort"), J::from(effort.as_str())));
            }
            if reads("enable_thinking") && !chat.kwargs.contains_key("enable_thinking") {
                context.push((J::from("enable_thinking"), J::from(effort != "none")));
            }
        }
        let or_none = |v: Option<Value>| v.map_or(J::from(()), |v| J::from_serialize(&v));
        context.push((J::from("messages"), J::from_serialize(&messages)));
        context.push((J::from("tools"), or_none(tools_value)));
        context.push((J::from("documents"), or_none(documents)));
        context.push((
            J::from("add_generation_prompt"),
            J::from(chat.add_generation_prompt),
        ));

        let template = self
            .env
            .get_template("chat")
            .map_err(|e| RenderError::Failed(e.to_string()))?;
        let rendered = match template.render(J::from_iter(context)) {
            Ok(text) => text,
            Err(e) => return Err(render_failed(&e, chat, messages)),
        };
        match final_text {
            Some(text) => cut_at_tag(rendered, &text),
            None => Ok(rendered),
        }
    }

    fn render_sglang(
        &self,
        chat: &mut Chat,
        bos: &str,
        eos: &str,
    ) -> Result<Rendered, RenderError> {
        let mut messages = chat
            .messages
            .iter_mut()
            .map(|m| sglang::message(m, self.sglang_parts))
            .collect::<Result<Vec<_>, _>>()?;
        // The final assistant message, when its content is a string, is
        // continued or read as the user's: SGLang always adds the
        // generation prompt.
        let mut continued = None;
        if let Some(last) = messages.last()
            && role(last) == "assistant"
            && let Some(Value::String(text)) = last.get("content")
        {
            let text = text.clone();
            if chat.continue_final_message {
                messages.pop();
                continued = Some(text);
            } else {
                let mut user = Map::new();
                user.insert("role".into(), "user".into());
                user.insert("content".into(), text.into());
                *messages.last_mut().unwrap_or(&mut Value::Null) = Value::Object(user);
            }
        }
        let tools = sglang::tools(chat);
        use minijinja::Value as J;
        let mut context: Vec<(J, J)> = vec![
            (J::from("bos_token"), J::from(bos)),
            (J::from("eos_token"), J::from(eos)),
        ];
        if let Some(effort) = &chat.reasoning_effort {
            context.push((J::from("reasoning_effort"), J::from(effort.as_str())));
        }
        let mut documents = J::from(());
        for (k, v) in &chat.kwargs {
            match k.as_str() {
                // Given to `apply_chat_template` twice: Python refuses.
                "tokenize"
                | "add_generation_prompt"
                | "tools"
                | "return_dict"
                | "conversation"
                | "chat_template" => {
                    return Err(RenderError::Failed(format!(
                        "chat_template_kwargs may not set `{k}`"
                    )));
                }
                "documents" => documents = J::from_serialize(v),
                k if CONSUMED.contains(&k) => {}
                _ => context.push((J::from(k.as_str()), J::from_serialize(v))),
            }
        }
        context.push((J::from("messages"), J::from_serialize(&messages)));
        context.push((J::from("documents"), documents));
        context.push((J::from("add_generation_prompt"), J::from(true)));
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| RenderError::Failed(e.to_string()))?;
        let render = |tools: &Value| {
            let mut context = context.clone();
            context.push((J::from("tools"), J::from_serialize(tools)));
            template.render(J::from_iter(context))
        };
        let rendered = match render(&tools) {
            // Tried again with the bare function definitions, which some
            // templates expect.
            Err(_) if tools.is_array() => {
                let bare: Vec<Value> = tools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| t.get("function").cloned().unwrap_or_else(|| t.clone()))
                    .collect();
                render(&Value::Array(bare))
            }
            other => other,
        };
        let text = match rendered {
            Ok(text) => text,
            Err(e) => return Err(render_failed(&e, chat, messages)),
        };
        Ok(Rendered { text, continued })
    }

    /// Marks the last message's text with [`CONTINUE_TAG`], as
    /// transformers does; the text it had.
    fn mark_final(&self, messages: &mut [Value]) -> Result<String, RenderError> {
        let missing = || {
            RenderError::Failed(
                "continue_final_message is set but the final message has no content to continue"
                    .into(),
            )
        };
        let last = messages.last_mut().ok_or_else(missing)?;
        if !self.names_content {
            return Err(RenderError::Failed(
                "continue_final_message is set but the chat template never reads `content`".into(),
            ));
        }
        match last.get_mut("content") {
            Some(Value::String(s)) => {
                let text = s.clone();
                s.push_str(CONTINUE_TAG);
                Ok(text)
            }
            Some(Value::Array(blocks)) => {
                for block in blocks.iter_mut().rev() {
                    if let Some(Value::String(s)) = block.get_mut("text") {
                        let text = s.clone();
                        s.push_str(CONTINUE_TAG);
                        return Ok(text);
                    }
                }
                Err(RenderError::Failed(
                    "continue_final_message is set but the final message has no text".into(),
                ))
            }
            _ => Err(missing()),
        }
    }
}

/// The rendered text up to the final message's end, as transformers cuts
/// it.
fn cut_at_tag(rendered: String, final_text: &str) -> Result<String, RenderError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(RenderError::Failed(
            "continue_final_message is set but the final message does not appear in the \
             rendered chat"
                .into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    // The tag with its space: the template kept the text's end as it was;
    // without, it trimmed whitespace there, and so does the cut.
    let kept_spacing = rendered[at..].starts_with(CONTINUE_TAG);
    let mut out = rendered;
    out.truncate(at);
    if !kept_spacing {
        out.truncate(out.trim_end().len());
    }
    Ok(out)
}

/// A render's failure: a filter, test, function or method kvedge's Jinja
/// does not have cannot be rendered as the engine renders it, and the
/// prepared `messages` go back into `chat` for the caller to route on
/// their text; any other error is the engine's too.
fn render_failed(e: &minijinja::Error, chat: &mut Chat, messages: Vec<Value>) -> RenderError {
    use minijinja::ErrorKind as K;
    match e.kind() {
        K::UnknownFilter | K::UnknownTest | K::UnknownFunction | K::UnknownMethod => {
            chat.messages = messages;
            RenderError::Unsupported(format!("the chat template uses what kvedge lacks: {e}"))
        }
        _ => RenderError::Failed(template_error(e)),
    }
}

/// A template error's message without minijinja's location noise: a
/// `raise_exception` reads as the template's own words.
fn template_error(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(d) if e.kind() == minijinja::ErrorKind::InvalidOperation => d.to_owned(),
        _ => e.to_string(),
    }
}

fn role(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

/// The first content part `engine` does not read as text (a picture, a
/// sound), said as a reason; such a chat's tokens depend on the model's
/// processor.
fn non_text_part(chat: &Chat, engine: Engine) -> Option<String> {
    let text_types: &[&str] = match engine {
        Engine::Vllm => &["text", "input_text", "output_text", "refusal", "thinking"],
        Engine::Sglang => &[
            "text",
            "input_text",
            "thinking",
            "reasoning",
            "tool_reference",
        ],
    };
    chat.messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_array))
        .flatten()
        .filter(|p| p.is_object())
        .map(|p| p.get("type").and_then(Value::as_str).unwrap_or("(none)"))
        .find(|kind| !text_types.contains(kind))
        .map(|kind| format!("a content part of type {kind} is rendered by the model's processor"))
}

/// A text part's text, taken out of it: from `text`, `refusal` or
/// `thinking` as vLLM reads each type.
fn part_text(part: &mut Map<String, Value>) -> Result<Option<String>, RenderError> {
    let kind = part
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    let field = match kind.as_str() {
        "refusal" => "refusal",
        "thinking" => "thinking",
        _ => "text",
    };
    match part.get_mut(field).map(Value::take) {
        Some(Value::String(s)) => Ok(Some(s)),
        // vLLM skips a text or refusal part without one.
        None | Some(Value::Null) if field != "thinking" => Ok(None),
        _ => Err(RenderError::Failed(format!(
            "a `{kind}` content part needs a string `{field}`"
        ))),
    }
}

/// The fields of a text part vLLM copies beside `type` and `text`.
const PART_FIELDS: [&str; 5] = ["type", "text", "refusal", "thinking", "uuid"];

/// One message as vLLM hands it to the template, its content taken out
/// of `m`.
fn message(m: &mut Value, parts: bool) -> Result<Value, RenderError> {
    // Nearly every message is `{role, content}` with a string content,
    // which vLLM hands over as it is (unless the template takes parts).
    if let Value::Object(map) = m
        && map.len() == 2
        && let Some((("role", Value::String(role)), ("content", Value::String(_)))) = map
            .iter()
            .next()
            .zip(map.iter().nth(1))
            .map(|((a, x), (b, y))| ((a.as_str(), x), (b.as_str(), y)))
        && !(parts && role != "tool")
        && role != "developer"
    {
        return Ok(m.take());
    }
    let role = role(m).to_owned();
    // The content as a list of text parts (with the fields vLLM keeps).
    let mut texts: Vec<(String, Map<String, Value>)> = Vec::new();
    match m.get_mut("content").map(Value::take) {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => texts.push((s, Map::new())),
        Some(Value::Array(items)) => {
            for item in items {
                match item {
                    Value::String(s) => texts.push((s, Map::new())),
                    Value::Object(mut part) => {
                        if let Some(text) = part_text(&mut part)? {
                            let extra = part
                                .into_iter()
                                .filter(|(k, _)| !PART_FIELDS.contains(&k.as_str()))
                                .collect();
                            texts.push((text, extra));
                        }
                    }
                    _ => {
                        return Err(RenderError::Failed(
                            "a content part must be a string or an object".into(),
                        ));
                    }
                }
            }
        }
        Some(_) => {
            return Err(RenderError::Failed(
                "`content` must be a string, a list of parts, or null".into(),
            ));
        }
    }
    let content = if parts && role != "tool" {
        Value::Array(
            texts
                .into_iter()
                .map(|(t, extra)| {
                    let mut p = Map::new();
                    p.insert("type".into(), "text".into());
                    p.insert("text".into(), t.into());
                    p.extend(extra);
                    Value::Object(p)
                })
                .collect(),
        )
    } else if texts.len() == 1 {
        // A tool's result is one string whatever the format.
        Value::String(texts.pop().map(|(t, _)| t).unwrap_or_default())
    } else {
        Value::String(
            texts
                .iter()
                .map(|(t, _)| t.as_str())
                .collect::<Vec<_>>()
                .join("\n"),
        )
    };
    let mut out = Map::new();
    out.insert("role".into(), role.as_str().into());
    out.insert("content".into(), content);
    match role.as_str() {
        "assistant" => {
            match m.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    let calls = calls.iter().map(tool_call).collect::<Result<Vec<_>, _>>()?;
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
                Some(_) => {
                    return Err(RenderError::Failed("`tool_calls` must be a list".into()));
                }
            }
            if let Some(r) = m.get("reasoning").filter(|r| !r.is_null()) {
                out.insert("reasoning".into(), r.clone());
                out.insert("reasoning_content".into(), r.clone());
            }
        }
        "tool" => {
            if let Some(id) = m.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    for key in ["name", "task"] {
        if let Some(v) = m.get(key).filter(|v| v.is_string()) {
            out.insert(key.into(), v.clone());
        }
    }
    if role == "developer" {
        out.insert(
            "tools".into(),
            m.get("tools").cloned().unwrap_or(Value::Null),
        );
    }
    Ok(Value::Object(out))
}

/// A tool call with its `arguments` as an object, as templates read them.
fn tool_call(call: &Value) -> Result<Value, RenderError> {
    let Some(obj) = call.as_object() else {
        return Err(RenderError::Failed(
            "assistant tool_calls entries must be objects".into(),
        ));
    };
    let kind = obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function");
    let Some(function) = obj
        .get("function")
        .and_then(Value::as_object)
        .filter(|_| kind == "function")
    else {
        return Err(RenderError::Failed(
            "chat completions only support assistant tool_calls of type 'function'".into(),
        ));
    };
    // Anything but an object, or a string holding one, is an empty object:
    // vLLM goes on with it, so that a conversation is not stuck on an old
    // turn's malformed call.
    let arguments = match function.get("arguments") {
        Some(Value::Object(o)) => Value::Object(o.clone()),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(o)) => Value::Object(o),
            _ => Value::Object(Map::new()),
        },
        _ => Value::Object(Map::new()),
    };
    // vLLM reads a tool call through the OpenAI SDK's typed dicts, which
    // rebuild it in their own field order and drop fields they do not
    // have: `{id, function: {arguments, name}, type}`.
    let mut out = Map::new();
    if let Some(id) = obj.get("id") {
        out.insert("id".into(), id.clone());
    }
    let mut f = Map::new();
    f.insert("arguments".into(), arguments);
    if let Some(name) = function.get("name") {
        f.insert("name".into(), name.clone());
    }
    out.insert("function".into(), Value::Object(f));
    out.insert("type".into(), kind.into());
    Ok(Value::Object(out))
}

/// `developer` messages as `system` ones, and every system message merged
/// into one at the front when any stands elsewhere or there are several.
fn developer_as_system(messages: Vec<Value>) -> Vec<Value> {
    let messages: Vec<Value> = messages
        .into_iter()
        .map(|mut m| {
            if role(&m) == "developer"
                && let Some(o) = m.as_object_mut()
            {
                o.insert("role".into(), "system".into());
                o.remove("tools");
            }
            m
        })
        .collect();
    let mut systems = Vec::new();
    let mut others = Vec::new();
    let mut merge = false;
    for (i, m) in messages.iter().enumerate() {
        if role(m) == "system" {
            merge |= i > 0 || !systems.is_empty();
            let text = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .filter_map(|p| match p {
                        Value::String(s) => Some(s.as_str()),
                        _ => p.get("text").and_then(Value::as_str),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            if !text.is_empty() {
                systems.push(text);
            }
        } else {
            others.push(m.clone());
        }
    }
    if !merge {
        return messages;
    }
    let mut system = Map::new();
    system.insert("role".into(), "system".into());
    system.insert("content".into(), systems.join("\n\n").into());
    let mut out = vec![Value::Object(system)];
    out.extend(others);
    out
}

/// The tools as vLLM dumps them: `{type, function: {name, description,
/// parameters[, strict]}}`, fields it does not know dropped.
fn tools(tools: &Value) -> Value {
    let Some(list) = tools.as_array() else {
        return Value::Null;
    };
    Value::Array(
        list.iter()
            .map(|t| {
                let f = t.get("function");
                let field = |k: &str| f.and_then(|f| f.get(k)).cloned().unwrap_or(Value::Null);
                let mut function = Map::new();
                function.insert("name".into(), field("name"));
                function.insert("description".into(), field("description"));
                function.insert("parameters".into(), field("parameters"));
                let strict = field("strict");
                if !strict.is_null() {
                    function.insert("strict".into(), strict);
                }
                // The function's own, else the tool's (which vLLM copies
                // into the function when the function has none).
                let tool_defer = t.get("defer_loading").filter(|v| !v.is_null());
                let defer = Some(field("defer_loading"))
                    .filter(|v| !v.is_null())
                    .or_else(|| tool_defer.cloned());
                if let Some(d) = defer {
                    function.insert("defer_loading".into(), d);
                }
                let mut tool = Map::new();
                tool.insert(
                    "type".into(),
                    t.get("type").cloned().unwrap_or_else(|| "function".into()),
                );
                tool.insert("function".into(), Value::Object(function));
                if let Some(d) = tool_defer {
                    tool.insert("defer_loading".into(), d.clone());
                }
                Value::Object(tool)
            })
            .collect(),
    )
}

/// SGLang's preparation of a chat request.
mod sglang {
    use serde_json::{Map, Value};

    use super::RenderError;
    use crate::body::Chat;

    /// The roles SGLang's generic message takes (lower-cased); `user` has
    /// its own.
    const ROLES: [&str; 7] = [
        "system",
        "assistant",
        "tool",
        "function",
        "developer",
        "latest_reminder",
        "root",
    ];

    /// The generic message's fields, in its order.
    const FIELDS: [&str; 9] = [
        "role",
        "content",
        "tool_call_id",
        "name",
        "phase",
        "reasoning_content",
        "tool_calls",
        "tools",
        "prefix",
    ];

    fn failed(what: &str) -> RenderError {
        RenderError::Failed(what.into())
    }

    /// One message as SGLang hands it to the template: its request
    /// model's fields in their order, those without a value dropped.
    pub(super) fn message(m: &mut Value, parts: bool) -> Result<Value, RenderError> {
        let raw = m.get("role").and_then(Value::as_str).unwrap_or("");
        let role = if raw == "user" {
            "user".to_owned()
        } else {
            let lower = raw.to_lowercase();
            if !ROLES.contains(&lower.as_str()) {
                return Err(failed("'role' is not one SGLang takes"));
            }
            lower
        };
        let fields: &[&str] = if role == "user" {
            &FIELDS[..2]
        } else {
            &FIELDS
        };
        let mut out = Map::new();
        for &field in fields {
            let value = match field {
                "role" => Value::String(role.clone()),
                "content" => content(m.get_mut("content").map(Value::take), parts, &role)?,
                "tool_calls" => match m.get("tool_calls") {
                    Some(Value::Array(calls)) => Value::Array(
                        calls
                            .iter()
                            .map(|c| tool_call(c, role == "assistant"))
                            .collect::<Result<_, _>>()?,
                    ),
                    None | Some(Value::Null) => Value::Null,
                    Some(_) => return Err(failed("`tool_calls` must be a list")),
                },
                "tools" => match m.get("tools") {
                    Some(Value::Array(list)) => Value::Array(list.iter().map(tool).collect()),
                    _ => Value::Null,
                },
                _ => m.get(field).cloned().unwrap_or(Value::Null),
            };
            if !value.is_null() {
                out.insert(field.into(), value);
            }
        }
        Ok(Value::Object(out))
    }

    fn content(c: Option<Value>, parts: bool, role: &str) -> Result<Value, RenderError> {
        let items = match c {
            None | Some(Value::Null) if role != "user" => return Ok(Value::String(String::new())),
            Some(Value::String(s)) => return Ok(Value::String(s)),
            Some(Value::Array(items)) => items,
            _ => return Err(failed("`content` must be a string or a list of parts")),
        };
        let mut texts = Vec::new();
        let mut kept = Vec::new();
        for mut item in items {
            let kind = item.get("type").and_then(Value::as_str).unwrap_or("");
            match kind {
                "text" | "input_text" => {
                    let Some(Value::String(text)) = item.get_mut("text").map(Value::take) else {
                        return Err(failed("a text part needs a string `text`"));
                    };
                    if parts {
                        let mut p = Map::new();
                        p.insert("type".into(), "text".into());
                        p.insert("text".into(), text.as_str().into());
                        kept.push(Value::Object(p));
                    }
                    texts.push(text);
                }
                "tool_reference" if parts => kept.push(item),
                "thinking" | "reasoning" | "tool_reference" => {}
                other => {
                    return Err(RenderError::Unsupported(format!(
                        "a content part of type {other} is rendered by the model's processor"
                    )));
                }
            }
        }
        if !parts {
            return Ok(Value::String(texts.join(" ")));
        }
        // A tool's result of text parts only is one string.
        if role == "tool"
            && kept
                .iter()
                .all(|p| p.get("type").and_then(Value::as_str) == Some("text"))
        {
            return Ok(Value::String(texts.join(" ")));
        }
        Ok(Value::Array(kept))
    }

    /// A tool call as SGLang's model dumps it (`{id, index, type,
    /// function: {name, arguments}}`, absent values as `null`), an
    /// assistant's `arguments` string parsed into the object it must be.
    fn tool_call(c: &Value, assistant: bool) -> Result<Value, RenderError> {
        let Some(function) = c.get("function").and_then(Value::as_object) else {
            return Err(failed("a tool call needs a `function`"));
        };
        let mut arguments = function.get("arguments").cloned().unwrap_or(Value::Null);
        if assistant && let Value::String(s) = &arguments {
            match serde_json::from_str::<Value>(s) {
                Ok(v @ Value::Object(_)) => arguments = v,
                Ok(_) => {
                    return Err(failed(
                        "Assistant tool call function.arguments must be a JSON object.",
                    ));
                }
                Err(_) => {
                    return Err(failed(
                        "Assistant tool call function.arguments must be valid JSON.",
                    ));
                }
            }
        }
        let mut f = Map::new();
        f.insert(
            "name".into(),
            function.get("name").cloned().unwrap_or(Value::Null),
        );
        f.insert("arguments".into(), arguments);
        let mut out = Map::new();
        out.insert("id".into(), c.get("id").cloned().unwrap_or(Value::Null));
        out.insert(
            "index".into(),
            c.get("index").cloned().unwrap_or(Value::Null),
        );
        out.insert("type".into(), "function".into());
        out.insert("function".into(), Value::Object(f));
        Ok(Value::Object(out))
    }

    /// A tool as SGLang's model dumps it: `{type, function, defer_loading}`,
    /// the function's fields in the client's order (absent ones after,
    /// `strict` and `defer_loading` only when set).
    fn tool(t: &Value) -> Value {
        let empty = Map::new();
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let defer = t.get("defer_loading").cloned().unwrap_or(Value::Null);
        let mut data: Vec<(&str, Value)> = vec![
            (
                "description",
                f.get("description").cloned().unwrap_or(Value::Null),
            ),
            ("name", f.get("name").cloned().unwrap_or(Value::Null)),
            (
                "parameters",
                f.get("parameters").cloned().unwrap_or(Value::Null),
            ),
        ];
        if let Some(s) = f.get("strict").filter(|v| !v.is_null()) {
            data.push(("strict", s.clone()));
        }
        match f.get("defer_loading").filter(|v| !v.is_null()) {
            Some(d) => data.push(("defer_loading", d.clone())),
            None if !defer.is_null() => data.push(("defer_loading", defer.clone())),
            None => {}
        }
        let mut function = Map::new();
        for key in f.keys() {
            if let Some((k, v)) = data.iter().find(|(k, _)| k == key) {
                function.insert((*k).into(), v.clone());
            }
        }
        for (k, v) in data {
            if !function.contains_key(k) {
                function.insert(k.into(), v);
            }
        }
        let mut out = Map::new();
        out.insert(
            "type".into(),
            t.get("type").cloned().unwrap_or_else(|| "function".into()),
        );
        out.insert("function".into(), Value::Object(function));
        out.insert("defer_loading".into(), defer);
        Value::Object(out)
    }

    /// The tools the template is given: none when `tool_choice` is
    /// `"none"`, only the named one when it names one.
    pub(super) fn tools(chat: &Chat) -> Value {
        let Some(Value::Array(list)) = &chat.tools else {
            return Value::Null;
        };
        if list.is_empty() {
            return Value::Null;
        }
        match &chat.tool_choice {
            Some(Value::String(s)) if s == "none" => Value::Null,
            Some(Value::Object(choice)) => {
                let name = choice.get("function").and_then(|f| f.get("name"));
                let named: Vec<Value> = list
                    .iter()
                    .filter(|t| t.get("function").and_then(|f| f.get("name")) == name)
                    .map(tool)
                    .collect();
                if named.is_empty() {
                    Value::Null
                } else {
                    Value::Array(named)
                }
            }
            _ => Value::Array(list.iter().map(tool).collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, chat: Chat) -> Result<String, RenderError> {
        Template::new(source.into())
            .unwrap()
            .render(&chat, "<s>", "</s>")
    }

    #[test]
    fn content_parts_are_joined_unless_the_template_loops_over_them() {
        let chat = || {
            Chat::of(vec![json!({"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})])
        };
        let plain = "{{ messages[0].content }}";
        assert_eq!(render(plain, chat()).unwrap(), "a\nb");
        let looping = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text }}]{% endfor %}{% endfor %}";
        assert_eq!(render(looping, chat()).unwrap(), "[a][b]");
        // A string content is a list of one part to such a template.
        let one = Chat::of(vec![json!({"role": "user", "content": "x"})]);
        assert_eq!(render(looping, one).unwrap(), "[x]");
    }

    #[test]
    fn tool_call_arguments_are_objects_and_tools_are_dumped_in_order() {
        let mut chat = Chat::of(vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": 2}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]}),
        ]);
        chat.tools = Some(
            json!([{"function": {"parameters": {"z": 1, "y": 2}, "name": "f", "extra": 1}, "type": "function"}]),
        );
        let source = "{{ tools | tojson }}|{% for c in messages[1].tool_calls %}{{ c.function.arguments | tojson }}{% endfor %}";
        assert_eq!(
            render(source, chat).unwrap(),
            r#"[{"type": "function", "function": {"name": "f", "description": null, "parameters": {"z": 1, "y": 2}}}]|{"b": 1, "a": 2}{}"#
        );
        // In the OpenAI SDK's order, whatever the client's.
        let mut chat = Chat::of(vec![json!({"role": "assistant", "tool_calls": [
            {"type": "function", "extra": 1, "function": {"name": "f", "arguments": "{}"}, "id": "c1"}]})]);
        chat.add_generation_prompt = false;
        assert_eq!(
            render("{{ messages[0].tool_calls[0] | tojson }}", chat).unwrap(),
            r#"{"id": "c1", "function": {"arguments": {}, "name": "f"}, "type": "function"}"#
        );
    }

    #[test]
    fn a_functions_own_defer_loading_wins_over_its_tools() {
        let mut chat = Chat::of(vec![json!({"role": "user", "content": "hi"})]);
        chat.tools = Some(json!([
            {"type": "function", "defer_loading": true, "function": {"name": "f", "defer_loading": false}},
            {"type": "function", "defer_loading": true, "function": {"name": "g"}}]));
        assert_eq!(
            render("{% for t in tools %}{{ t.function.defer_loading }}{{ t.defer_loading }};{% endfor %}", chat)
                .unwrap(),
            "FalseTrue;TrueTrue;"
        );
    }

    #[test]
    fn tools_and_documents_are_none_when_absent_and_kwargs_reach_only_what_the_template_reads() {
        let mut chat = Chat::of(vec![json!({"role": "user", "content": "hi"})]);
        chat.kwargs.insert("enable_thinking".into(), false.into());
        chat.kwargs.insert("eos_token".into(), "E".into());
        // Taken by `apply_chat_template` itself: never the template's.
        chat.kwargs.insert("max_length".into(), 5.into());
        let source = "{{ tools is none }} {{ documents is none }} {{ enable_thinking }} {{ eos_token }} {{ max_length is defined }}";
        assert_eq!(render(source, chat).unwrap(), "True True False E False");
        let mut chat = Chat::of(vec![json!({"role": "user", "content": "hi"})]);
        chat.reasoning_effort = Some("none".into());
        assert_eq!(render("{{ enable_thinking }}", chat).unwrap(), "False");
    }

    #[test]
    fn developer_messages_become_one_system_message_unless_the_template_knows_them() {
        let chat = || {
            Chat::of(vec![
                json!({"role": "system", "content": "s"}),
                json!({"role": "developer", "content": "d"}),
                json!({"role": "user", "content": "u"}),
            ])
        };
        let source = "{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}";
        assert_eq!(render(source, chat()).unwrap(), "system=s\n\nd;user=u;");
        let knows = "{% for m in messages %}{{ m.role }}{% if m.role == 'developer' %}!{% endif %};{% endfor %}";
        assert_eq!(render(knows, chat()).unwrap(), "system;developer!;user;");
    }

    #[test]
    fn continue_final_message_cuts_where_the_last_message_ends() {
        let mut chat = Chat::of(vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "Hello, wor"}),
        ]);
        chat.add_generation_prompt = false;
        chat.continue_final_message = true;
        let source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>\n{% endfor %}";
        assert_eq!(
            render(source, chat).unwrap(),
            "<user>hi</s>\n<assistant>Hello, wor"
        );
    }

    #[test]
    fn sglang_prepares_a_chat_its_own_way() {
        let template = Template::new(
            "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}\
             {% if tools %}{{ tools | tojson }}{% endif %}{% if add_generation_prompt %}>{% endif %}"
                .into(),
        )
        .unwrap();
        let mut chat = Chat::of(vec![
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": "so far"}),
        ]);
        chat.add_generation_prompt = false;
        chat.tools = Some(json!([{"function": {"parameters": {}, "name": "f"}}]));
        let sglang = |chat: &Chat| {
            template
                .render_for(Engine::Sglang, &mut chat.clone(), "", "")
                .unwrap()
        };
        // Parts joined with a space, the last assistant message read as the
        // user's, tools in the client's order, the generation prompt added.
        assert_eq!(
            sglang(&chat).text,
            r#"user:a b;user:so far;[{"type": "function", "function": {"parameters": {}, "name": "f", "description": null}, "defer_loading": null}]>"#
        );
        chat.tool_choice = Some(json!("none"));
        chat.continue_final_message = true;
        let continued = sglang(&chat);
        assert_eq!(continued.text, "user:a b;>");
        assert_eq!(continued.continued.as_deref(), Some("so far"));
    }

    #[test]
    fn a_template_calling_what_kvedge_lacks_is_unsupported_and_keeps_the_chat() {
        let template = Template::new("{{ messages[0].content | wordwrap }}".into()).unwrap();
        let mut chat = Chat::of(vec![json!({"role": "user", "content": "kept"})]);
        assert!(matches!(
            template.render_for(Engine::Vllm, &mut chat, "", ""),
            Err(RenderError::Unsupported(_))
        ));
        assert_eq!(chat.messages[0]["content"], "kept");
    }

    #[test]
    fn pictures_are_not_rendered_and_template_errors_say_why() {
        let chat = Chat::of(vec![json!({"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]})]);
        assert!(matches!(
            render("x", chat),
            Err(RenderError::Unsupported(_))
        ));
        let chat = Chat::of(vec![json!({"role": "user", "content": "hi"})]);
        assert_eq!(
            render("{{ raise_exception('roles must alternate') }}", chat),
            Err(RenderError::Failed("roles must alternate".into()))
        );
    }
}
