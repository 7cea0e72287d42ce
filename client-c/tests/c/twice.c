/* The header compiles as C99 and C++17, included twice, with -Wall -Werror. */
#include "kvedge.h"
#include "kvedge.h"

int main(void) {
    kvedge_select_result r;
    (void)r;
    return (int)(kvedge_version() >> 24);
}
