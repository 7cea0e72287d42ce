/* An engine's side of kvedge: register with the daemon, publish the KV
 * blocks of a prompt (token ids 1000, 1001, ...), report the load, then
 * keep the registration alive (heartbeats, resync requests) until stdin
 * closes.
 *
 *   cc publisher.c $(pkg-config --cflags --libs kvedge) -o publisher
 *   ./publisher /run/kvedge/control.sock 7 < some-pipe
 */
#define _POSIX_C_SOURCE 200809L
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kvedge.h>

#define TOKENS 256
#define BLOCK 16

static uint32_t prompt[TOKENS];

static void fail(const char *what, kvedge_status rc) {
    char msg[512];
    kvedge_last_error_message(msg, sizeof msg);
    fprintf(stderr, "%s: %s (%s)\n", what, kvedge_strerror(rc), msg);
    exit(1);
}

/* Called when the daemon lost track of our blocks: publish all of them. */
static kvedge_status republish(kvedge_publisher *p, void *user) {
    (void)user;
    return kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, prompt, TOKENS, BLOCK);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CONTROL_SOCKET WORKER_ID\n", argv[0]);
        return 2;
    }
    for (uint32_t i = 0; i < TOKENS; i++) prompt[i] = 1000 + i;

    kvedge_hello hello;
    memset(&hello, 0, sizeof hello);
    hello.worker_id = strtoull(argv[2], NULL, 10);
    hello.model = "llama";
    hello.endpoint = "http://127.0.0.1:8000";
    hello.block_size = BLOCK;
    hello.kv_blocks_device = 32768;

    kvedge_publisher *p = NULL;
    kvedge_status rc = kvedge_publisher_open(argv[1], &hello, &p);
    if (rc != KVEDGE_OK) fail("kvedge_publisher_open", rc);
    rc = kvedge_publish_stored_tokens(p, KVEDGE_TIER_DEVICE, NULL, prompt, TOKENS, BLOCK);
    if (rc != KVEDGE_OK) fail("kvedge_publish_stored_tokens", rc);
    kvedge_load load;
    memset(&load, 0, sizeof load);
    load.kv_used_blocks = TOKENS / BLOCK;
    load.kv_total_blocks = hello.kv_blocks_device;
    rc = kvedge_publish_load(p, &load);
    if (rc != KVEDGE_OK) fail("kvedge_publish_load", rc);
    printf("published %d blocks as worker %s\n", TOKENS / BLOCK, argv[2]);
    fflush(stdout);

    /* Until stdin closes: poll every 100 ms (heartbeats, resyncs). */
    for (;;) {
        struct pollfd in = {0, POLLIN, 0};
        if (poll(&in, 1, 100) > 0) {
            char buf[64];
            if (read(0, buf, sizeof buf) <= 0) break;
        }
        uint32_t flags = 0;
        rc = kvedge_publisher_poll(p, republish, NULL, &flags);
        if (rc == KVEDGE_ERR_CLOSED) {
            fprintf(stderr, "the daemon went away\n");
            break;
        }
        if (rc != KVEDGE_OK) fail("kvedge_publisher_poll", rc);
        if (flags & KVEDGE_POLL_RESYNC_SERVED) printf("served a resync\n");
    }
    kvedge_publisher_close(p);
    return 0;
}
