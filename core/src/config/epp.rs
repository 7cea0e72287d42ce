//! `epp:`: kvedge as a gateway's endpoint picker (Envoy's external
//! processing gRPC protocol). Only read by the daemon's picker driver;
//! checked here so `kvedge check-config` catches its mistakes.

use serde::Deserialize;

/// `epp:`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppSection {
    /// Where the ext_proc gRPC service listens (`host:port`).
    #[serde(default = "listen")]
    pub listen: String,
    /// Largest request body read, in bytes (larger: 413).
    #[serde(default = "max_body_bytes")]
    pub max_body_bytes: usize,
    /// Largest prompt, in tokens (larger: 400).
    #[serde(default = "max_prompt_tokens")]
    pub max_prompt_tokens: usize,
    /// The request header naming the tenant the rule language sees.
    #[serde(default)]
    pub tenant_header: Option<String>,
    /// The request header naming a session (session affinity).
    #[serde(default)]
    pub session_header: Option<String>,
    /// Chunk size of the approximate prefix mode, in bytes: prompts the
    /// picker cannot tokenize are hashed in chunks of this size and routed
    /// to where their prefix was sent before. 0 turns the mode off (such
    /// prompts route on load alone).
    #[serde(default = "approximate_chunk_bytes")]
    pub approximate_chunk_bytes: usize,
    /// The models served, each with its tokenizer and chat template.
    pub models: Vec<EppModel>,
}

/// One served model.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppModel {
    pub name: String,
    /// A local `tokenizer.json`.
    #[serde(default)]
    pub tokenizer: Option<String>,
    /// A local Jinja chat template.
    #[serde(default)]
    pub chat_template: Option<String>,
    #[serde(default)]
    pub bos_token: String,
    #[serde(default)]
    pub eos_token: String,
}

fn listen() -> String {
    "0.0.0.0:9002".into()
}
fn max_body_bytes() -> usize {
    4 << 20
}
fn max_prompt_tokens() -> usize {
    131_072
}
/// About one 16-token KV block of English text (four bytes a token), so
/// an approximate overlap counts in blocks the cost model understands.
fn approximate_chunk_bytes() -> usize {
    64
}

/// The first unusable value: (key, message).
pub fn validate(e: &EppSection) -> Option<(&'static str, String)> {
    if e.listen.parse::<std::net::SocketAddr>().is_err() {
        return Some((
            "listen",
            format!(
                "epp.listen `{}` is not host:port (e.g. 0.0.0.0:9002)",
                e.listen
            ),
        ));
    }
    if !(1024..=(1 << 30)).contains(&e.max_body_bytes) {
        return Some((
            "max_body_bytes",
            format!(
                "epp.max_body_bytes must be between 1024 and {}, got {}",
                1u64 << 30,
                e.max_body_bytes
            ),
        ));
    }
    if !(1..=(1 << 24)).contains(&e.max_prompt_tokens) {
        return Some((
            "max_prompt_tokens",
            format!(
                "epp.max_prompt_tokens must be between 1 and {}, got {}",
                1 << 24,
                e.max_prompt_tokens
            ),
        ));
    }
    for (key, h) in [
        ("tenant_header", &e.tenant_header),
        ("session_header", &e.session_header),
    ] {
        let Some(h) = h else { continue };
        if h.is_empty()
            || !h
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Some((key, format!("epp.{key} `{h}` is not a header name")));
        }
    }
    if e.approximate_chunk_bytes != 0 && !(16..=65_536).contains(&e.approximate_chunk_bytes) {
        return Some((
            "approximate_chunk_bytes",
            format!(
                "epp.approximate_chunk_bytes must be 0 (off) or between 16 and 65536, got {}",
                e.approximate_chunk_bytes
            ),
        ));
    }
    if e.models.is_empty() {
        return Some(("models", "epp.models names no model".into()));
    }
    let mut seen = std::collections::HashSet::new();
    for m in &e.models {
        if m.name.is_empty() {
            return Some(("models", "an epp model has an empty name".into()));
        }
        if !seen.insert(&m.name) {
            return Some(("models", format!("epp model `{}` is named twice", m.name)));
        }
        for path in [&m.tokenizer, &m.chat_template].into_iter().flatten() {
            if let Err(err) = std::fs::metadata(path) {
                return Some(("models", format!("epp model `{}`: {path}: {err}", m.name)));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(extra: &str) -> EppSection {
        parse(&format!("{extra}models:\n  - name: m\n"))
    }

    /// The section as the loader reads it.
    fn parse(yaml: &str) -> EppSection {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn defaults_are_valid_and_each_bad_value_is_named() {
        let ok = section("");
        assert_eq!(ok.approximate_chunk_bytes, 64);
        assert_eq!(validate(&ok), None);
        assert_eq!(validate(&section("approximate_chunk_bytes: 0\n")), None);
        for (yaml, key) in [
            ("approximate_chunk_bytes: 8\n", "approximate_chunk_bytes"),
            (
                "approximate_chunk_bytes: 100000\n",
                "approximate_chunk_bytes",
            ),
            ("listen: nowhere\n", "listen"),
            ("max_body_bytes: 10\n", "max_body_bytes"),
            ("max_prompt_tokens: 0\n", "max_prompt_tokens"),
            ("tenant_header: \"a b\"\n", "tenant_header"),
            ("session_header: \"\"\n", "session_header"),
        ] {
            let (k, message) = validate(&section(yaml)).expect(yaml);
            assert_eq!(k, key, "{yaml}: {message}");
            assert!(message.contains(key), "{message}");
        }
        let mut twice = section("");
        twice.models.push(twice.models[0].clone());
        assert_eq!(validate(&twice).unwrap().0, "models");
    }
}
