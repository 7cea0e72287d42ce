//! How the core answers a frontend: [`Core::handle_request`] turns any
//! [`Request`] (from a binary frame, a JSON line or another thread's
//! driver) into a [`Reply`], once for every encoding. A select borrows
//! its names from the routing state and uses retained buffers, so a warm
//! select allocates nothing (an explained one does).

use std::time::{Duration, Instant};

use kvedge_policies::rules::TagBuf;
use kvedge_policies::{AgentHeaders, InputTrigger, SessionContext, WorkerType, WorkerWithDpRank};
use kvedge_schema::hash::{block_seed, full_blocks, sequence_hashes_into};
use kvedge_schema::messages::Tier;
use kvedge_wire::{
    ErrorReply, ExplainedWorker, Explanation, Ids, MAX_TAGS, Reply, Request, Select, Selected,
    Stats, Status, Trigger, Words, WorkerNotice, WorkerRow,
};

use crate::client::ClientId;
use crate::core::Core;
use crate::counters::EVENT_KINDS;
use crate::router::{RouterError, SelectRequest, SelectResult};
use kvedge_config::Config;

/// A granted query channel: the driver creates both rings with this
/// capacity and attach epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingsGrant {
    pub capacity: u64,
    pub attach_epoch: u64,
}

/// Why a reload was not applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReloadError {
    #[error("this daemon has no configuration file to reload")]
    NoConfigFile,
    #[error(transparent)]
    Invalid(#[from] kvedge_config::ConfigError),
}

/// The policies' view of a select's session `id`: its trigger, parent
/// and last turn as the client gave them.
fn session_context<'a>(id: &'a str, s: &Select<'a>) -> SessionContext<'a> {
    let trigger = match s.trigger {
        Trigger::User => InputTrigger::UserMessage,
        Trigger::Tool => InputTrigger::ToolResult,
        Trigger::Other => InputTrigger::Other,
    };
    let context = SessionContext::new(id, trigger).with_final(s.session_final);
    match s.parent_session {
        Some(parent) => context.with_parent(parent),
        None => context,
    }
}

/// A selection error's status.
fn status_of(e: &RouterError) -> Status {
    match e {
        RouterError::RejectedByRule { .. }
        | RouterError::RejectedByClassifier(_)
        | RouterError::TargetExcluded { .. } => Status::Rejected,
        RouterError::Deferred { .. } => Status::TooManyRequests,
        RouterError::NoRuleMatched => Status::NoRule,
        RouterError::Session(_) => Status::BadRequest,
        RouterError::NoWorkers { .. } | RouterError::Selection(_) => Status::NoWorker,
    }
}

