/* Everything that needs no daemon: version, error strings and messages,
 * hashing against values the Rust side computed, and every function with
 * NULL, bogus and out-of-range arguments. Usage: api H0 H1 L0 L1, the
 * sequence hashes of tokens 0..39 (block 16) without and with LoRA "a". */
#include <stdlib.h>
#include <string.h>

#include "check.h"

int main(int argc, char **argv) {
    CHECK(argc == 5);
    CHECK(kvedge_version() == ((KVEDGE_VERSION_MAJOR << 16) |
                               (KVEDGE_VERSION_MINOR << 8) |
                               KVEDGE_VERSION_PATCH));
    CHECK(strcmp(kvedge_strerror(KVEDGE_OK), "success") == 0);
    CHECK(kvedge_strerror(12345) != NULL);
    CHECK(kvedge_strerror(-7) != NULL);

    /* Hashing. */
    uint32_t tokens[40];
    for (uint32_t i = 0; i < 40; i++) tokens[i] = i;
    uint64_t out[4] = {0};
    size_t n = 99;
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, NULL, NULL, out, 4, &n), KVEDGE_OK);
    CHECK(n == 2);
    CHECK(out[0] == strtoull(argv[1], NULL, 10));
    CHECK(out[1] == strtoull(argv[2], NULL, 10));
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, "", "", out, 4, &n), KVEDGE_OK);
    CHECK(out[0] == strtoull(argv[1], NULL, 10));
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, "a", NULL, out, 4, &n), KVEDGE_OK);
    CHECK(out[0] == strtoull(argv[3], NULL, 10));
    CHECK(out[1] == strtoull(argv[4], NULL, 10));
    /* Too small: nothing written but the count. */
    out[0] = 42;
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, NULL, NULL, out, 1, &n),
           KVEDGE_ERR_BUFFER_TOO_SMALL);
    CHECK(n == 2 && out[0] == 42);
    /* Fewer tokens than a block: zero hashes, NULL out allowed. */
    EXPECT(kvedge_hash_blocks(tokens, 15, 16, NULL, NULL, NULL, 0, &n), KVEDGE_OK);
    CHECK(n == 0);
    EXPECT(kvedge_hash_blocks(NULL, 0, 16, NULL, NULL, NULL, 0, &n), KVEDGE_OK);
    EXPECT(kvedge_hash_blocks(NULL, 40, 16, NULL, NULL, out, 4, &n),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, NULL, NULL, out, 4, NULL),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_hash_blocks(tokens, 40, 0, NULL, NULL, out, 4, &n),
           KVEDGE_ERR_INVALID_ARGUMENT);
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, "\xff\xfe", NULL, out, 4, &n),
           KVEDGE_ERR_INVALID_ARGUMENT);
    EXPECT(kvedge_hash_blocks(tokens, 40, 16, NULL, NULL, NULL, 4, &n),
           KVEDGE_ERR_NULL_ARGUMENT);

    /* The last error message, whole and truncated. */
    char msg[256];
    size_t len = kvedge_last_error_message(msg, sizeof msg);
    CHECK(len > 0 && strlen(msg) == len);
    CHECK(strstr(msg, "out") != NULL);
    char tiny[4];
    CHECK(kvedge_last_error_message(tiny, sizeof tiny) == len);
    CHECK(strlen(tiny) == 3);
    CHECK(kvedge_last_error_message(NULL, 0) == len);

    /* Publisher arguments. */
    kvedge_publisher *p = (kvedge_publisher *)&n; /* must be reset to NULL */
    kvedge_hello h;
    memset(&h, 0, sizeof h);
    h.model = "m";
    h.block_size = 16;
    EXPECT(kvedge_publisher_open(NULL, &h, &p), KVEDGE_ERR_NULL_ARGUMENT);
    CHECK(p == NULL);
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", NULL, &p),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, NULL),
           KVEDGE_ERR_NULL_ARGUMENT);
    h.model = NULL;
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, &p),
           KVEDGE_ERR_NULL_ARGUMENT);
    h.model = "";
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, &p),
           KVEDGE_ERR_INVALID_ARGUMENT);
    h.model = "m";
    h.role = 9;
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, &p),
           KVEDGE_ERR_INVALID_ARGUMENT);
    h.role = KVEDGE_ROLE_AGGREGATED;
    h.block_size = 0;
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, &p),
           KVEDGE_ERR_INVALID_ARGUMENT);
    h.block_size = 16;
    EXPECT(kvedge_publisher_open("/nonexistent/control.sock", &h, &p),
           KVEDGE_ERR_CONNECT);
    CHECK(p == NULL);
    kvedge_last_error_message(msg, sizeof msg);
    CHECK(strstr(msg, "/nonexistent/control.sock") != NULL);

    uint64_t hashes[2] = {1, 2};
    kvedge_load load;
    memset(&load, 0, sizeof load);
    uint32_t flags = 77;
    EXPECT(kvedge_publish_stored(NULL, KVEDGE_TIER_DEVICE, NULL, hashes, 2),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publish_stored_tokens(NULL, KVEDGE_TIER_DEVICE, NULL, tokens, 40, 16),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publish_removed(NULL, KVEDGE_TIER_DEVICE, hashes, 2),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publish_cleared(NULL, KVEDGE_TIER_ALL), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publish_load(NULL, &load), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_publisher_poll(NULL, NULL, NULL, &flags), KVEDGE_ERR_NULL_ARGUMENT);
    CHECK(kvedge_publisher_dropped(NULL) == 0);
    kvedge_publisher_close(NULL);

    /* Client arguments. */
    kvedge_client *c = (kvedge_client *)&n;
    EXPECT(kvedge_client_connect(NULL, &c), KVEDGE_ERR_NULL_ARGUMENT);
    CHECK(c == NULL);
    EXPECT(kvedge_client_connect("/nonexistent/query.sock", NULL),
           KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_client_connect("/nonexistent/query.sock", &c), KVEDGE_ERR_CONNECT);
    CHECK(c == NULL);
    kvedge_select_request r;
    memset(&r, 0, sizeof r);
    kvedge_select_result res;
    EXPECT(kvedge_select(NULL, &r, &res), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_client_set_timeout_ms(NULL, 10), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_prefill_done(NULL, 1), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_finish(NULL, 1), KVEDGE_ERR_NULL_ARGUMENT);
    EXPECT(kvedge_client_attach_rings(NULL), KVEDGE_ERR_NULL_ARGUMENT);
    char name[8] = "garbage";
    CHECK(kvedge_selected_provider(NULL, name, sizeof name) == 0 && name[0] == 0);
    CHECK(kvedge_selected_provider(NULL, NULL, 0) == 0);
    kvedge_client_close(NULL);
    printf("ok\n");
    return 0;
}
