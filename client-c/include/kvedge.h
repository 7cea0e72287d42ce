/*
 * kvedge.h: the C interface of kvedge (libkvedge.so, libkvedge.a).
 * Generated from the kvedge-c crate (client-c/src) by cbindgen; do not edit.
 *
 * Errors: fallible functions return a kvedge_status, KVEDGE_OK (0) on
 * success. kvedge_strerror(code) describes a code; kvedge_last_error_message()
 * returns the message of the calling thread's last failure. No function
 * crashes on a NULL or invalid argument: it returns an error.
 *
 * Threads: a handle (kvedge_publisher, kvedge_client) may be used by one
 * thread at a time; different handles are independent and may be used from
 * different threads at once. Error messages are per thread. Hashing has no
 * state and may be called from any thread.
 *
 * Blocking: the kvedge_publish_* functions never block and never allocate
 * after warm-up (a full ring drops the record and counts it). Opening a
 * publisher blocks up to 5 s. The query client blocks until the daemon
 * answers, or up to its timeout (kvedge_client_set_timeout_ms).
 *
 * Versions: KVEDGE_VERSION_MAJOR/MINOR/PATCH give the header's version and
 * kvedge_version() the library's, as (major << 16 | minor << 8 | patch).
 */

#ifndef KVEDGE_H
#define KVEDGE_H

#include <stdint.h>
#include <stddef.h>

// Most tolerations in a `kvedge_select_routing`.
#define KVEDGE_MAX_TOLERATIONS 32

// Most tags in a `kvedge_select_request`.
#define KVEDGE_MAX_TAGS 32

// Most headers in a `kvedge_select_request`.
#define KVEDGE_MAX_HEADERS 32

// Most labels `kvedge_publisher_open_labeled` takes.
#define KVEDGE_MAX_LABELS 64

// Most taints `kvedge_publisher_open_labeled` takes.
#define KVEDGE_MAX_TAINTS 16

// How long a client's call waits for the daemon unless
// `kvedge_client_set_timeout_ms` says otherwise, in milliseconds.
#define KVEDGE_DEFAULT_TIMEOUT_MS 10000

// KV tiers.
#define KVEDGE_TIER_DEVICE 0

#define KVEDGE_TIER_HOST 1

#define KVEDGE_TIER_DISK 2

// `kvedge_publish_cleared`: every tier.
#define KVEDGE_TIER_ALL -1

// Worker roles.
#define KVEDGE_ROLE_AGGREGATED 0

#define KVEDGE_ROLE_PREFILL 1

#define KVEDGE_ROLE_DECODE 2

#define KVEDGE_ROLE_ENCODE 3

// What started a session's turn (`kvedge_select_routing::trigger`).
#define KVEDGE_TRIGGER_USER 0

#define KVEDGE_TRIGGER_TOOL 1

#define KVEDGE_TRIGGER_OTHER 2

// `kvedge_publisher_poll` flag: the daemon asked for a resync and no
// callback was given; poll again with one to serve it.
#define KVEDGE_POLL_RESYNC_PENDING 1

// `kvedge_publisher_poll` flag: a resync snapshot was published.
#define KVEDGE_POLL_RESYNC_SERVED 2

// `kvedge_publisher_poll` flag: the daemon had gone away and the engine
// registered again (its blocks republished through the callback, or at
// the next poll that gives one).
#define KVEDGE_POLL_REGISTERED_AGAIN 4

// Bytes of `kvedge_select_result::endpoint`, NUL included.
#define KVEDGE_ENDPOINT_MAX 256

#define KVEDGE_VERSION_MAJOR 0

#define KVEDGE_VERSION_MINOR 2

#define KVEDGE_VERSION_PATCH 0

// A connection to the daemon's `query.sock`. Opaque.
typedef struct kvedge_client kvedge_client;

// An engine's registration and ring. Opaque.
typedef struct kvedge_publisher kvedge_publisher;

// Result of every fallible function: `KVEDGE_OK` (0) or an error code.
typedef int32_t kvedge_status;

