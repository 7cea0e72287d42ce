//! The models the picker serves, and how each turns a prompt into the
//! token ids its engine will compute: the model's own `tokenizer.json`
//! (read from a local path at start; nothing is downloaded) and its chat
//! template (Jinja, rendered with the request's messages, tools, documents
//! and keywords as the engines' OpenAI servers render it: [`crate::chat`]).
//!
//! A chat's rendered text is tokenized through a per-model prefix cache
//! ([`crate::prefix`]): turn n tokenizes only what turn n-1 did not have.
//!
//! A model without a tokenizer is still served: token-id prompts route by
//! prefix as usual, and text or chat prompts route on load alone (no
//! prefix is known). A chat request for a model with a tokenizer but no
//! template is routed the same way, and so is a chat the template cannot
//! be rendered for as the engine renders it (a picture in a message):
//! such chats are counted, not routed on wrong hashes.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use serde_json::Value;

use crate::body::Prompt;
use crate::prefix::{Cuts, PrefixCache, PrefixStats};

/// `epp.prefix_cache_bytes` by default.
pub const DEFAULT_PREFIX_CACHE_BYTES: usize = 32 << 20;

/// The largest `tokenizer.json` read (real ones are 2-30 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 256 << 20;
/// The largest chat template read (real ones are a few KB).
pub const MAX_TEMPLATE_BYTES: u64 = 1 << 20;

/// Reads a model file: a regular file (a FIFO, a device or a directory is
/// refused without waiting on it) of at most `limit` bytes.
fn read_file(path: &Path, limit: u64) -> Result<Vec<u8>, String> {
    use std::os::unix::fs::OpenOptionsExt;
    // Non-blocking, so that opening a FIFO does not wait for a writer;
    // what was opened is then checked, not the path.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.len() > limit {
        return Err(format!(
            "{} has {} bytes, more than the {limit} a model file may have",
            path.display(),
            meta.len()
        ));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if bytes.len() as u64 > limit {
        return Err(format!("{} grew past {limit} bytes", path.display()));
    }
    Ok(bytes)
}

/// One model, as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    /// The name requests carry in `model`.
    pub name: String,
    /// A `tokenizer.json` (Hugging Face tokenizers format).
    pub tokenizer: Option<PathBuf>,
    /// A Jinja chat template file.
    pub chat_template: Option<PathBuf>,
    /// Rendered as `bos_token` / `eos_token` in the template.
    pub bos_token: String,
    pub eos_token: String,
    /// Whose OpenAI server serves the model, which decides how a chat is
    /// prepared for the template.
    pub engine: crate::chat::Engine,
}

struct Model {
    tokenizer: Option<tokenizers::Tokenizer>,
    template: Option<crate::chat::Template>,
    bos_token: String,
    eos_token: String,
    engine: crate::chat::Engine,
    /// Where rendered chats may be cut, when the tokenizer has special
    /// tokens and the cache is on.
    cuts: Option<Cuts>,
    /// How plain text is cut into pieces, when the tokenizer is of a
    /// shape the plain-text cache is exact for and the cache is on.
    splitter: Option<crate::text::Splitter>,
    cache: Mutex<PrefixCache>,
}

/// The served models.
pub struct Models {
    by_name: HashMap<String, Model>,
    prefix: PrefixStats,
    /// Chats routed on their text because their template could not be
    /// rendered as the engine renders it.
    template_fallbacks: std::sync::atomic::AtomicU64,
}

/// What the models' prefix caches did, since start, and how many chats
/// were routed on their text instead of their template's tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCounts {
    pub template_fallbacks: u64,
    pub hits: u64,
    pub misses: u64,
    pub tokens_reused: u64,
    pub tokens_encoded: u64,
    /// Bytes held now, over every model.
    pub bytes: u64,
}

