//! The JSON-lines encoding, for people and scripts: one object per line
//! each way. A request is a flat object with an `op`; a reply is the
//! answer's fields, or `{"error":{"code":...,"message":...}}` where the
//! code is a [`Status`] name. Decoding a request parses into a
//! [`JsonRequest`] (owned strings and vectors), which lends out the same
//! [`Request`] a binary frame decodes into.

use std::collections::BTreeMap;

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Serialize, Serializer};

use crate::reply::{Explanation, Reply, Selected};
use crate::request::{Ids, Pairs, Request, Role, Select, Strs, Word, Words};
use crate::{ErrorReply, Status};

/// One request line as parsed. A flat struct rather than an internally
/// tagged enum: serde buffers a tagged enum's whole content before
/// dispatching, which for a 2,048-token prompt cost most of a round trip.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JsonRequest {
    op: String,
    model: Option<String>,
    role: Option<String>,
    tokens: Option<Vec<u32>>,
    hashes: Option<Vec<u64>>,
    prompt_tokens: Option<u32>,
    session: Option<String>,
    tenant: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    lora: Option<String>,
    text: Option<String>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    explain: bool,
    #[serde(default)]
    priority: i32,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    subset: Vec<String>,
    #[serde(default)]
    approximate: bool,
    trigger: Option<String>,
    parent_session: Option<String>,
    #[serde(default, rename = "final")]
    session_final: bool,
    target: Option<TargetJson>,
    #[serde(default)]
    tolerations: Vec<String>,
    request_id: Option<u64>,
}

/// An explicit target as JSON: `{"worker_id": 7, "dp_rank": 0}` (rank 0
/// when omitted).
#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct TargetJson {
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
}

fn bad(message: String) -> ErrorReply<'static> {
    ErrorReply {
        status: Status::BadRequest,
        message: message.into(),
    }
}

/// Parses one request line (without its newline).
pub fn decode_request(line: &[u8]) -> Result<JsonRequest, ErrorReply<'static>> {
    serde_json::from_slice(line).map_err(|e| bad(format!("not a valid request: {e}")))
}

impl JsonRequest {
    /// The request this line asks, borrowing from it.
    pub fn request(&self) -> Result<Request<'_>, ErrorReply<'static>> {
        let need_id = |op: &str| {
            self.request_id
                .ok_or_else(|| bad(format!("`{op}` needs `request_id`")))
        };
        Ok(match self.op.as_str() {
            "select" => Request::Select(self.select()?),
            "prefill_done" => Request::PrefillDone {
                request_id: need_id("prefill_done")?,
            },
            "finish" => Request::Finish {
                request_id: need_id("finish")?,
            },
            "abort" => Request::Abort {
                request_id: need_id("abort")?,
            },
            "workers" => Request::Workers,
            "stats" => Request::Stats,
            "metrics" => Request::Metrics,
            "reload" => Request::Reload,
            "decisions" => Request::Decisions,
            other => {
                return Err(bad(format!(
                    "unknown op `{other}` (select, prefill_done, finish, abort, workers, stats, metrics, reload, decisions)"
                )));
            }
        })
    }

    fn select(&self) -> Result<Select<'_>, ErrorReply<'static>> {
        let model = self
            .model
            .as_deref()
            .ok_or_else(|| bad("`select` needs `model`".into()))?;
        let role = match self.role.as_deref() {
            None => Role::Aggregated,
            Some(r) => Role::parse(r).ok_or_else(|| bad(format!("unknown role `{r}`")))?,
        };
        let ids = match (&self.tokens, &self.hashes) {
            (Some(t), None) => Ids::tokens(t),
            (None, Some(h)) => Ids::hashes(h),
            _ => return Err(bad("give exactly one of `tokens` and `hashes`".into())),
        };
        let mut s = Select::new(model, role, ids);
        s.prompt_tokens = self.prompt_tokens;
        s.session = self.session.as_deref();
        s.lora = self.lora.as_deref();
        s.text = self.text.as_deref();
        s.dry_run = self.dry_run;
        s.explain = self.explain;
        s.priority = self.priority;
        s.tenant = self.tenant.as_deref();
        s.tags = Strs::strings(&self.tags);
        s.headers = Pairs::map(&self.headers);
        if self.subset.len() > crate::request::MAX_SUBSET {
            return Err(bad(format!(
                "a subset of {} endpoints (at most {})",
                self.subset.len(),
                crate::request::MAX_SUBSET
            )));
        }
        s.subset = Strs::strings(&self.subset);
        if self.approximate && self.hashes.is_none() {
            return Err(bad(
                "`approximate` needs `hashes` (of the prompt's text chunks)".into(),
            ));
        }
        s.approximate = self.approximate;
        if let Some(t) = self.trigger.as_deref() {
            s.trigger = crate::request::Trigger::parse(t)
                .ok_or_else(|| bad(format!("unknown trigger `{t}` (user, tool, other)")))?;
        }
        s.parent_session = self.parent_session.as_deref();
        s.session_final = self.session_final;
        s.target = self.target.map(|t| crate::request::Target {
            worker_id: t.worker_id,
            dp_rank: t.dp_rank,
        });
        if self.tolerations.len() > crate::request::MAX_TOLERATIONS {
            return Err(bad(format!(
                "{} tolerations (at most {})",
                self.tolerations.len(),
                crate::request::MAX_TOLERATIONS
            )));
        }
        s.tolerations = Strs::strings(&self.tolerations);
        s.check_session_metadata().map_err(|e| bad(e.into()))?;
        Ok(s)
    }
}