// A select. Give the prompt as sequence hashes or as token ids (exactly
// one of the two non-empty).
typedef struct kvedge_select_request {
  // Required, UTF-8.
  const char *model;
  // Session (conversation) id for session affinity; NULL for none.
  const char *session;
  // `KVEDGE_ROLE_*`.
  uint32_t role;
  // Non-zero: answer without reserving the worker.
  uint32_t dry_run;
  const uint64_t *hashes;
  size_t n_hashes;
  const uint32_t *tokens;
  size_t n_tokens;
  // Prompt length in tokens (0: derived from the ids).
  uint32_t prompt_tokens;
  // Request priority, for the rules and policies (0: default).
  int32_t priority;
  // Tenant, for the rule language; NULL for none.
  const char *tenant;
  // `type-degree` tags for the rule language (at most `KVEDGE_MAX_TAGS`).
  const char *const *tags;
  size_t n_tags;
  // Request headers as parallel arrays (at most `KVEDGE_MAX_HEADERS`).
  const char *const *header_names;
  const char *const *header_values;
  size_t n_headers;
} kvedge_select_request;

// The daemon's answer.
typedef struct kvedge_select_result {
  uint64_t worker_id;
  // Pass to `kvedge_prefill_done` and `kvedge_finish`.
  uint64_t request_id;
  // The policy's cost of the chosen worker (NaN when there is none).
  double cost;
  uint32_t dp_rank;
  // Prefix-overlap blocks of the chosen worker per tier.
  uint32_t overlap_device;
  uint32_t overlap_host;
  uint32_t overlap_disk;
  // Non-zero: the rules chose an off-cluster provider, not a worker
  // (`kvedge_selected_provider` names it).
  uint32_t is_provider;
  // Length of the endpoint; if it is `KVEDGE_ENDPOINT_MAX` or more, the
  // copy below is truncated.
  uint32_t endpoint_len;
  // NUL-terminated.
  char endpoint[KVEDGE_ENDPOINT_MAX];
} kvedge_select_result;

// What `kvedge_select_ex` adds to a select: the session's metadata
// (what started the turn, its parent session, whether it is the last
// turn) and an explicit target. Zeroed, it asks for nothing: a select
// exactly as `kvedge_select` makes it. `trigger`, `session_final` and
// `parent_session` need the request's `session`.
typedef struct kvedge_select_routing {
  // `KVEDGE_TRIGGER_*` (0: a user's message).
  uint32_t trigger;
  // Non-zero: the session's last turn; its binding ends once placed.
  uint32_t session_final;
  // The session this one was forked from; NULL for none.
  const char *parent_session;
  // Non-zero: serve the request on exactly the worker below (no
  // policy runs; an unavailable target is `KVEDGE_ERR_NO_WORKER`).
  uint32_t has_target;
  uint32_t target_dp_rank;
  uint64_t target_worker_id;
  // The engines' taints this request tolerates, `key` or `key=value`
  // (at most `KVEDGE_MAX_TOLERATIONS`).
  const char *const *tolerations;
  size_t n_tolerations;
} kvedge_select_routing;

// What an engine (one data-parallel rank) says when it registers.
typedef struct kvedge_hello {
  uint64_t worker_id;
  uint32_t dp_rank;
  // `KVEDGE_ROLE_*`.
  uint32_t role;
  // The served model (required, UTF-8).
  const char *model;
  // Where frontends send requests for this worker (URL or socket path;
  // NULL for none).
  const char *endpoint;
  // Tokens per KV block (required, > 0).
  uint32_t block_size;
  uint32_t reserved;
  // Total KV blocks per tier.
  uint64_t kv_blocks_device;
  uint64_t kv_blocks_host;
  uint64_t kv_blocks_disk;
  // Ring size in bytes to ask for (0: the daemon's default).
  uint64_t ring_capacity;
} kvedge_hello;

// An engine's load, reported after its scheduler steps.
typedef struct kvedge_load {
  uint32_t active_requests;
  uint32_t waiting_requests;
  uint64_t active_prefill_tokens;
  uint64_t active_decode_blocks;
  uint64_t kv_used_blocks;
  uint64_t kv_total_blocks;
  // CLOCK_MONOTONIC nanoseconds when measured (0 if unknown).
  uint64_t timestamp_ns;
} kvedge_load;

// Resync callback: republish every block the engine holds (with
// `kvedge_publish_stored` on the publisher it is given), return 0 on
// success. It must not close the publisher.
typedef kvedge_status (*kvedge_resync_fn)(struct kvedge_publisher *publisher, void *user);

// Success.
#define KVEDGE_OK 0

// A required pointer argument was NULL.
#define KVEDGE_ERR_NULL_ARGUMENT 1

// An argument is out of range or not UTF-8 where text is required.
#define KVEDGE_ERR_INVALID_ARGUMENT 2