impl std::fmt::Debug for Models {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Models")
            .field("names", &self.by_name.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// Why a request's prompt has no token ids.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PromptError {
    #[error("model `{0}` is not served here")]
    UnknownModel(String),
    #[error("the chat template failed: {0}")]
    Template(String),
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    #[error("the prompt has {tokens} tokens, over the limit of {limit}")]
    TooLong { tokens: usize, limit: usize },
}

/// A prompt as the router sees it.
#[derive(Debug, PartialEq)]
pub enum Tokens {
    /// The token ids the engine will compute.
    Ids(Vec<u32>),
    /// No tokenizer for this prompt: its text (a chat's messages as
    /// `role\ncontent\n` each), for the approximate prefix mode and a
    /// length estimate.
    Text(String),
}

impl Models {
    /// Loads every model's tokenizer and template (each a regular file of
    /// at most [`MAX_TOKENIZER_BYTES`] or [`MAX_TEMPLATE_BYTES`]), with the
    /// default prefix cache.
    pub fn load(specs: &[ModelSpec]) -> Result<Models, String> {
        Models::load_with(specs, DEFAULT_PREFIX_CACHE_BYTES)
    }

    /// [`Models::load`], with a prefix cache of `prefix_cache_bytes` per
    /// model (0: none).
    pub fn load_with(specs: &[ModelSpec], prefix_cache_bytes: usize) -> Result<Models, String> {
        let mut by_name = HashMap::new();
        for s in specs {
            let tokenizer = match &s.tokenizer {
                Some(p) => {
                    let bytes = read_file(p, MAX_TOKENIZER_BYTES)
                        .map_err(|e| format!("model `{}`: tokenizer {e}", s.name))?;
                    Some(tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| {
                        format!(
                            "model `{}`: tokenizer {} could not be loaded: {e}",
                            s.name,
                            p.display()
                        )
                    })?)
                }
                None => None,
            };
            let template = match &s.chat_template {
                Some(p) => {
                    let bytes = read_file(p, MAX_TEMPLATE_BYTES)
                        .map_err(|e| format!("model `{}`: chat template {e}", s.name))?;
                    let source = String::from_utf8(bytes).map_err(|_| {
                        format!(
                            "model `{}`: chat template {} is not UTF-8",
                            s.name,
                            p.display()
                        )
                    })?;
                    let template = crate::chat::Template::new(source).map_err(|e| {
                        format!("model `{}`: chat template {}: {e}", s.name, p.display())
                    })?;
                    Some(template)
                }
                None => None,
            };
            let cuts = match (&tokenizer, &template) {
                (Some(t), Some(_)) if prefix_cache_bytes > 0 => Cuts::of(t),
                _ => None,
            };
            // An eighth of the budget remembers pieces (two generations of
            // a sixteenth), when plain text is cut into them.
            let piece_bytes = prefix_cache_bytes / 16;
            let splitter = match &tokenizer {
                Some(t) if prefix_cache_bytes > 0 => crate::text::Splitter::of(t, piece_bytes),
                _ => None,
            };
            let prefix_bytes = match splitter {
                Some(_) => prefix_cache_bytes - 2 * piece_bytes,
                None => prefix_cache_bytes,
            };
            by_name.insert(
                s.name.clone(),
                Model {
                    tokenizer,
                    template,
                    bos_token: s.bos_token.clone(),
                    eos_token: s.eos_token.clone(),
                    engine: s.engine,
                    cuts,
                    splitter,
                    cache: Mutex::new(PrefixCache::new(prefix_bytes)),
                },
            );
        }
        Ok(Models {
            by_name,
            prefix: PrefixStats::default(),
            template_fallbacks: Default::default(),
        })
    }

    /// What the prefix caches did.
    pub fn prefix_counts(&self) -> PrefixCounts {
        let p = &self.prefix;
        PrefixCounts {
            template_fallbacks: self.template_fallbacks.load(Ordering::Relaxed),
            hits: p.hits.load(Ordering::Relaxed),
            misses: p.misses.load(Ordering::Relaxed),
            tokens_reused: p.tokens_reused.load(Ordering::Relaxed),
            tokens_encoded: p.tokens_encoded.load(Ordering::Relaxed),
            bytes: self
                .by_name
                .values()
                .map(|m| {
                    let pieces = m.splitter.as_ref().map_or(0, |s| s.piece_bytes());
                    m.cache.lock().map_or(0, |c| c.bytes()) as u64 + pieces as u64
                })
                .sum(),
        }
    }

