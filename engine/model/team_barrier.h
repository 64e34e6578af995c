/* A barrier for the threads of one OpenMP parallel region that waits by spinning (then
 * yielding), never by sleeping, for the fused step's many short work-shares.
 *
 * Why: libgomp's own barriers spin only ~1,000 iterations before sleeping on a futex once a
 * process holds more OpenMP threads than it has CPUs, as a worker process does (each thread
 * that ever ran a parallel torch operation keeps a team of its own). Woken 20-100 us later,
 * a thread arrives at a work-share of a one-row step (30-100 us) after the others did most of
 * it. Here a waiting thread spins (pause) up to TEAM_SPINS times, then yields the CPU
 * (sched_yield) until the last thread arrives. Measured (2026-12-04, 2-vCPU Zen 4 VM, `baton
 * profile serving`, aggregated, 2 threads, one stream of 256 tokens, the two builds
 * alternating): ITL p50 10.8-12.4 ms against 13.7-15.9 ms with libgomp's barriers, the
 * engine's two threads busy 1.5 cores against 1.13.
 *
 * Use: each thread of the region calls team_enter(&barrier) first and team_leave() last; a
 * work-share is `omp for ... nowait` followed by team_barrier(). Outside such a region (the
 * kernels' own entry points), team_barrier() is an `omp barrier`. Included by gguf_gemm.c.
 */
#ifndef BATON_TEAM_BARRIER_H
#define BATON_TEAM_BARRIER_H

#include <immintrin.h>
#include <omp.h>
#include <sched.h>
#include <stdatomic.h>

#ifndef TEAM_SPINS
#define TEAM_SPINS (1 << 14) /* pauses before yielding: ~0.1-0.5 ms */
#endif

typedef struct {
    atomic_int arrived; /* threads at the barrier of the current phase */
    atomic_int phase;   /* barriers passed */
} team_barrier_t;

static __thread team_barrier_t *team_current; /* this thread's region's barrier, or NULL */

static inline void team_enter(team_barrier_t *barrier) { team_current = barrier; }
static inline void team_leave(void) { team_current = NULL; }

/* Every thread of the team waits here until all have arrived; what each wrote before is then
 * visible to all (acquire / release on the counters). */
static inline void team_barrier(void) {
    team_barrier_t *b = team_current;
    if (b == NULL) {
#pragma omp barrier
        return;
    }
    const int threads = omp_get_num_threads();
    if (threads == 1) return;
    const int phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
        return;
    }
    for (unsigned spins = 0; atomic_load_explicit(&b->phase, memory_order_acquire) == phase;
         spins++) {
        if (spins < TEAM_SPINS) _mm_pause();
        else sched_yield();
    }
}

#endif