impl<T: Word + Serialize> Serialize for Words<'_, T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.len()))?;
        for v in self.iter() {
            seq.serialize_element(&v)?;
        }
        seq.end()
    }
}

impl Serialize for Strs<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl Serialize for Pairs<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.len()))?;
        for (k, v) in self.iter() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

fn is_false(b: &bool) -> bool {
    !b
}

fn is_zero(v: &i32) -> bool {
    *v == 0
}

/// A request line as a client writes it.
#[derive(Serialize)]
struct RequestOut<'a> {
    op: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens: Option<Words<'a, u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    hashes: Option<Words<'a, u64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    session: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tenant: Option<&'a str>,
    #[serde(skip_serializing_if = "Strs::is_empty")]
    tags: Strs<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lora: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    #[serde(skip_serializing_if = "is_false")]
    dry_run: bool,
    #[serde(skip_serializing_if = "is_false")]
    explain: bool,
    #[serde(skip_serializing_if = "is_zero")]
    priority: i32,
    #[serde(skip_serializing_if = "Pairs::is_empty")]
    headers: Pairs<'a>,
    #[serde(skip_serializing_if = "Strs::is_empty")]
    subset: Strs<'a>,
    #[serde(skip_serializing_if = "is_false")]
    approximate: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    trigger: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    parent_session: Option<&'a str>,
    #[serde(rename = "final", skip_serializing_if = "is_false")]
    session_final: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    target: Option<TargetJson>,
    #[serde(skip_serializing_if = "Strs::is_empty")]
    tolerations: Strs<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<u64>,
}

/// Appends `request` as one line (newline included). Fails only for
/// `attach_rings`, which is in the binary protocol only.
pub fn encode_request(out: &mut Vec<u8>, request: &Request<'_>) -> Result<(), &'static str> {
    let mut line = RequestOut {
        op: request.op_name(),
        model: None,
        role: None,
        tokens: None,
        hashes: None,
        prompt_tokens: None,
        session: None,
        tenant: None,
        tags: Strs::EMPTY,
        lora: None,
        text: None,
        dry_run: false,
        explain: false,
        priority: 0,
        headers: Pairs::EMPTY,
        subset: Strs::EMPTY,
        approximate: false,
        trigger: None,
        parent_session: None,
        session_final: false,
        target: None,
        tolerations: Strs::EMPTY,
        request_id: None,
    };
    match *request {
        Request::Select(s) => {
            line.model = Some(s.model);
            line.role = Some(s.role.as_str());
            match s.ids {
                Ids::Tokens(t) => line.tokens = Some(t),
                Ids::Hashes(h) => line.hashes = Some(h),
            }
            line.prompt_tokens = s.prompt_tokens;
            line.session = s.session;
            line.tenant = s.tenant;
            line.tags = s.tags;
            line.lora = s.lora;
            line.text = s.text;
            line.dry_run = s.dry_run;
            line.explain = s.explain;
            line.priority = s.priority;
            line.headers = s.headers;
            line.subset = s.subset;
            line.approximate = s.approximate;
            line.trigger = (s.trigger != crate::request::Trigger::User).then(|| s.trigger.as_str());
            line.parent_session = s.parent_session;
            line.session_final = s.session_final;
            line.target = s.target.map(|t| TargetJson {
                worker_id: t.worker_id,
                dp_rank: t.dp_rank,
            });
            line.tolerations = s.tolerations;
        }
        Request::PrefillDone { request_id }
        | Request::Finish { request_id }
        | Request::Abort { request_id } => {
            line.request_id = Some(request_id);
        }
        Request::AttachRings => return Err("attach_rings is in the binary protocol only"),
        Request::Workers
        | Request::Stats
        | Request::Metrics
        | Request::Reload
        | Request::Decisions => {}
    }
    write_line(out, &line);
    Ok(())
}

/// Device, host and disk block counts as `{"device","host","disk"}`.
#[derive(Serialize)]
struct Tiers {
    device: u32,
    host: u32,
    disk: u32,
}

impl From<[u32; 3]> for Tiers {
    fn from([device, host, disk]: [u32; 3]) -> Self {
        Tiers { device, host, disk }
    }
}

pub(crate) fn tiers<S: Serializer>(t: &[u32; 3], s: S) -> Result<S::Ok, S::Error> {
    Tiers::from(*t).serialize(s)
}

#[derive(Serialize)]
struct SelectedOut<'a> {
    explain: Option<&'a Explanation>,
    worker_id: Option<u64>,
    dp_rank: Option<u32>,
    provider: Option<&'a str>,
    endpoint: &'a str,
    overlap_blocks: Tiers,
    cost: Option<f64>,
    policy: &'a str,
    rule: Option<&'a str>,
    request_id: u64,
}

