/* A CUPTI injection library: records a CUDA program's timeline without changing the program.
 *
 * Loaded by the CUDA driver when CUDA_INJECTION64_PATH names it (the driver calls
 * InitializeInjection at the program's first CUDA call). It asks CUPTI for activity records of
 * kernels (those launched from CUDA graphs too), copies and sets, runtime and driver API calls,
 * and NVTX ranges where the program marks any (CUPTI sees them when NVTX_INJECTION64_PATH names
 * libcupti; MLX's CUDA backend marks few of its operations). Every record becomes one tab-separated line of $LLMQ_TIMELINE.<pid>.tsv
 * (default ./timeline.<pid>.tsv); deploy/gpu/timeline/summarize.py turns the lines into a
 * per-step breakdown and a Chrome trace.
 *
 * Lines (times in ns on CUPTI's clock; tid is the OS thread):
 *   K start end stream correlation graph name          a kernel
 *   C start end stream correlation bytes copy_kind     a memcpy
 *   S start end stream correlation bytes -             a memset
 *   R start end tid correlation - name                 a runtime API call
 *   D start end tid correlation - name                 a driver API call
 *   N time flags id tid - name                         an NVTX range start (flags 2), end (4), mark (1)
 *
 * This is an instrument for the GPU machine, not part of llmq: nothing in the product loads it.
 */
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BUFFER_BYTES (16u << 20)
#define ALIGN 8

static FILE *out;
static pthread_mutex_t out_lock = PTHREAD_MUTEX_INITIALIZER;

static void check(CUptiResult r, const char *what) {
    if (r != CUPTI_SUCCESS) {
        const char *msg = "?";
        cuptiGetResultString(r, &msg);
        fprintf(stderr, "llmq timeline: %s failed: %s\n", what, msg);
    }
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(ALIGN, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

static const char *api_name(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
    const char *name = NULL;
    if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || !name) return "?";
    return name;
}

static void write_record(CUpti_Activity *rec) {
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)rec;
        fprintf(out, "K\t%llu\t%llu\t%u\t%u\t%u\t%s\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->streamId, k->correlationId, k->graphId,
                k->name ? k->name : "?");
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        CUpti_ActivityMemcpy6 *c = (CUpti_ActivityMemcpy6 *)rec;
        fprintf(out, "C\t%llu\t%llu\t%u\t%u\t%llu\t%u\n", (unsigned long long)c->start,
                (unsigned long long)c->end, c->streamId, c->correlationId,
                (unsigned long long)c->bytes, (unsigned)c->copyKind);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        CUpti_ActivityMemset4 *s = (CUpti_ActivityMemset4 *)rec;
        fprintf(out, "S\t%llu\t%llu\t%u\t%u\t%llu\t-\n", (unsigned long long)s->start,
                (unsigned long long)s->end, s->streamId, s->correlationId,
                (unsigned long long)s->bytes);
        break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
        CUpti_ActivityAPI *a = (CUpti_ActivityAPI *)rec;
        int runtime = rec->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        fprintf(out, "%c\t%llu\t%llu\t%u\t%u\t-\t%s\n", runtime ? 'R' : 'D',
                (unsigned long long)a->start, (unsigned long long)a->end, a->threadId,
                a->correlationId,
                api_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                         a->cbid));
        break;
    }
    case CUPTI_ACTIVITY_KIND_MARKER: {
        CUpti_ActivityMarker2 *m = (CUpti_ActivityMarker2 *)rec;
        uint32_t tid = m->objectKind == CUPTI_ACTIVITY_OBJECT_THREAD ? m->objectId.pt.threadId : 0;
        fprintf(out, "N\t%llu\t%u\t%u\t%u\t-\t%s\n", (unsigned long long)m->timestamp,
                (unsigned)m->flags, m->id, tid, m->name ? m->name : "");
        break;
    }
    default:
        break;
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    pthread_mutex_lock(&out_lock);
    while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) write_record(rec);
    size_t dropped = 0;
    cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
    if (dropped) fprintf(stderr, "llmq timeline: %zu records dropped\n", dropped);
    pthread_mutex_unlock(&out_lock);
    free(buffer);
}

static void at_exit(void) {
    cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&out_lock);
    if (out) {
        fclose(out);
        out = NULL;
    }
    pthread_mutex_unlock(&out_lock);
}

int InitializeInjection(void) {
    static int done;
    if (done++) return 1;
    const char *base = getenv("LLMQ_TIMELINE");
    char path[4096];
    snprintf(path, sizeof path, "%s.%d.tsv", base && *base ? base : "timeline", (int)getpid());
    out = fopen(path, "w");
    if (!out) {
        perror("llmq timeline: cannot open the output");
        return 0;
    }
    setvbuf(out, NULL, _IOFBF, 1 << 20);
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
    static const CUpti_ActivityKind kinds[] = {
        CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
        CUPTI_ACTIVITY_KIND_MEMSET,            CUPTI_ACTIVITY_KIND_RUNTIME,
        CUPTI_ACTIVITY_KIND_DRIVER,            CUPTI_ACTIVITY_KIND_MARKER,
    };
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++)
        check(cuptiActivityEnable(kinds[i]), "enable an activity kind");
    atexit(at_exit);
    fprintf(stderr, "llmq timeline: recording to %s\n", path);
    return 1;
}