// The output buffer is too small; the needed size was written back.
#define KVEDGE_ERR_BUFFER_TOO_SMALL 3

// The daemon's socket could not be reached.
#define KVEDGE_ERR_CONNECT 4

// The daemon refused the engine's registration.
#define KVEDGE_ERR_REJECTED 5

// The daemon closed the connection (it exited or restarted); reconnect.
#define KVEDGE_ERR_CLOSED 6

// No reply within the client's timeout; the client must be reconnected.
#define KVEDGE_ERR_TIMEOUT 7

// Another I/O error.
#define KVEDGE_ERR_IO 8

// The peer sent something this library does not understand.
#define KVEDGE_ERR_PROTOCOL 9

// The daemon has no worker for the request (model, role, filters).
#define KVEDGE_ERR_NO_WORKER 10

// The daemon does not know this request id (finished or expired).
#define KVEDGE_ERR_UNKNOWN_REQUEST 11

// The daemon answered with another error; see the message.
#define KVEDGE_ERR_DAEMON 12

// A bug in the library (a caught panic); the handle should be closed.
#define KVEDGE_ERR_PANIC 13

// The daemon cannot give this client a query channel (its
// `daemon.max_query_rings` is reached, or its listener does not offer
// them); the client keeps working over the socket.
#define KVEDGE_ERR_UNAVAILABLE 14

