/* Assertion helpers of the C tests. */
#ifndef KVEDGE_TEST_CHECK_H
#define KVEDGE_TEST_CHECK_H

#include <stdio.h>
#include "kvedge.h"

#define CHECK(cond)                                                            \
    do {                                                                       \
        if (!(cond)) {                                                         \
            fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__,   \
                    #cond);                                                    \
            return 1;                                                          \
        }                                                                      \
    } while (0)

#define EXPECT(call, code)                                                     \
    do {                                                                       \
        kvedge_status rc_ = (call);                                            \
        if (rc_ != (code)) {                                                   \
            char msg_[512];                                                    \
            kvedge_last_error_message(msg_, sizeof msg_);                      \
            fprintf(stderr, "%s:%d: %s returned %d (%s: %s), expected %d\n",   \
                    __FILE__, __LINE__, #call, rc_, kvedge_strerror(rc_),      \
                    msg_, (code));                                             \
            return 1;                                                          \
        }                                                                      \
    } while (0)

#endif