impl Core {
    /// Answers `request` from client `client`. `AttachRings` and `Reload`
    /// need their driver's help (rings to create, a file to read): a
    /// driver that offers them calls [`Core::handle_attach_rings`] and
    /// [`Core::handle_reload`] instead; here they are refused.
    pub fn handle_request(
        &mut self,
        now: Instant,
        client: ClientId,
        request: &Request<'_>,
    ) -> Reply<'_> {
        self.handle_client_active(now, client);
        let reply = match request {
            Request::Select(s) => {
                let warms = self
                    .clients
                    .get(client.index, client.generation)
                    .is_none_or(|c| c.warms);
                return self.select(now, s, warms);
            }
            Request::PrefillDone { request_id } => {
                let now_ms = self.ms(now);
                self.release(|r| r.prefill_done(*request_id, now_ms))
            }
            Request::Finish { request_id } => self.release(|r| r.finish(*request_id)),
            Request::Abort { request_id } => {
                let now_ms = self.ms(now);
                self.release(|r| r.abort(*request_id, now_ms))
            }
            Request::AttachRings => Reply::error(
                Status::RingsUnavailable,
                "query channels are attached over query.sock served by the routing loop (daemon.query_io: epoll)",
            ),
            Request::Workers => Reply::Workers(self.worker_rows()),
            Request::Decisions => Reply::Decisions(self.decision_rows(now)),
            Request::Stats => Reply::Stats(Box::new(self.stats())),
            Request::Metrics => Reply::Metrics(crate::metrics::render(&self.metrics())),
            Request::Reload => {
                Reply::error(Status::ReloadFailed, ReloadError::NoConfigFile.to_string())
            }
        };
        if reply.status() != Status::Ok {
            self.counters.errors += 1;
        }
        reply
    }

    /// A request from `client` that did not decode: counted, and answered
    /// with its error.
    pub fn handle_undecodable(
        &mut self,
        now: Instant,
        client: ClientId,
        error: ErrorReply<'static>,
    ) -> Reply<'static> {
        self.handle_client_active(now, client);
        self.counters.errors += 1;
        Reply::Error(error)
    }

    /// Client `client` asks for a query channel: granted (and counted
    /// against `daemon.max_query_rings`) or refused with its reason.
    pub fn handle_attach_rings(
        &mut self,
        now: Instant,
        client: ClientId,
    ) -> Result<RingsGrant, ErrorReply<'static>> {
        let limit = self.config.daemon.max_query_rings;
        let attached = self.query_channels();
        let unavailable = |message: String| ErrorReply {
            status: Status::RingsUnavailable,
            message: message.into(),
        };
        let refusal = match self.client_mut(client) {
            None => Some(unavailable("this connection is not known".into())),
            Some(c) if c.rings => Some(unavailable(
                "this connection already has a query channel".into(),
            )),
            Some(_) if limit == 0 => Some(unavailable(
                "query channels are turned off (daemon.max_query_rings: 0); use the socket".into(),
            )),
            Some(_) if attached >= limit => Some(unavailable(format!(
                "{attached} query channels are attached, the limit (daemon.max_query_rings: {limit}); use the socket"
            ))),
            Some(c) => {
                c.rings = true;
                c.last_active = now;
                None
            }
        };
        if let Some(refusal) = refusal {
            self.counters.errors += 1;
            return Err(refusal);
        }
        Ok(RingsGrant {
            capacity: self.config.daemon.query_ring_capacity,
            attach_epoch: self.next_epoch(),
        })
    }

    /// The granted channel could not be set up (or was torn down): it no
    /// longer counts against the limit. The driver answers the error.
    pub fn handle_rings_detached(&mut self, client: ClientId) {
        if let Some(c) = self.client_mut(client) {
            c.rings = false;
        }
        self.counters.errors += 1;
    }

    /// A reload was asked for and the driver read the file: a valid
    /// configuration applies between two requests (fresh policy instances;
    /// index, load, reservations and session bindings kept) and the
    /// number of reloads so far is returned; an invalid one is refused and
    /// the previous one keeps serving.
    pub fn handle_reload(
        &mut self,
        _now: Instant,
        loaded: Result<Config, ReloadError>,
    ) -> Result<u64, ReloadError> {
        match loaded {
            Ok(config) => {
                self.router.reconfigure(&config);
                self.retired = Some(std::mem::replace(&mut self.config, config));
                self.counters.reloads += 1;
                tracing::info!(reloads = self.counters.reloads, "configuration reloaded");
                Ok(self.counters.reloads)
            }
            Err(e) => {
                if e != ReloadError::NoConfigFile {
                    self.counters.reload_failures += 1;
                }
                self.counters.errors += 1;
                tracing::error!("reload refused, the previous configuration keeps serving: {e}");
                Err(e)
            }
        }
    }

    /// The configuration the last reload replaced, for the driver to drop
    /// away from the routing thread (dropping a large one takes time).
    pub fn take_retired_config(&mut self) -> Option<Config> {
        self.retired.take()
    }

    /// Records how long a select took in the core, as its driver measured
    /// it (the core reads no clock).
    pub fn note_select_time(&mut self, took: Duration) {
        self.counters.select_latency.record(took.as_nanos() as u64);
    }

    fn release(
        &mut self,
        release: impl FnOnce(&mut crate::router::Router) -> Result<(), crate::load::LoadError>,
    ) -> Reply<'static> {
        match release(&mut self.router) {
            Ok(()) => Reply::Done,
            Err(e) => Reply::error(Status::UnknownRequest, e.to_string()),
        }
    }

    /// Block size of the workers serving `model` in `role` (16 when none is
    /// registered): how token ids are cut into blocks.
    fn block_size_for(&self, model: &str, role: WorkerType) -> u32 {
        self.router
            .workers()
            .find(|(_, w)| w.model == model && w.role == role)
            .map_or(16, |(_, w)| w.block_size)
    }

    /// The sequence hashes of `ids` into the retained buffer, and the
    /// prompt length they stand for.
    fn hash_prompt(&mut self, s: &Select<'_>, block_size: u32) -> (Vec<u64>, u32) {
        let mut hashes = std::mem::take(&mut self.scratch.hashes);
        hashes.clear();
        let derived = match s.ids {
            Ids::Hashes(w) => {
                w.extend_into(&mut hashes);
                hashes.len() as u32 * block_size
            }
            Ids::Tokens(w) => {
                let bs = block_size as usize;
                let tokens: &[u32] = match w {
                    Words::Slice(t) => t,
                    Words::Le(_) => {
                        self.scratch.tokens.clear();
                        w.extend_into(&mut self.scratch.tokens);
                        &self.scratch.tokens
                    }
                };
                hashes.resize(full_blocks(tokens.len(), bs), 0);
                sequence_hashes_into(tokens, bs, block_seed(s.lora, None), None, &mut hashes);
                tokens.len() as u32
            }
        };
        (hashes, s.prompt_tokens.unwrap_or(derived))
    }

    fn select(&mut self, now: Instant, s: &Select<'_>, warms: bool) -> Reply<'_> {
        let role = WorkerType::ALL[s.role as usize];
        if s.tags.len() > MAX_TAGS {
            self.counters.errors += 1;
            return Reply::error(Status::BadRequest, "more than 32 tags");
        }
        if !s.dry_run && self.router.load.reservations() >= self.config.daemon.max_reservations {
            self.counters.errors += 1;
            return Reply::error(
                Status::TooManyRequests,
                format!(
                    "{} requests are selected and not finished (daemon.max_reservations); finish some first",
                    self.router.load.reservations()
                ),
            );
        }
        let block_size = self.block_size_for(s.model, role);
        let (hashes, prompt_tokens) = self.hash_prompt(s, block_size);
        // Tags on the stack (at most MAX_TAGS): the client's, then the
        // configured classifiers' (length over the prompt's tokens, regex
        // over its text), which borrow from the rule policy held here.
        // Without rules or tags (the common fast path) nothing is built.
        let policy = self.router.rule_policy();
        let mut tags = TagBuf::default_if(policy.is_some() || !s.tags.is_empty());
        if let Some(tags) = &mut tags {
            for tag in s.tags.iter() {
                tags.push(tag);
            }
            if let Some(p) = &policy {
                if let Some(l) = p.length {
                    tags.push(l.tag(prompt_tokens));
                }
                if let Some(re) = &p.regex {
                    re.classify(s.text, tags);
                }
            }
        }
        let headers = (!s.headers.is_empty()).then(|| AgentHeaders::from_pairs(s.headers.iter()));
        let req = SelectRequest {
            model: s.model,
            tenant: s.tenant,
            tags: tags.as_ref().map_or(&[], TagBuf::as_slice),
            headers: headers.as_ref(),
            priority: s.priority,
            role,
            hashes: &hashes,
            prompt_tokens,
            session: s.session.map(|id| session_context(id, s)),
            pinned: s
                .target
                .map(|t| WorkerWithDpRank::new(t.worker_id, t.dp_rank)),
            now_ms: self.ms(now),
            dry_run: s.dry_run,
            subset: s.subset,
            tolerations: s.tolerations,
            approximate: s.approximate,
        };
        self.router.set_explain_costs(s.explain);
        let result = self.router.select(&req);
        self.router.set_explain_costs(false);
        if result.is_ok() && warms {
            let lasting = Duration::from_millis(self.config.daemon.warm_for_ms);
            self.warmth.selected(
                now,
                lasting,
                s.model,
                role,
                prompt_tokens,
                &hashes,
                s.approximate,
            );
            if let Some(at) = self.warm_next() {
                self.due(at);
            }
        }
        let e = self.router.last_explain();
        let decision = crate::recent::Decision {
            at_ms: self.ms(now),
            role,
            worker: None,
            provider: None,
            outcome: "ok",
            rule: e.rule,
            tier: e.tier,
            candidates: e.candidates,
            survivors: e.survivors,
            prompt_blocks: u32::try_from(hashes.len()).unwrap_or(u32::MAX),
            overlap_blocks: 0,
            prefix_sharers: e.prefix_sharers,
            dry_run: s.dry_run,
            generation: self.counters.reloads,
        };
        self.scratch.hashes = hashes;
        let policy = self.router.policy_name(role).0;
        let r = match result {
            Ok(r) => r,
            Err(e) => {
                self.counters.errors += 1;
                let status = status_of(&e);
                self.counters.count_selection(policy, None, status.name());
                self.recent.push(crate::recent::Decision {
                    outcome: status.name(),
                    ..decision
                });
                return Reply::error(status, e.to_string());
            }
        };
        self.recent.push(crate::recent::Decision {
            worker: r.slot.map(|_| (r.worker.worker_id, r.worker.dp_rank)),
            provider: r.provider,
            rule: r.rule,
            overlap_blocks: r.overlap_blocks[0],
            ..decision
        });
        let rule = r
            .rule
            .and_then(|i| self.router.rules().and_then(|p| p.rules.get(i)))
            .map(|rule| rule.name.as_str());
        self.counters.count_selection(policy, rule, "ok");
        self.counters.selects += 1;
        if !s.dry_run {
            let ttl = Duration::from_millis(self.config.daemon.reservation_ttl_ms);
            self.due(now + ttl);
        }
        let explain = s.explain.then(|| Box::new(self.explanation(role)));
        self.selected(&r, role, explain)
    }

    /// The reply to a successful selection.
    fn selected(
        &self,
        r: &SelectResult,
        role: WorkerType,
        explain: Option<Box<Explanation>>,
    ) -> Reply<'_> {
        let rules = self.router.rules();
        let (endpoint, provider) = match (r.slot, r.provider) {
            (Some(slot), _) => (
                self.router.worker(slot).map_or("", |w| w.endpoint.as_str()),
                None,
            ),
            (None, Some(p)) => match rules {
                Some(rules) => (
                    rules.providers[p].endpoint.as_str(),
                    Some(rules.providers[p].name.as_str()),
                ),
                None => ("", None),
            },
            (None, None) => ("", None),
        };
        Reply::Selected(Selected {
            worker: r.slot.map(|_| (r.worker.worker_id, r.worker.dp_rank)),
            provider,
            endpoint,
            overlap_blocks: r.overlap_blocks,
            cost: r.cost,
            policy: self.router.policy_name(role).0,
            rule: r
                .rule
                .and_then(|i| rules.and_then(|p| p.rules.get(i)))
                .map(|rule| rule.name.as_str()),
            request_id: r.request_id,
            explain,
        })
    }

    /// The most recent selections, newest first, their names resolved in
    /// the configuration they were made under.
    pub fn decision_rows(&self, now: Instant) -> Vec<kvedge_wire::DecisionRow> {
        let now_ms = self.ms(now);
        let rules = self.router.rules();
        self.recent
            .newest_first()
            .map(|d| {
                let current = d.generation == self.counters.reloads;
                let rule = d
                    .rule
                    .filter(|_| current)
                    .and_then(|i| rules.and_then(|p| p.rules.get(i)))
                    .map(|r| r.name.clone());
                kvedge_wire::DecisionRow {
                    age_ms: now_ms.saturating_sub(d.at_ms),
                    worker_id: d.worker.map(|w| w.0),
                    dp_rank: d.worker.map(|w| w.1),
                    provider: d
                        .provider
                        .filter(|_| current)
                        .and_then(|i| rules.and_then(|p| p.providers.get(i)))
                        .map(|p| p.name.clone()),
                    outcome: d.outcome,
                    role: d.role.as_str(),
                    policy: self.router.policy_name(d.role).0.to_owned(),
                    stage: if d.rule.is_some() { "rule" } else { "policy" },
                    rule,
                    tier: d.tier,
                    candidates: d.candidates,
                    survivors: d.survivors,
                    prompt_blocks: d.prompt_blocks,
                    overlap_blocks: d.overlap_blocks,
                    prefix_sharers: d.prefix_sharers,
                    dry_run: d.dry_run,
                }
            })
            .collect()
    }

    /// How the last selection went, with every available worker of `role`.
    fn explanation(&self, role: WorkerType) -> Explanation {
        let e = self.router.last_explain();
        Explanation {
            candidates: e.candidates,
            survivors: e.survivors,
            tier: e.tier,
            considered: e.considered,
            after_exclude: e.after_exclude,
            fell_through: e.fell_through,
            prefix_sharers: e.prefix_sharers,
            workers: self
                .router
                .workers()
                .filter(|(_, w)| w.available && w.role == role)
                .map(|(slot, w)| {
                    let load = self.router.load.projected(slot);
                    ExplainedWorker {
                        worker_id: w.worker.worker_id,
                        dp_rank: w.worker.dp_rank,
                        model: w.model.clone(),
                        cost: self.router.last_cost(slot),
                        overlap_blocks: self.router.last_overlap(slot),
                        active_requests: load.active_requests,
                        active_prefill_tokens: load.active_prefill_tokens,
                        active_decode_blocks: load.active_decode_blocks,
                        recent_selections: self.router.last_recent(slot),
                        ttft: {
                            let t = self.router.last_ttft(slot);
                            kvedge_wire::TtftExplained {
                                queue_ms: t.queue_s * 1e3,
                                prefill_ms: t.prefill_s * 1e3,
                                wait_ms: t.wait_s * 1e3,
                                decode_ms: t.decode_s * 1e3,
                                total_ms: t.total_s() * 1e3,
                                tokens_per_second: t.tokens_per_second,
                                speed: t.speed_source.as_str(),
                            }
                        },
                    }
                })
                .collect(),
        }
    }

    /// Every registered worker with its state, load and index counts, as
    /// `workers` and the metrics report them.
    pub fn worker_rows(&self) -> Vec<WorkerRow> {
        let engines = self.engines_by_slot();
        self.router
            .workers()
            .map(|(slot, w)| {
                let load = self.router.load.projected(slot);
                let report = self.router.load.reported(slot);
                let speed = self.router.prefill_speed(slot);
                let picks = self.router.picks(slot);
                WorkerRow {
                    picks: picks.requests,
                    picked_prompt_blocks: picks.prompt_blocks,
                    picked_cached_blocks: picks.cached_blocks,
                    worker_id: w.worker.worker_id,
                    dp_rank: w.worker.dp_rank,
                    model: w.model.clone(),
                    role: w.role.as_str(),
                    endpoint: w.endpoint.clone(),
                    labels: w.labels.clone(),
                    state: engines[slot.index()].map_or("", |e| e.state.as_str()),
                    notices: engines[slot.index()]
                        .map(|e| {
                            e.notices
                                .iter()
                                .map(|n| WorkerNotice {
                                    code: kvedge_schema::messages::notice::name(n.code),
                                    count: n.count,
                                    message: n.message.clone(),
                                    active: n.active,
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    available: w.available,
                    active_requests: load.active_requests,
                    waiting_requests: report.waiting_requests,
                    active_prefill_tokens: load.active_prefill_tokens,
                    kv_used_blocks: report.kv_used_blocks,
                    kv_total_blocks: report.kv_total_blocks,
                    device_blocks: self.router.index.worker_blocks(slot, Tier::Device) as u64,
                    prefill_tokens_per_second: speed.0.round() as u64,
                    speed: speed.1.as_str(),
                }
            })
            .collect()
    }

    /// The counters `stats` reports.
    pub fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            workers: self.engines(),
            clients: self.clients(),
            query_channels: self.query_channels(),
            index_entries: self.router.index.entries(),
            index_refused_full: self.router.index.refused_full(),
            reservations: self.router.load.reservations(),
            selects: c.selects,
            errors: c.errors,
            select_latency: c.select_latency.summary(),
            reloads: c.reloads,
            reload_failures: c.reload_failures,
            refused_registrations: c.refused_registrations,
            refused_connections: c.refused_connections,
        }
    }

    /// The counters and gauges a scrape reports.
    pub fn metrics(&self) -> crate::metrics::Snapshot {
        let c = &self.counters;
        crate::metrics::Snapshot {
            selections: c
                .selections
                .iter()
                .map(|(p, r, o, n)| {
                    (
                        p.clone(),
                        r.clone().unwrap_or_default(),
                        (*o).to_owned(),
                        *n,
                    )
                })
                .collect(),
            select_latency: c.select_latency.clone(),
            events: EVENT_KINDS.iter().copied().zip(c.events).collect(),
            ring_gaps: c.ring_gaps,
            ring_drops: c.departed_drops + self.live_drops(),
            resyncs: c.resyncs,
            warmups: self.warmth.runs,
            index_entries: self.router.index.entries() as u64,
            index_refused_full: self.router.index.refused_full(),
            index_evicted: self.router.index.evicted(),
            workers: self.worker_rows(),
            clients: self.clients() as u64,
            query_channels: self.query_channels() as u64,
            reservations: self.router.load.reservations() as u64,
            reservations_expired: self.router.load.expired(),
            prefills_from_events: self.router.prefills_from_events(),
            reloads: c.reloads,
            reload_failures: c.reload_failures,
            refused_connections: c.refused_connections,
            refused_registrations: c.refused_registrations,
            dropped_connections: crate::ClientDrop::ALL
                .iter()
                .map(|&d| (d.as_str(), c.dropped_clients[d as usize]))
                .collect(),
            picker: c.picker.clone(),
            routing_loop: c.routing_loop,
        }
    }

    /// The endpoint picker's driver reports what its bounds did (about
    /// once a second), for the metrics.
    pub fn handle_picker_stats(&mut self, stats: crate::metrics::PickerStats) {
        self.counters.picker = Some(stats);
    }

    /// The routing loop reports how it waits (each tick), for the
    /// metrics.
    pub fn handle_loop_stats(&mut self, stats: crate::metrics::LoopStats) {
        self.counters.routing_loop = stats;
    }

    /// One line for `systemctl status`.
    pub fn status(&self) -> String {
        format!(
            "{} workers, {} clients, {} selects, {} index entries",
            self.engines(),
            self.clients(),
            self.counters.selects,
            self.router.index.entries()
        )
    }
}