#ifdef __cplusplus
extern "C" {
#endif // __cplusplus

// The library's version as `major << 16 | minor << 8 | patch`, to compare
// with the header's `KVEDGE_VERSION_*` at run time.
uint32_t kvedge_version(void);

// Copies the message of the calling thread's last failure into `buf`
// (NUL-terminated, truncated to `len - 1` bytes) and returns the message's
// full length. `buf` may be NULL (or `len` 0) to ask for the length only.
// Messages are per thread; a success does not clear them.
//
// # Safety
// `buf` is NULL or points to `len` writable bytes.
size_t kvedge_last_error_message(char *buf, size_t len);

// A static description of a status code (never NULL).
const char *kvedge_strerror(kvedge_status code);

// Connects to the daemon's query socket. On success `*out` is the client;
// close it with `kvedge_client_close`.
//
// # Safety
// `query_socket_path` is NUL-terminated; `out` is writable.
kvedge_status kvedge_client_connect(const char *query_socket_path, struct kvedge_client **out);

// Bounds how long each call waits for the daemon:
// [`KVEDGE_DEFAULT_TIMEOUT_MS`] from connect on, 0 for no bound. After a
// timeout the client must be closed and reconnected.
//
// # Safety
// `client` is a live handle used by this thread only.
kvedge_status kvedge_client_set_timeout_ms(struct kvedge_client *client, uint32_t timeout_ms);

// Moves this client's requests onto a query channel: a request ring and a
// reply ring in shared memory, created by the daemon. A select then costs
// no system call while the daemon is busy (a fraction of a blocking socket
// client's round trip: BENCHMARKS.md, "C library" and "Daemon").
// While waiting for a reply the calling thread polls for up to 50 µs,
// then sleeps. It holds its CPU while it polls, except when its request
// woke the sleeping daemon or the daemon runs on the same CPU: then it
// yields the CPU between checks, so that the daemon can answer. Requests too
// large for the ring still use the socket. `KVEDGE_ERR_UNAVAILABLE` leaves
// the client working over the socket. Calling it again is a no-op.
//
// # Safety
// `client` is a live handle used by this thread only.
kvedge_status kvedge_client_attach_rings(struct kvedge_client *client);

// Asks the daemon which worker should serve `request`; fills `result`.
// Unless `dry_run`, the worker is reserved until `kvedge_finish` (or the
// daemon's reservation TTL).
//
// # Safety
// `client` is a live handle used by this thread only; `request` points to
// a `kvedge_select_request` whose pointers follow its field comments;
// `result` is writable.
kvedge_status kvedge_select(struct kvedge_client *client,
                            const struct kvedge_select_request *request,
                            struct kvedge_select_result *result);

// `kvedge_select` with a session's metadata, an explicit target and the
// taints the request tolerates (`routing`; NULL: none, the same as
// `kvedge_select`). A function of
// its own so that programs built against an older header, whose
// `kvedge_select_request` has no room for these, keep working.
//
// # Safety
// As `kvedge_select`; `routing` is NULL or points to a
// `kvedge_select_routing` whose `parent_session` is NULL or a
// NUL-terminated string.
kvedge_status kvedge_select_ex(struct kvedge_client *client,
                               const struct kvedge_select_request *request,
                               const struct kvedge_select_routing *routing,
                               struct kvedge_select_result *result);

// The name of the off-cluster provider the last successful
// `kvedge_select` on `client` chose (when its `is_provider` was non-zero),
// as the rules' `providers:` section names it. Copies it NUL-terminated
// into `buf`, truncated to `len - 1` bytes, and returns its full length.
// The name is empty (0, and `buf` an empty string) when that select chose
// a worker, when none succeeded yet, or when `client` is NULL. A failed
// select leaves the name as it was.
//
// # Safety
// `client` is NULL or a live handle used by this thread only; `buf` is
// NULL or points to `len` writable bytes.
size_t kvedge_selected_provider(const struct kvedge_client *client, char *buf, size_t len);

// The request's prefill finished (its prompt tokens leave the worker's
// projected load).
//
// # Safety
// `client` is a live handle used by this thread only.
kvedge_status kvedge_prefill_done(struct kvedge_client *client, uint64_t request_id);

// The request finished (it leaves the worker's projected load).
//
// # Safety
// `client` is a live handle used by this thread only.
kvedge_status kvedge_finish(struct kvedge_client *client, uint64_t request_id);

// The request was never served: its dispatch to the chosen worker failed
// before a response stream (refused, timed out, a server error). It
// leaves the worker's projected load, and its session's binding goes
// back to what it was before its select. After `kvedge_prefill_done` it
// is the same as `kvedge_finish`.
//
// # Safety
// `client` is a live handle used by this thread only.
kvedge_status kvedge_abort(struct kvedge_client *client, uint64_t request_id);

// Closes the connection and frees the client. NULL is a no-op.
//
// # Safety
// `client` is NULL or a live handle, not used again afterwards.
void kvedge_client_close(struct kvedge_client *client);

// Sequence hashes of the full blocks of `tokens` (a partial last block is
// not hashed), identical to `kvedge hash` and to what the daemon computes
// for token-id selects. `lora_name` and `namespace_` change the seed (NULL
// or "" for none). Writes `n / block_size` hashes to `out` and their
// number to `*out_len`; if `out_cap` is smaller, writes nothing but the
// needed count and returns `KVEDGE_ERR_BUFFER_TOO_SMALL`. No allocation.
//
// # Safety
// `tokens` points to `n` `uint32_t` (may be NULL when `n` is 0); the
// strings are NULL or NUL-terminated; `out` points to `out_cap` writable
// `uint64_t` (may be NULL when `out_cap` is 0); `out_len` is writable.
kvedge_status kvedge_hash_blocks(const uint32_t *tokens,
                                 size_t n,
                                 uint32_t block_size,
                                 const char *lora_name,
                                 const char *namespace_,
                                 uint64_t *out,
                                 size_t out_cap,
                                 size_t *out_len);

// Registers with the daemon at `control_socket_path` and receives the
// ring. Blocks at most 5 s. On success `*out` is the publisher; close it
// with `kvedge_publisher_close` (which is also how the daemon learns the
// engine left).
//
// # Safety
// `control_socket_path` is NUL-terminated; `hello` points to a
// `kvedge_hello` whose strings are NULL or NUL-terminated; `out` is
// writable.
kvedge_status kvedge_publisher_open(const char *control_socket_path,
                                    const struct kvedge_hello *hello,
                                    struct kvedge_publisher **out);

// `kvedge_publisher_open` with labels and taints: `n_labels` (at most
// `KVEDGE_MAX_LABELS`) keys and values as parallel arrays, which the
// rule language matches (`backends: { labels }`, `backend.labels.<key>`;
// the `backend` label is the engine's backend name; a key is not empty
// and has no `=`), and `n_taints` (at most `KVEDGE_MAX_TAINTS`) taints,
// `key[=value]:NoSchedule` (requests that do not tolerate it never come)
// or `key[=value]:PreferNoSchedule` (their cost here is multiplied). A function of its own so that programs built against
// an older header, whose `kvedge_hello` has no room for labels, keep
// working.
//
// # Safety
// As `kvedge_publisher_open`; `label_keys` and `label_values` are NULL
// (with `n_labels` 0) or point to `n_labels` NUL-terminated strings each;
// `taints` is NULL (with `n_taints` 0) or points to `n_taints` of them.
kvedge_status kvedge_publisher_open_labeled(const char *control_socket_path,
                                            const struct kvedge_hello *hello,
                                            const char *const *label_keys,
                                            const char *const *label_values,
                                            size_t n_labels,
                                            const char *const *taints,
                                            size_t n_taints,
                                            struct kvedge_publisher **out);

// Blocks whose sequence hashes are `hashes[0..n]` became resident in
// `tier`, continuing the chain after `*parent_hash` (NULL: they start a
// sequence). Never blocks and never allocates after warm-up; a full ring
// drops the record and counts it (`kvedge_publisher_dropped`), which is
// not an error: the daemon notices the gap and asks for a resync.
//
// # Safety
// `publisher` is a live handle used by this thread only; `parent_hash` is
// NULL or readable; `hashes` points to `n` `uint64_t` (NULL if `n` is 0).
kvedge_status kvedge_publish_stored(struct kvedge_publisher *publisher,
                                    uint32_t tier,
                                    const uint64_t *parent_hash,
                                    const uint64_t *hashes,
                                    size_t n);

// Like `kvedge_publish_stored`, from token ids: the full blocks of
// `tokens[0..n]` (of `block_size` tokens) are hashed here, continuing after
// `*parent_hash`, with the default seed (no LoRA, no namespace).
//
// # Safety
// As `kvedge_publish_stored`, with `tokens` pointing to `n` `uint32_t`.
kvedge_status kvedge_publish_stored_tokens(struct kvedge_publisher *publisher,
                                           uint32_t tier,
                                           const uint64_t *parent_hash,
                                           const uint32_t *tokens,
                                           size_t n,
                                           uint32_t block_size);

// Blocks left `tier`.
//
// # Safety
// As `kvedge_publish_stored`.
kvedge_status kvedge_publish_removed(struct kvedge_publisher *publisher,
                                     uint32_t tier,
                                     const uint64_t *hashes,
                                     size_t n);

// Every block of `tier` left (`KVEDGE_TIER_ALL`: of every tier).
//
// # Safety
// `publisher` is a live handle used by this thread only.
kvedge_status kvedge_publish_cleared(struct kvedge_publisher *publisher, int32_t tier);

// The engine's load (the daemon's truth until the next report).
//
// # Safety
// `publisher` is a live handle used by this thread only; `load` readable.
kvedge_status kvedge_publish_load(struct kvedge_publisher *publisher,
                                  const struct kvedge_load *load);

// Call every 100 ms or so from the publishing thread: it runs the
// engine's session with the daemon. It sends the heartbeat when due and
// serves the daemon's resync requests: with `resync`, a pending request
// is served at once (the snapshot is opened, `resync` is called to
// republish every block, the snapshot is closed: flag
// `KVEDGE_POLL_RESYNC_SERVED`); if `resync` returns an error the snapshot
// stays open and incomplete, and that error is returned. Without it,
// `KVEDGE_POLL_RESYNC_PENDING` is set and the request is kept for a later
// poll. When the daemon has gone away (it restarted) the call returns
// `KVEDGE_ERR_CLOSED`, and later calls register again (after 100 ms,
// backing off to 5 s; an attempt blocks up to 5 s); once registered,
// `resync` is called to republish every block (without a snapshot: the
// new registration knows nothing) and `KVEDGE_POLL_REGISTERED_AGAIN` is
// set. `flags` (may be NULL) receives those bits.
//
// # Safety
// `publisher` is a live handle used by this thread only; `flags` is NULL
// or writable; `resync` does not close the publisher.
kvedge_status kvedge_publisher_poll(struct kvedge_publisher *publisher,
                                    kvedge_resync_fn resync,
                                    void *user,
                                    uint32_t *flags);

// Records dropped because the ring was full, since the publisher opened.
//
// # Safety
// `publisher` is NULL (returns 0) or a live handle.
uint64_t kvedge_publisher_dropped(const struct kvedge_publisher *publisher);

// Closes the registration (the daemon drops the worker at once) and
// frees the publisher. NULL is a no-op.
//
// # Safety
// `publisher` is NULL or a live handle, not used again afterwards.
void kvedge_publisher_close(struct kvedge_publisher *publisher);

#ifdef __cplusplus
}  // extern "C"
#endif  // __cplusplus

#endif  /* KVEDGE_H */
