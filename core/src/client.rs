//! Query connections as the core sees them: admission (the connection
//! limit and the peer-credential policy), activity for the idle timeout,
//! and which ones hold a query channel. The idle timeout itself runs in
//! [`Core::handle_timeout`].

use std::time::{Duration, Instant};

use kvedge_shm::control::PeerCred;
use kvedge_wire::{ErrorReply, Status};

use crate::core::Core;
use crate::warn::Warn;

/// A handle on one query connection, given by the core when it admits the
/// connection; stale once the client is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientId {
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

/// Why a driver dropped a query connection (the index of its counter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientDrop {
    /// Its replies waited unread past `daemon.max_reply_backlog_bytes`.
    SlowReader = 0,
    /// It held the most unfinished input when all connections' together
    /// passed `daemon.max_input_backlog_bytes`.
    InputBudget = 1,
}

impl ClientDrop {
    /// Every reason, in counter order.
    pub const ALL: [ClientDrop; 2] = [ClientDrop::SlowReader, ClientDrop::InputBudget];

    /// The reason's label in metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            ClientDrop::SlowReader => "slow_reader",
            ClientDrop::InputBudget => "input_backlog",
        }
    }
}

#[derive(Debug)]
pub(crate) struct Client {
    pub last_active: Instant,
    /// It has a query channel attached.
    pub rings: bool,
    /// Its selects keep the select path warm (see [`crate::warm`]).
    pub warms: bool,
}

impl Core {
    /// A connection arrived on the query socket: admitted, or refused
    /// (the error to send it before closing) by the connection limit or
    /// the peer-credential policy. `peer` is asked for the connection's
    /// credentials only when the configuration restricts clients.
    pub fn handle_client_connected(
        &mut self,
        now: Instant,
        peer: impl FnOnce() -> std::io::Result<PeerCred>,
    ) -> Result<ClientId, ErrorReply<'static>> {
        if let Err(refusal) = self.admission(peer) {
            self.counters.refused_connections += 1;
            self.warn(
                now,
                Warn::ClientRefused,
                format_args!(
                    "query connection refused ({}): {}",
                    refusal.status, refusal.message
                ),
            );
            return Err(refusal);
        }
        let (index, generation) = self.clients.insert(|_| Client {
            last_active: now,
            rings: false,
            warms: true,
        });
        self.due(now + Duration::from_millis(self.config.daemon.idle_timeout_ms));
        Ok(ClientId { index, generation })
    }

    fn admission(
        &self,
        peer: impl FnOnce() -> std::io::Result<PeerCred>,
    ) -> Result<(), ErrorReply<'static>> {
        let d = &self.config.daemon;
        if self.clients.len() >= d.max_query_connections {
            return Err(ErrorReply {
                status: Status::TooManyConnections,
                message: format!(
                    "the daemon serves at most {} connections",
                    d.max_query_connections
                )
                .into(),
            });
        }
        if !d.client_policy() {
            return Ok(());
        }
        let not_permitted = |message: String| ErrorReply {
            status: Status::NotPermitted,
            message: message.into(),
        };
        match peer() {
            Ok(c) if d.client_allowed(c.uid, c.gid) => Ok(()),
            Ok(c) => Err(not_permitted(format!(
                "uid {} gid {} (pid {}) is not in query_allowed_uids/gids",
                c.uid, c.gid, c.pid
            ))),
            Err(e) => Err(not_permitted(format!("no peer credentials: {e}"))),
        }
    }

    /// Client `id` sent bytes (a partial request counts): it is not idle.
    #[inline]
    pub fn handle_client_active(&mut self, now: Instant, id: ClientId) {
        if let Some(c) = self.clients.get_mut(id.index, id.generation) {
            c.last_active = now;
        }
    }

    /// Whether client `id`'s selects keep the select path warm between
    /// paced selects (they do unless told otherwise): a client whose every
    /// request costs far more than the select around it (the endpoint
    /// picker's HTTP) gains nothing from the wake-ups warming takes.
    pub fn set_client_warms(&mut self, id: ClientId, warms: bool) {
        if let Some(c) = self.clients.get_mut(id.index, id.generation) {
            c.warms = warms;
        }
    }

    /// Client `id`'s connection closed.
    pub fn handle_client_closed(&mut self, id: ClientId) {
        self.clients.remove(id.index, id.generation);
    }

    /// Client `id`'s driver dropped it (`why`): counted, logged (rate
    /// limited) and forgotten, like a close.
    pub fn handle_client_dropped(&mut self, now: Instant, id: ClientId, why: ClientDrop) {
        if self.clients.remove(id.index, id.generation).is_none() {
            return;
        }
        self.counters.dropped_clients[why as usize] += 1;
        let d = &self.config.daemon;
        let (limit, what) = match why {
            ClientDrop::SlowReader => (
                d.max_reply_backlog_bytes,
                "its unread replies passed daemon.max_reply_backlog_bytes",
            ),
            ClientDrop::InputBudget => (
                d.max_input_backlog_bytes,
                "unfinished requests of all connections passed daemon.max_input_backlog_bytes, and it held the most",
            ),
        };
        self.warn(
            now,
            Warn::ClientDropped,
            format_args!("query connection dropped: {what} ({limit} bytes)"),
        );
    }

    pub(crate) fn client_mut(&mut self, id: ClientId) -> Option<&mut Client> {
        self.clients.get_mut(id.index, id.generation)
    }

    /// Open query connections.
    pub fn clients(&self) -> usize {
        self.clients.len()
    }

    /// Query connections with a query channel attached.
    pub fn query_channels(&self) -> usize {
        self.clients.iter().filter(|(_, c)| c.rings).count()
    }
}