impl<'a> From<&'a Selected<'a>> for SelectedOut<'a> {
    fn from(s: &'a Selected<'a>) -> Self {
        SelectedOut {
            explain: s.explain.as_deref(),
            worker_id: s.worker.map(|w| w.0),
            dp_rank: s.worker.map(|w| w.1),
            provider: s.provider,
            endpoint: s.endpoint,
            overlap_blocks: s.overlap_blocks.into(),
            cost: s.cost.is_finite().then_some(s.cost),
            policy: s.policy,
            rule: s.rule,
            request_id: s.request_id,
        }
    }
}

#[derive(Serialize)]
struct ErrorOut<'a> {
    error: ErrorBody<'a>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'static str,
    message: &'a str,
}

/// Writes `value` and a newline. Serializing these types into a vector
/// cannot fail (no maps with non-string keys, no failing `Serialize`).
fn write_line(out: &mut Vec<u8>, value: &impl Serialize) {
    let _ = serde_json::to_writer(&mut *out, value);
    out.push(b'\n');
}

/// Appends `reply` as one line (newline included).
pub fn encode_reply(out: &mut Vec<u8>, reply: &Reply<'_>) {
    match reply {
        Reply::Selected(s) => write_line(out, &SelectedOut::from(s)),
        Reply::Done => write_line(out, &serde_json::json!({"ok": true})),
        Reply::Reloaded { reloads } => {
            write_line(out, &serde_json::json!({"ok": true, "reloads": reloads}))
        }
        Reply::RingsAttached { capacity } => {
            write_line(out, &serde_json::json!({"ok": true, "capacity": capacity}))
        }
        Reply::Workers(w) => write_line(out, &serde_json::json!({ "workers": w })),
        Reply::Stats(s) => write_line(out, s),
        Reply::Metrics(text) => write_line(out, &serde_json::json!({ "text": text })),
        Reply::Decisions(d) => write_line(out, &serde_json::json!({ "decisions": d })),
        Reply::Error(e) => write_error(out, e.status, &e.message),
    }
}

