/* Against a running daemon: an engine publishes through its ring, a
 * frontend selects and finds its blocks, releases the request, and every
 * bogus argument on live handles is an error; a ring overflowed on purpose
 * is resynced through the callback. Then the harness stops the daemon and
 * every call returns an error code instead of crashing. The harness runs
 * the daemon's loop and answers "pause", "resume" and "stop" on stdin.
 * Usage: live CONTROL_SOCKET QUERY_SOCKET */
#define _POSIX_C_SOURCE 200809L
#include <string.h>
#include <time.h>

#include "check.h"

/* Says `say` to the harness and waits for its one-line answer. */
static int harness(const char *say) {
    char line[32];
    printf("%s\n", say);
    fflush(stdout);
    return fgets(line, sizeof line, stdin) != NULL;
}

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

typedef struct {
    const uint32_t *tokens;
    int calls;
} resync_state;

static kvedge_status republish(kvedge_publisher *p, void *user) {
    resync_state *s = (resync_state *)user;
    s->calls++;
    return kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, s->tokens, 64, 16);
}

int main(int argc, char **argv) {
    CHECK(argc == 3);
    kvedge_hello h;
    memset(&h, 0, sizeof h);
    h.worker_id = 7;
    h.model = "llama";
    h.endpoint = "http://seven";
    h.block_size = 16;
    h.kv_blocks_device = 1000;
    kvedge_publisher *p = NULL;
    EXPECT(kvedge_publisher_open(argv[1], &h, &p), KVEDGE_OK);
    CHECK(p != NULL);
    /* The same (worker, rank) twice is refused while the first is live. */
    kvedge_publisher *twin = NULL;
    EXPECT(kvedge_publisher_open(argv[1], &h, &twin), KVEDGE_ERR_REJECTED);
    CHECK(twin == NULL);

    uint32_t tokens[64];
    for (uint32_t i = 0; i < 64; i++) tokens[i] = 1000 + i;
    EXPECT(kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, tokens, 64, 16),
           KVEDGE_OK);
    uint64_t host[2] = {11, 12};
    EXPECT(kvedge_publish_stored(p, KVEDGE_TIER_HOST, NULL, host, 2), KVEDGE_OK);
    kvedge_load load;
    memset(&load, 0, sizeof load);
    load.active_requests = 2;
    load.kv_total_blocks = 1000;
    EXPECT(kvedge_publish_load(p, &load), KVEDGE_OK);
    /* Bogus arguments on a live publisher change nothing. */
    EXPECT(kvedge_publish_stored(p, 7, NULL, host, 2), KVEDGE_ERR_INVALID_ARGUMENT);
    EXPECT(kvedge_publish_stored(p, KVEDGE_TIER_DEVICE, NULL, NULL, 3),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, tokens, 64, 0),
           KVEDGE_ERR_INVALID_ARGUMENT);
    EXPECT(kvedge_publish_cleared(p, -5), KVEDGE_ERR_INVALID_ARGUMENT);
    EXPECT(kvedge_publish_load(p, NULL), KVEDGE_ERR_NULL_ARGUMENT);
    uint32_t flags = 99;
    EXPECT(kvedge_publisher_poll(p, NULL, NULL, &flags), KVEDGE_OK);
    CHECK(flags == 0);
    CHECK(kvedge_publisher_dropped(p) == 0);

    kvedge_client *c = NULL;
    EXPECT(kvedge_client_connect(argv[2], &c), KVEDGE_OK);
    EXPECT(kvedge_client_set_timeout_ms(c, 5000), KVEDGE_OK);
    kvedge_select_request r;
    memset(&r, 0, sizeof r);
    r.model = "llama";
    r.tokens = tokens;
    r.n_tokens = 64;
    r.dry_run = 1;
    kvedge_select_result res;
    int tries = 0;
    do {
        EXPECT(kvedge_select(c, &r, &res), KVEDGE_OK);
        if (res.overlap_device == 4) break;
        sleep_ms(2);
    } while (++tries < 1000);
    CHECK(res.overlap_device == 4);
    CHECK(res.worker_id == 7 && res.dp_rank == 0 && res.is_provider == 0);
    CHECK(strcmp(res.endpoint, "http://seven") == 0 && res.endpoint_len == 12);

    /* The same prompt as hashes computed here. */
    uint64_t hashes[4];
    size_t n = 0;
    EXPECT(kvedge_hash_blocks(tokens, 64, 16, NULL, NULL, hashes, 4, &n), KVEDGE_OK);
    kvedge_select_request rh;
    memset(&rh, 0, sizeof rh);
    rh.model = "llama";
    rh.session = "conversation-1";
    rh.hashes = hashes;
    rh.n_hashes = n;
    EXPECT(kvedge_select(c, &rh, &res), KVEDGE_OK);
    CHECK(res.overlap_device == 4 && res.worker_id == 7);
    /* Reserved: release it, once. */
    EXPECT(kvedge_prefill_done(c, res.request_id), KVEDGE_OK);
    EXPECT(kvedge_finish(c, res.request_id), KVEDGE_OK);
    EXPECT(kvedge_finish(c, res.request_id), KVEDGE_ERR_UNKNOWN_REQUEST);
    /* A dispatch that failed: aborted, once. */
    EXPECT(kvedge_select(c, &rh, &res), KVEDGE_OK);
    EXPECT(kvedge_abort(c, res.request_id), KVEDGE_OK);
    EXPECT(kvedge_abort(c, res.request_id), KVEDGE_ERR_UNKNOWN_REQUEST);

    /* A select with session metadata and an explicit target: the target
     * serves it; a target that is not registered is no worker; a trigger
     * without a session is refused before anything is sent. */
    kvedge_select_routing g;
    memset(&g, 0, sizeof g);
    g.trigger = KVEDGE_TRIGGER_TOOL;
    g.parent_session = "conversation-0";
    g.has_target = 1;
    g.target_worker_id = 7;
    rh.dry_run = 1;
    EXPECT(kvedge_select_ex(c, &rh, &g, &res), KVEDGE_OK);
    CHECK(res.worker_id == 7 && res.dp_rank == 0 && res.overlap_device == 4);
    EXPECT(kvedge_select_ex(c, &rh, NULL, &res), KVEDGE_OK);
    g.target_worker_id = 8;
    EXPECT(kvedge_select_ex(c, &rh, &g, &res), KVEDGE_ERR_NO_WORKER);
    g.target_worker_id = 7;
    g.trigger = 9;
    EXPECT(kvedge_select_ex(c, &rh, &g, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    g.trigger = KVEDGE_TRIGGER_TOOL;
    kvedge_select_request anonymous = rh;
    anonymous.session = NULL;
    EXPECT(kvedge_select_ex(c, &anonymous, &g, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    rh.dry_run = 0;

    /* An engine with labels and a taint: a request reaches it only when it
     * tolerates the taint. A label key that is empty or holds `=` is
     * refused before anything is sent; a taint the daemon cannot read is
     * refused by the daemon. */
    kvedge_hello h8 = h;
    h8.worker_id = 8;
    h8.endpoint = "http://eight";
    const char *label_keys[2] = {"backend", "gpu"};
    const char *label_values[2] = {"fast", "h100"};
    const char *taints[1] = {"draining:NoSchedule"};
    kvedge_publisher *p8 = NULL;
    EXPECT(kvedge_publisher_open_labeled(argv[1], &h8, label_keys, label_values, 2, taints, 1,
                                         &p8),
           KVEDGE_OK);
    CHECK(p8 != NULL);
    const char *tolerations[1] = {"draining"};
    g.trigger = KVEDGE_TRIGGER_USER;
    g.parent_session = NULL;
    g.target_worker_id = 8;
    g.tolerations = tolerations;
    g.n_tolerations = 1;
    rh.dry_run = 1;
    tries = 0;
    while (kvedge_select_ex(c, &rh, &g, &res) != KVEDGE_OK && ++tries < 1000) sleep_ms(2);
    CHECK(res.worker_id == 8 && strcmp(res.endpoint, "http://eight") == 0);
    g.n_tolerations = 0;
    EXPECT(kvedge_select_ex(c, &rh, &g, &res), KVEDGE_ERR_NO_WORKER);
    g.n_tolerations = 33;
    EXPECT(kvedge_select_ex(c, &rh, &g, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    g.n_tolerations = 0;
    g.has_target = 0;
    rh.dry_run = 0;
    const char *bad_keys[1] = {"a=b"};
    kvedge_publisher *p9 = NULL;
    h8.worker_id = 9;
    EXPECT(kvedge_publisher_open_labeled(argv[1], &h8, bad_keys, label_values, 1, NULL, 0, &p9),
           KVEDGE_ERR_INVALID_ARGUMENT);
    CHECK(p9 == NULL);
    EXPECT(kvedge_publisher_open_labeled(argv[1], &h8, NULL, NULL, 1, NULL, 0, &p9),
           KVEDGE_ERR_NULL_ARGUMENT);
    const char *bad_taints[1] = {"spot"};
    EXPECT(kvedge_publisher_open_labeled(argv[1], &h8, NULL, NULL, 0, bad_taints, 1, &p9),
           KVEDGE_ERR_REJECTED);
    CHECK(p9 == NULL);
    kvedge_publisher_close(p8);

    /* Bogus selects: errors, and the connection keeps working. */
    kvedge_select_request bad = r;
    bad.model = "no-such-model";
    EXPECT(kvedge_select(c, &bad, &res), KVEDGE_ERR_NO_WORKER);
    bad = r;
    bad.hashes = hashes;
    bad.n_hashes = 4;
    EXPECT(kvedge_select(c, &bad, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    bad = r;
    bad.n_tokens = 0;
    EXPECT(kvedge_select(c, &bad, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    bad = r;
    bad.role = 42;
    EXPECT(kvedge_select(c, &bad, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    bad = r;
    bad.model = NULL;
    EXPECT(kvedge_select(c, &bad, &res), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_select(c, NULL, &res), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_select(c, &r, NULL), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_select(c, &r, &res), KVEDGE_OK);
    CHECK(res.overlap_device == 4);

    /* The request context (tenant, tags, headers, priority) travels too. */
    const char *tags[2] = {"pii-none", "len-short"};
    const char *names[1] = {"X-Team"};
    const char *values[1] = {"research"};
    kvedge_select_request ctx = r;
    ctx.tenant = "acme";
    ctx.priority = 3;
    ctx.tags = tags;
    ctx.n_tags = 2;
    ctx.header_names = names;
    ctx.header_values = values;
    ctx.n_headers = 1;
    EXPECT(kvedge_select(c, &ctx, &res), KVEDGE_OK);
    CHECK(res.overlap_device == 4 && res.worker_id == 7);
    ctx.n_tags = KVEDGE_MAX_TAGS + 1;
    EXPECT(kvedge_select(c, &ctx, &res), KVEDGE_ERR_INVALID_ARGUMENT);
    ctx.n_tags = 2;
    ctx.header_values = NULL;
    EXPECT(kvedge_select(c, &ctx, &res), KVEDGE_ERR_NULL_ARGUMENT);

    /* A second client on a query channel (shared-memory rings) gets the
     * same answers; a reservation it makes is released through it. */
    kvedge_client *ringc = NULL;
    EXPECT(kvedge_client_connect(argv[2], &ringc), KVEDGE_OK);
    EXPECT(kvedge_client_set_timeout_ms(ringc, 5000), KVEDGE_OK);
    EXPECT(kvedge_client_attach_rings(ringc), KVEDGE_OK);
    EXPECT(kvedge_client_attach_rings(ringc), KVEDGE_OK);
    EXPECT(kvedge_select(ringc, &rh, &res), KVEDGE_OK);
    CHECK(res.overlap_device == 4 && res.worker_id == 7);
    CHECK(strcmp(res.endpoint, "http://seven") == 0);
    EXPECT(kvedge_finish(ringc, res.request_id), KVEDGE_OK);
    EXPECT(kvedge_finish(ringc, res.request_id), KVEDGE_ERR_UNKNOWN_REQUEST);
    kvedge_select_request nope = rh;
    nope.model = "no-such-model";
    EXPECT(kvedge_select(ringc, &nope, &res), KVEDGE_ERR_NO_WORKER);
    kvedge_client_close(ringc);

    /* Removed: the overlap drops. */
    EXPECT(kvedge_publish_removed(p, KVEDGE_TIER_DEVICE, &hashes[3], 1), KVEDGE_OK);
    tries = 0;
    do {
        EXPECT(kvedge_select(c, &r, &res), KVEDGE_OK);
        if (res.overlap_device == 3) break;
        sleep_ms(2);
    } while (++tries < 1000);
    CHECK(res.overlap_device == 3);

    /* No resync pending: the callback is not called. */
    resync_state st = {tokens, 0};
    EXPECT(kvedge_publisher_poll(p, republish, &st, &flags), KVEDGE_OK);
    CHECK(st.calls == 0 && flags == 0);

    /* Overflow the (4 KiB) ring on purpose while the harness holds the
     * daemon's loop: records are dropped and counted, never blocking. When
     * the daemon runs again it sees the gap and asks for a resync. Polling
     * without a callback reports it pending; with the callback the snapshot
     * is served, and the daemon's view is the engine's state again (all 4
     * blocks). */
    CHECK(harness("pause"));
    uint64_t burst[32];
    for (uint64_t i = 0; i < 32; i++) burst[i] = 5000 + i;
    for (int i = 0; i < 1000; i++) {
        EXPECT(kvedge_publish_stored(p, KVEDGE_TIER_DEVICE, NULL, burst, 32), KVEDGE_OK);
    }
    CHECK(kvedge_publisher_dropped(p) > 0);
    CHECK(harness("resume"));
    tries = 0;
    do {
        EXPECT(kvedge_publisher_poll(p, NULL, NULL, &flags), KVEDGE_OK);
        if (flags & KVEDGE_POLL_RESYNC_PENDING) break;
        sleep_ms(2);
    } while (++tries < 2500);
    CHECK(flags == KVEDGE_POLL_RESYNC_PENDING && st.calls == 0);
    EXPECT(kvedge_publisher_poll(p, republish, &st, &flags), KVEDGE_OK);
    CHECK(flags == KVEDGE_POLL_RESYNC_SERVED && st.calls == 1);
    tries = 0;
    do {
        EXPECT(kvedge_publisher_poll(p, republish, &st, &flags), KVEDGE_OK);
        EXPECT(kvedge_select(c, &r, &res), KVEDGE_OK);
        if (res.overlap_device == 4) break;
        sleep_ms(2);
    } while (++tries < 1000);
    if (res.overlap_device != 4 || st.calls != 1)
        fprintf(stderr, "overlap %u after %d resyncs\n", res.overlap_device, st.calls);
    /* One resync: the gap the snapshot's first record reports is the one
     * the resync was asked for. */
    CHECK(res.overlap_device == 4 && st.calls == 1);

    /* The daemon goes away. */
    CHECK(harness("stop"));

    kvedge_status rc = kvedge_select(c, &r, &res);
    CHECK(rc == KVEDGE_ERR_CLOSED || rc == KVEDGE_ERR_IO);
    /* The client refuses further use; still no crash. */
    rc = kvedge_finish(c, 1);
    CHECK(rc != KVEDGE_OK);
    /* Publishing into the ring never fails or blocks; polling says closed. */
    EXPECT(kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, tokens, 64, 16),
           KVEDGE_OK);
    tries = 0;
    do {
        rc = kvedge_publisher_poll(p, republish, &st, &flags);
        if (rc != KVEDGE_OK) break;
        sleep_ms(2);
    } while (++tries < 1000);
    CHECK(rc == KVEDGE_ERR_CLOSED);
    kvedge_client_close(c);
    kvedge_publisher_close(p);
    /* A new connection is refused. */
    EXPECT(kvedge_client_connect(argv[2], &c), KVEDGE_ERR_CONNECT);
    printf("ok\n");
    return 0;
}
