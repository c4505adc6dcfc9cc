/* mlx-rs seeds its default random key with macOS's mach_approximate_time().
 * Linux has no such call; this gives the same meaning (a monotonic tick count, here in
 * nanoseconds) so that mlx-rs links and runs unchanged. Compiled into mlx-sys's static
 * libraries by llmq's build script, which the linker always sees after mlx-rs. */
#include <stdint.h>
#include <time.h>

uint64_t mach_approximate_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