/// Appends an error line.
pub fn write_error(out: &mut Vec<u8>, status: Status, message: &str) {
    write_line(
        out,
        &ErrorOut {
            error: ErrorBody {
                code: status.name(),
                message,
            },
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reply::{ExplainedWorker, WorkerRow};
    use serde_json::{Value, json};

    fn line(reply: &Reply<'_>) -> Value {
        let mut out = Vec::new();
        encode_reply(&mut out, reply);
        assert_eq!(out.pop(), Some(b'\n'));
        serde_json::from_slice(&out).unwrap()
    }

    #[test]
    fn a_request_line_round_trips() {
        let tags = ["a-b".to_owned()];
        let headers: BTreeMap<String, String> = [("x".to_owned(), "y".to_owned())].into();
        let mut s = Select::new("m", Role::Decode, Ids::tokens(&[1, 2, 3]));
        s.session = Some("s");
        s.dry_run = true;
        s.explain = true;
        s.tags = Strs::strings(&tags);
        s.headers = Pairs::map(&headers);
        let mut out = Vec::new();
        encode_request(&mut out, &Request::Select(s)).unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            json!({"op": "select", "model": "m", "role": "decode", "tokens": [1, 2, 3],
                   "session": "s", "tags": ["a-b"], "dry_run": true, "explain": true,
                   "headers": {"x": "y"}})
        );
        let parsed = decode_request(&out[..out.len() - 1]).unwrap();
        let Request::Select(d) = parsed.request().unwrap() else {
            panic!("not a select")
        };
        assert_eq!(
            (d.model, d.role, d.session, d.dry_run),
            ("m", Role::Decode, Some("s"), true)
        );
        assert_eq!(d.headers.iter().collect::<Vec<_>>(), [("x", "y")]);
        out.clear();
        encode_request(&mut out, &Request::Finish { request_id: 7 }).unwrap();
        assert_eq!(out, b"{\"op\":\"finish\",\"request_id\":7}\n");
    }

    #[test]
    fn session_metadata_and_a_target_round_trip() {
        let line = r#"{"op":"select","model":"m","hashes":[1],"session":"c","trigger":"tool","parent_session":"p","final":true,"target":{"worker_id":7}}"#;
        let parsed = decode_request(line.as_bytes()).unwrap();
        let Request::Select(d) = parsed.request().unwrap() else {
            panic!("not a select")
        };
        assert_eq!(
            (d.trigger, d.parent_session, d.session_final),
            (crate::Trigger::Tool, Some("p"), true)
        );
        assert_eq!(
            d.target,
            Some(crate::Target {
                worker_id: 7,
                dp_rank: 0
            })
        );
        let mut out = Vec::new();
        encode_request(&mut out, &Request::Select(d)).unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            json!({"op": "select", "model": "m", "role": "aggregated", "hashes": [1],
                   "session": "c", "trigger": "tool", "parent_session": "p", "final": true,
                   "target": {"worker_id": 7, "dp_rank": 0}})
        );
        for (bad, says) in [
            (
                r#"{"op":"select","model":"m","hashes":[1],"trigger":"tool"}"#,
                "give `session`",
            ),
            (
                r#"{"op":"select","model":"m","hashes":[1],"final":true}"#,
                "give `session`",
            ),
            (
                r#"{"op":"select","model":"m","hashes":[1],"session":"s","trigger":"bot"}"#,
                "unknown trigger `bot`",
            ),
            (
                r#"{"op":"select","model":"m","hashes":[1],"target":{"dp_rank":1}}"#,
                "worker_id",
            ),
        ] {
            let e = decode_request(bad.as_bytes())
                .and_then(|r| r.request().map(|_| ()))
                .unwrap_err();
            assert!(e.message.contains(says), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn bad_lines_say_what_is_wrong() {
        let err = |l: &str| {
            decode_request(l.as_bytes())
                .and_then(|r| r.request().map(|_| ()))
                .unwrap_err()
        };
        assert!(err("{nope").message.starts_with("not a valid request"));
        assert!(
            err(r#"{"op":"select","model":"m"}"#)
                .message
                .contains("exactly one")
        );
        assert!(
            err(r#"{"op":"select","hashes":[]}"#)
                .message
                .contains("needs `model`")
        );
        assert_eq!(
            err(r#"{"op":"select","model":"m","hashes":[],"role":"chef"}"#).message,
            "unknown role `chef`"
        );
        assert_eq!(
            err(r#"{"op":"finish"}"#).message,
            "`finish` needs `request_id`"
        );
        assert!(
            err(r#"{"op":"attach_rings"}"#)
                .message
                .starts_with("unknown op")
        );
        assert!(
            err(r#"{"op":"stats","x":1}"#)
                .message
                .contains("unknown field")
        );
        assert_eq!(err("{}").status, Status::BadRequest);
    }

    #[test]
    fn replies_have_their_documented_shape() {
        let s = Selected {
            worker: None,
            provider: Some("cloud"),
            endpoint: "https://x",
            overlap_blocks: [1, 2, 3],
            cost: f64::NAN,
            policy: "default",
            rule: Some("burst"),
            request_id: 4,
            explain: Some(Box::new(Explanation {
                candidates: 2,
                tier: Some(0),
                workers: vec![ExplainedWorker {
                    worker_id: 1,
                    dp_rank: 0,
                    model: "m".into(),
                    cost: None,
                    overlap_blocks: [5, 0, 0],
                    active_requests: 1,
                    active_prefill_tokens: 2,
                    active_decode_blocks: 3,
                    recent_selections: 2.5,
                    ttft: Default::default(),
                }],
                ..Explanation::default()
            })),
        };
        let v = line(&Reply::Selected(s));
        assert_eq!(v["worker_id"], Value::Null);
        assert_eq!(v["provider"], "cloud");
        assert_eq!(v["cost"], Value::Null);
        assert_eq!(
            v["overlap_blocks"],
            json!({"device": 1, "host": 2, "disk": 3})
        );
        assert_eq!(v["explain"]["workers"][0]["overlap_blocks"]["device"], 5);
        assert_eq!(v["explain"]["tier"], 0);
        assert_eq!(
            line(&Reply::error(Status::NoWorker, "none")),
            json!({"error": {"code": "no_worker", "message": "none"}})
        );
        assert_eq!(line(&Reply::Done), json!({"ok": true}));
        let w = line(&Reply::Workers(vec![WorkerRow {
            worker_id: 3,
            role: "prefill",
            state: "live",
            ..WorkerRow::default()
        }]));
        assert_eq!(w["workers"][0]["role"], "prefill");
        assert_eq!(w["workers"][0]["state"], "live");
    }
}
