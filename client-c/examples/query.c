/* A frontend's side of kvedge: ask the daemon which worker should serve a
 * prompt (token ids 1000, 1001, ...), print the answer, release it.
 *
 *   cc query.c $(pkg-config --cflags --libs kvedge) -o query
 *   ./query /run/kvedge/query.sock
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvedge.h>

#define TOKENS 256

static void fail(const char *what, kvedge_status rc) {
    char msg[512];
    kvedge_last_error_message(msg, sizeof msg);
    fprintf(stderr, "%s: %s (%s)\n", what, kvedge_strerror(rc), msg);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s QUERY_SOCKET\n", argv[0]);
        return 2;
    }
    if ((kvedge_version() >> 16) != KVEDGE_VERSION_MAJOR) {
        fprintf(stderr, "libkvedge major version differs from kvedge.h\n");
        return 1;
    }
    uint32_t prompt[TOKENS];
    for (uint32_t i = 0; i < TOKENS; i++) prompt[i] = 1000 + i;

    kvedge_client *c = NULL;
    kvedge_status rc = kvedge_client_connect(argv[1], &c);
    if (rc != KVEDGE_OK) fail("kvedge_client_connect", rc);
    rc = kvedge_client_set_timeout_ms(c, 2000);
    if (rc != KVEDGE_OK) fail("kvedge_client_set_timeout_ms", rc);
    /* Shared-memory rings for the requests when the daemon has them to
     * give; otherwise the client simply stays on the socket. */
    rc = kvedge_client_attach_rings(c);
    if (rc != KVEDGE_OK && rc != KVEDGE_ERR_UNAVAILABLE) fail("kvedge_client_attach_rings", rc);

    kvedge_select_request req;
    memset(&req, 0, sizeof req);
    req.model = "llama";
    req.session = "example-conversation";
    req.tokens = prompt;
    req.n_tokens = TOKENS;
    kvedge_select_result res;
    rc = kvedge_select(c, &req, &res);
    if (rc != KVEDGE_OK) fail("kvedge_select", rc);
    printf("worker %llu dp %u endpoint %s overlap device %u host %u disk %u request %llu\n",
           (unsigned long long)res.worker_id, res.dp_rank, res.endpoint,
           res.overlap_device, res.overlap_host, res.overlap_disk,
           (unsigned long long)res.request_id);

    /* ... send the request to res.endpoint; when its prefill is done and
     * when it finishes, tell the daemon: */
    rc = kvedge_prefill_done(c, res.request_id);
    if (rc != KVEDGE_OK) fail("kvedge_prefill_done", rc);
    rc = kvedge_finish(c, res.request_id);
    if (rc != KVEDGE_OK) fail("kvedge_finish", rc);
    kvedge_client_close(c);
    return 0;
}
