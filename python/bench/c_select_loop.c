/* The C half of python/bench/select_round_trip.py: N dry-run selects of
 * the given 128 hashes through libkvedge, over the socket or (rings=1) a
 * query channel, after a warm-up; prints the median and mean nanoseconds
 * of one round trip. */
#include <kvedge.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s QUERY_SOCKET MODEL N RINGS\n", argv[0]);
    return 2;
  }
  size_t n = strtoul(argv[3], NULL, 10);
  struct kvedge_client *c = NULL;
  if (kvedge_client_connect(argv[1], &c) != KVEDGE_OK) {
    fprintf(stderr, "connect failed\n");
    return 1;
  }
  if (atoi(argv[4]) && kvedge_client_attach_rings(c) != KVEDGE_OK) {
    fprintf(stderr, "attach_rings failed\n");
    return 1;
  }
  uint64_t hashes[128];
  for (int i = 0; i < 128; i++) hashes[i] = (uint64_t)i + 1;
  kvedge_select_request q = {0};
  q.model = argv[2];
  q.role = KVEDGE_ROLE_AGGREGATED;
  q.dry_run = 1;
  q.hashes = hashes;
  q.n_hashes = 128;
  kvedge_select_result r;
  int64_t *samples = malloc(n * sizeof *samples);
  for (size_t i = 0; i < n / 10 + 100; i++) {
    if (kvedge_select(c, &q, &r) != KVEDGE_OK) {
      fprintf(stderr, "select failed\n");
      return 1;
    }
  }
  int64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    int64_t t = now_ns();
    kvedge_select(c, &q, &r);
    samples[i] = now_ns() - t;
    total += samples[i];
  }
  qsort(samples, n, sizeof *samples, cmp);
  printf("%lld %lld\n", (long long)samples[n / 2], (long long)(total / (int64_t)n));
  kvedge_client_close(c);
  free(samples);
  return 0;
}