    /// Whether every model reads an ASCII prompt in tens of microseconds
    /// per 10 KiB: it has no tokenizer (the prompt is hashed), or its
    /// tokenizer's pieces are split by hand and cached
    /// ([`crate::text::Splitter::by_hand`]).
    pub fn quick_on_ascii(&self) -> bool {
        self.by_name
            .values()
            .all(|m| m.tokenizer.is_none() || m.splitter.as_ref().is_some_and(|s| s.by_hand()))
    }

    /// The served models' names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// Whether `model` is served.
    pub fn serves(&self, model: &str) -> bool {
        self.by_name.contains_key(model)
    }

    /// The token ids of `prompt` for `model`, at most `limit` of them.
    /// Ids, and a text without a tokenizer, pass through without a copy.
    pub fn tokens(&self, model: &str, prompt: Prompt, limit: usize) -> Result<Tokens, PromptError> {
        let m = self
            .by_name
            .get(model)
            .ok_or_else(|| PromptError::UnknownModel(model.to_owned()))?;
        let tokens = match prompt {
            Prompt::Tokens(ids) => Tokens::Ids(ids),
            Prompt::Text(text) => match &m.tokenizer {
                Some(t) => {
                    let cached = m.splitter.as_ref().and_then(|s| {
                        crate::text::encode_with(t, s, &m.cache, &self.prefix, &text)
                    });
                    match cached {
                        Some(ids) => Tokens::Ids(ids.map_err(PromptError::Tokenize)?),
                        None => Tokens::Ids(encode(t, &text, true)?),
                    }
                }
                None => Tokens::Text(text),
            },
            Prompt::Messages(mut chat) => match (&m.tokenizer, &m.template) {
                (Some(t), Some(template)) => {
                    let rendered = match template.render_for(
                        m.engine,
                        &mut chat,
                        &m.bos_token,
                        &m.eos_token,
                    ) {
                        Ok(r) => r,
                        Err(crate::chat::RenderError::Failed(e)) => {
                            return Err(PromptError::Template(e));
                        }
                        Err(crate::chat::RenderError::Unsupported(_)) => {
                            self.template_fallbacks.fetch_add(1, Ordering::Relaxed);
                            return Ok(Tokens::Text(plain_text(&chat.messages)));
                        }
                    };
                    let text = &rendered.text;
                    let mut ids = match &m.cuts {
                        Some(cuts) => crate::prefix::encode_with(
                            t,
                            cuts,
                            m.splitter.as_ref(),
                            &m.cache,
                            &self.prefix,
                            text,
                        )
                        .map_err(PromptError::Tokenize)?,
                        None => encode(t, text, false)?,
                    };
                    if let Some(continued) = &rendered.continued {
                        // As SGLang appends it: encoded with the special
                        // tokens the tokenizer adds, less a leading BOS.
                        let more = encode(t, continued, true)?;
                        let bos = t.token_to_id(&m.bos_token);
                        let skip = usize::from(more.first().is_some_and(|id| Some(*id) == bos));
                        ids.extend_from_slice(&more[skip..]);
                    }
                    Tokens::Ids(ids)
                }
                _ => Tokens::Text(plain_text(&chat.messages)),
            },
        };
        if let Tokens::Ids(ids) = &tokens
            && ids.len() > limit
        {
            return Err(PromptError::TooLong {
                tokens: ids.len(),
                limit,
            });
        }
        Ok(tokens)
    }
}

fn encode(t: &tokenizers::Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, PromptError> {
    t.encode_fast(text, special)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| PromptError::Tokenize(e.to_string()))
}

/// The messages as plain text, `role\ncontent\n` each (a content list's
/// text parts joined), in order: the same conversation gives the same
/// text, and a longer one extends it.
pub(crate) fn plain_text(messages: &[Value]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str(m.get("role").and_then(Value::as_str).unwrap_or(""));
        out.push('\n');
        match m.get("content") {
            Some(Value::String(s)) => out.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if let Some(t) = p.get("text").and_then(Value::as_str) {
                        out.push_str(t);
                    }
                }
            }
            _ => {}
        }
        out.push('\n');
    }
    out
}
