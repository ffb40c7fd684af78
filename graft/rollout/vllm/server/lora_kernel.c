/* graft's LoRA add for vLLM-CPU: every token through its own adapter slot in one call, for any mix of
 * slots (graft.rollout.vllm.server.lora_kernel builds and calls it), in bf16 and in fp32.
 *
 * y[rows[k], :O] += B[s] @ (scale * A[s] @ x[rows[k]])  for k < n_rows, s = slots[k]
 *
 * A: [S, R, I], R = slices x rank (a layer's slices side by side).
 * B, bf16: [S, R/2, O, 2], the slices' B block-diagonal in AVX-512's pair layout ("VNNI"): element
 *    [s, p, o, k] = B[s][o, 2p + k], so one dot-product instruction takes two ranks of 16 outputs.
 *    The rank-sized product is rounded to bf16 before the expand, as vLLM's own ops round it.
 * B, fp32: [S, R, O], the same block-diagonal matrix transposed.
 * Slice j owns outputs out_offsets[j]..out_offsets[j + 1] and ranks j*rank..(j+1)*rank - 1.
 * Rows are taken in the order given (graft passes them sorted by slot: one slot's weights stay in cache).
 *
 * Built for the instructions it uses, not for the build host (-march=native enabled everything the host
 * advertised): each function carries its own target (fp32: AVX-512F and FMA; bf16: AVX-512F/BW/VL and
 * AVX-512 BF16), and graft_lora_host_features says what this CPU has and its OS saves (cpuid and XCR0),
 * which graft_lora_self_test checks by running each function once, in a child process graft starts.
 *
 * A call cannot take the server down: its rows and slots are checked before any is touched (-1: refused,
 * nothing written), and a fault inside the kernel (SIGILL, SIGSEGV, SIGBUS, SIGFPE) returns the row it
 * stopped at, that row restored as it was: rows before it are added, it and those after are untouched, and
 * graft_lora_fault describes the fault. A fault anywhere else is described on stderr, then handed on.
 */
#define _GNU_SOURCE
#include <cpuid.h>
#include <dlfcn.h>
#include <immintrin.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

#define FP32_TARGET __attribute__((target("avx512f,fma")))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MAX_STACKED_RANK 4096 /* the rank-sized products live on the stack: 512 x 8 slices */
enum { HAS_FP32 = 1, HAS_BF16 = 2 };

/* Under AddressSanitizer the masked loads and stores (builtins it does not instrument) are checked by
 * hand: a mask here always covers the lowest `count` elements. */
#if defined(__SANITIZE_ADDRESS__)
void __asan_loadN(const void *address, size_t size);
void __asan_storeN(const void *address, size_t size);
#define CHECK_LOAD(p, count) __asan_loadN((p), (size_t)(count) * sizeof(*(p)))
#define CHECK_STORE(p, count) __asan_storeN((p), (size_t)(count) * sizeof(*(p)))
#else
#define CHECK_LOAD(p, count) ((void)0)
#define CHECK_STORE(p, count) ((void)0)
#endif

struct call { /* one call's arguments, as graft_lora_add_* takes them */
    const void *x, *a, *b;
    void *y;
    const int64_t *rows, *slots, *out_offsets;
    int64_t x_stride, y_stride, n_rows, in_features, rank, n_slices;
    float scale;
};

/* ---- fp32 ---------------------------------------------------------------------------------------- */

/* Each of a slice's outputs: out[o] (+)= sum over its ranks of shrunk[r] * b_t[r, o], 16 at a time. */
FP32_TARGET static void expand_add_f32(float *y_row, const float *b_t, const float *shrunk, int64_t first_rank,
                                       int64_t last_rank, int64_t out_features, int64_t start, int64_t stop) {
    for (int64_t o = start; o < stop; o += 16) {
        const int64_t left = stop - o, count = left < 16 ? left : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        CHECK_LOAD(y_row + o, count);
        __m512 sum = _mm512_maskz_loadu_ps(mask, y_row + o);
        for (int64_t r = first_rank; r < last_rank; r++) {
            CHECK_LOAD(b_t + r * out_features + o, count);
            sum = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[r]), _mm512_maskz_loadu_ps(mask, b_t + r * out_features + o),
                                  sum);
        }
        CHECK_STORE(y_row + o, count);
        _mm512_mask_storeu_ps(y_row + o, mask, sum);
    }
}

FP32_TARGET static void row_f32(const struct call *c, int64_t index) {
    const int64_t stacked_rank = c->rank * c->n_slices, out_features = c->out_offsets[c->n_slices];
    const int64_t tail = c->in_features % 16, whole = c->in_features - tail, row = c->rows[index];
    const __mmask16 tail_mask = (__mmask16)((1u << tail) - 1);
    const float *x_row = (const float *)c->x + row * c->x_stride;
    const float *a_slot = (const float *)c->a + c->slots[index] * stacked_rank * c->in_features;
    float shrunk[stacked_rank];
    for (int64_t r = 0; r < stacked_rank; r++) {
        const float *a_row = a_slot + r * c->in_features;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < whole; i += 16)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(x_row + i), _mm512_loadu_ps(a_row + i), sum);
        if (tail) {
            CHECK_LOAD(x_row + whole, tail);
            CHECK_LOAD(a_row + whole, tail);
            sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask, x_row + whole),
                                  _mm512_maskz_loadu_ps(tail_mask, a_row + whole), sum);
        }
        shrunk[r] = _mm512_reduce_add_ps(sum) * c->scale;
    }
    const float *b_slot = (const float *)c->b + c->slots[index] * stacked_rank * out_features;
    for (int64_t j = 0; j < c->n_slices; j++)
        expand_add_f32((float *)c->y + row * c->y_stride, b_slot, shrunk, j * c->rank, (j + 1) * c->rank,
                       out_features, c->out_offsets[j], c->out_offsets[j + 1]);
}

/* ---- bf16 ---------------------------------------------------------------------------------------- */

/* scale * A[s] @ x as bf16 pairs: pairs_out[p] holds ranks 2p (low half) and 2p + 1. */
BF16_TARGET static void shrink(const uint16_t *x_row, const uint16_t *a_slot, int64_t in_features,
                               int64_t stacked_rank, float scale, uint32_t *pairs_out) {
    float shrunk[stacked_rank];
    const int64_t tail = in_features % 32, whole = in_features - tail;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
    for (int64_t r = 0; r < stacked_rank; r++) {
        const uint16_t *a_row = a_slot + r * in_features;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < whole; i += 32)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(x_row + i),
                                   (__m512bh)_mm512_loadu_si512(a_row + i));
        if (tail) {
            CHECK_LOAD(x_row + whole, tail);
            CHECK_LOAD(a_row + whole, tail);
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, x_row + whole),
                                   (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, a_row + whole));
        }
        shrunk[r] = _mm512_reduce_add_ps(sum) * scale;
    }
    for (int64_t p = 0; p < stacked_rank / 2; p++) {
        __m128bh pair = _mm_cvtneps_pbh(_mm_set_ps(0.f, 0.f, shrunk[2 * p + 1], shrunk[2 * p]));
        pairs_out[p] = (uint32_t)_mm_extract_epi32((__m128i)pair, 0);
    }
}

/* y_row[start:stop] += the slice's B pairs [first_pair, last_pair) times the shrunk pairs, rounded once. */
BF16_TARGET static void expand_add(uint16_t *y_row, const uint16_t *b_slot, const uint32_t *pairs,
                                   int64_t first_pair, int64_t last_pair, int64_t out_features, int64_t start,
                                   int64_t stop) {
    for (int64_t o = start; o < stop; o += 16) {
        const int64_t left = stop - o, count = left < 16 ? left : 16;
        const __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = first_pair; p < last_pair; p++) {
            CHECK_LOAD(b_slot + (p * out_features + o) * 2, 2 * count);
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32((int)pairs[p]),
                                   (__m512bh)_mm512_maskz_loadu_epi32(mask, b_slot + (p * out_features + o) * 2));
        }
        CHECK_LOAD(y_row + o, count);
        const __m256i y_bf16 = _mm256_maskz_loadu_epi16(mask, y_row + o);
        const __m512 y_f32 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(y_bf16), 16));
        CHECK_STORE(y_row + o, count);
        _mm256_mask_storeu_epi16(y_row + o, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(y_f32, sum)));
    }
}

BF16_TARGET static void row_bf16(const struct call *c, int64_t index) {
    const int64_t stacked_rank = c->rank * c->n_slices, out_features = c->out_offsets[c->n_slices];
    const int64_t row = c->rows[index], slot = c->slots[index];
    uint32_t pairs[stacked_rank / 2];
    shrink((const uint16_t *)c->x + row * c->x_stride, (const uint16_t *)c->a + slot * stacked_rank * c->in_features,
           c->in_features, stacked_rank, c->scale, pairs);
    const uint16_t *b_slot = (const uint16_t *)c->b + slot * stacked_rank * out_features;
    for (int64_t j = 0; j < c->n_slices; j++)
        expand_add((uint16_t *)c->y + row * c->y_stride, b_slot, pairs, j * c->rank / 2, (j + 1) * c->rank / 2,
                   out_features, c->out_offsets[j], c->out_offsets[j + 1]);
}

/* ---- what the host has, and the kernel's own probe ----------------------------------------------- */

/* HAS_FP32 | HAS_BF16: what this CPU says it has (cpuid) and its OS saves across switches (XCR0: SSE,
 * AVX, the opmask and both ZMM halves), so a VM that lists AVX-512 without enabling it gets neither. */
int64_t graft_lora_host_features(void) {
    unsigned a, b, c, d, low, high;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) /* OSXSAVE: xgetbv is there */
        return 0;
    const int fma = c >> 12 & 1;
    __asm__ volatile("xgetbv" : "=a"(low), "=d"(high) : "c"(0));
    if ((low & 0xe6) != 0xe6 || __get_cpuid_max(0, NULL) < 7)
        return 0;
    __cpuid_count(7, 0, a, b, c, d);
    const int f = b >> 16 & 1, bw = b >> 30 & 1, vl = b >> 31 & 1;
    int bf16 = 0;
    if (a >= 1) { /* leaf 7's subleaf 1 exists */
        __cpuid_count(7, 1, a, b, c, d);
        bf16 = a >> 5 & 1;
    }
    return (f && fma ? HAS_FP32 : 0) | (f && bw && vl && bf16 ? HAS_BF16 : 0);
}

int64_t graft_lora_add_f32(const float *, int64_t, float *, int64_t, const float *, const float *, const int64_t *,
                           const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t *,
                           float);
int64_t graft_lora_add_bf16(const uint16_t *, int64_t, uint16_t *, int64_t, const uint16_t *, const uint16_t *,
                            const int64_t *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                            const int64_t *, float);

enum { T_ = 3, S_ = 2, I_ = 40, RANK_ = 2, SLICES_ = 2, R_ = RANK_ * SLICES_, O_ = 24 + 8 };
static const int64_t probe_rows[2] = {2, 0}, probe_slots[2] = {1, 0}, probe_offsets[SLICES_ + 1] = {0, 24, O_};

static int small(int64_t seed) { return (int)(seed % 3) - 1; }
static uint16_t to_bf16(float value) { uint32_t bits; memcpy(&bits, &value, 4); return (uint16_t)(bits >> 16); }
static float from_bf16(uint16_t value) { uint32_t bits = (uint32_t)value << 16; float f; memcpy(&f, &bits, 4); return f; }

/* The probe's case in integers: x, A, block-diagonal B of small integers, so that every product and sum is
 * exact in bf16 and fp32 (|y| < 256); want = y + B @ A @ x for rows 2 (slot 1) and 0 (slot 0), row 1 as is. */
static void probe_case(float x[T_][I_], float a[S_][R_][I_], float b[S_][O_][R_], float y[T_][O_], float want[T_][O_]) {
    for (int t = 0; t < T_; t++)
        for (int i = 0; i < I_; i++) x[t][i] = (float)small(7 * t + 5 * i + 1);
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++) {
            for (int i = 0; i < I_; i++) a[s][r][i] = (float)small(3 * s + 11 * r + 2 * i);
            for (int o = 0; o < O_; o++)
                b[s][o][r] = (r / RANK_ == (o >= 24)) ? (float)small(13 * s + r + 17 * o) : 0.f;
        }
    for (int t = 0; t < T_; t++)
        for (int o = 0; o < O_; o++) y[t][o] = want[t][o] = (float)small(t + 3 * o) * 2.f;
    for (int k = 0; k < 2; k++) {
        const int64_t t = probe_rows[k], s = probe_slots[k];
        for (int o = 0; o < O_; o++)
            for (int r = 0; r < R_; r++) {
                float shrunk = 0.f;
                for (int i = 0; i < I_; i++) shrunk += a[s][r][i] * x[t][i];
                want[t][o] += b[s][o][r] * shrunk;
            }
    }
}

static int probe_f32(void) {
    float x[T_][I_], a[S_][R_][I_], b[S_][O_][R_], y[T_][O_], want[T_][O_], b_t[S_][R_][O_];
    probe_case(x, a, b, y, want);
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++)
            for (int o = 0; o < O_; o++) b_t[s][r][o] = b[s][o][r];
    if (graft_lora_add_f32(&x[0][0], I_, &y[0][0], O_, &a[0][0][0], &b_t[0][0][0], probe_rows, probe_slots, 2, T_, S_,
                           I_, RANK_, SLICES_, probe_offsets, 1.f) != 2)
        return 0;
    return memcmp(y, want, sizeof y) == 0;
}

static int probe_bf16(void) {
    float x[T_][I_], a[S_][R_][I_], b[S_][O_][R_], y[T_][O_], want[T_][O_];
    uint16_t x16[T_][I_], a16[S_][R_][I_], pairs16[S_][R_ / 2][O_][2], y16[T_][O_];
    probe_case(x, a, b, y, want);
    for (int t = 0; t < T_; t++) {
        for (int i = 0; i < I_; i++) x16[t][i] = to_bf16(x[t][i]);
        for (int o = 0; o < O_; o++) y16[t][o] = to_bf16(y[t][o]);
    }
    for (int s = 0; s < S_; s++)
        for (int r = 0; r < R_; r++) {
            for (int i = 0; i < I_; i++) a16[s][r][i] = to_bf16(a[s][r][i]);
            for (int o = 0; o < O_; o++) pairs16[s][r / 2][o][r % 2] = to_bf16(b[s][o][r]);
        }
    if (graft_lora_add_bf16(&x16[0][0], I_, &y16[0][0], O_, &a16[0][0][0], &pairs16[0][0][0][0], probe_rows,
                            probe_slots, 2, T_, S_, I_, RANK_, SLICES_, probe_offsets, 1.f) != 2)
        return 0;
    for (int t = 0; t < T_; t++)
        for (int o = 0; o < O_; o++)
            if (from_bf16(y16[t][o]) != want[t][o])
                return 0;
    return 1;
}

/* HAS_FP32 | HAS_BF16 for the functions this host has that gave the exact sums of a small case. graft runs
 * it in a child process: an instruction the CPU refuses kills the child, never a server. */
int64_t graft_lora_self_test(void) {
    const int64_t has = graft_lora_host_features();
    return (has & HAS_FP32 && probe_f32() ? HAS_FP32 : 0) | (has & HAS_BF16 && probe_bf16() ? HAS_BF16 : 0);
}

/* ---- checks and the fault guard ------------------------------------------------------------------ */

/* Whether every row is in [0, n_tokens) and every slot in [0, n_slots), and the sizes make sense; checked
 * before anything is written, so a refused call leaves y as it was. */
static int proven(const struct call *c, int64_t n_tokens, int64_t n_slots, int64_t pair) {
    if (c->n_rows < 0 || c->in_features < 1 || c->rank < 1 || c->n_slices < 1 || c->rank % pair != 0 ||
        c->rank * c->n_slices > MAX_STACKED_RANK || c->x_stride < c->in_features || c->out_offsets[0] != 0)
        return 0;
    for (int64_t j = 0; j < c->n_slices; j++)
        if (c->out_offsets[j + 1] < c->out_offsets[j])
            return 0;
    if (c->y_stride < c->out_offsets[c->n_slices])
        return 0;
    for (int64_t k = 0; k < c->n_rows; k++)
        if (c->rows[k] < 0 || c->rows[k] >= n_tokens || c->slots[k] < 0 || c->slots[k] >= n_slots)
            return 0;
    return 1;
}

static __thread sigjmp_buf *armed; /* set while this thread runs rows; the fault handler jumps back */
static __thread unsigned char *saved_row;
static __thread size_t saved_capacity;
static struct sigaction handed_on[4]; /* the handlers before ours, for SIGILL, SIGSEGV, SIGBUS, SIGFPE */
static const int guarded_signals[4] = {SIGILL, SIGSEGV, SIGBUS, SIGFPE};
static volatile sig_atomic_t fault_signal, fault_code;
static volatile uintptr_t fault_ip, fault_address;
static unsigned char fault_bytes[16];

static uintptr_t library_base(void) {
    Dl_info info;
    return dladdr((void *)library_base, &info) ? (uintptr_t)info.dli_fbase : 0;
}

static void write_hex(char **out, uintptr_t value) {
    char digits[16];
    int n = 0;
    do digits[n++] = "0123456789abcdef"[value & 15]; while ((value >>= 4) && n < 16);
    *(*out)++ = '0', *(*out)++ = 'x';
    while (n) *(*out)++ = digits[--n];
}

static void write_text(char **out, const char *text) {
    const size_t length = strlen(text);
    memcpy(*out, text, length), *out += length;
}

/* One line on stderr for a fault outside the kernel (async-signal-safe: write(2) and no allocation). */
static void describe_foreign_fault(int sig, uintptr_t ip, uintptr_t address) {
    char line[192], *out = line;
    write_text(&out, "graft: fatal ");
    write_text(&out, sig == SIGILL ? "SIGILL" : sig == SIGSEGV ? "SIGSEGV" : sig == SIGBUS ? "SIGBUS" : "SIGFPE");
    write_text(&out, " at ip ");
    write_hex(&out, ip);
    write_text(&out, ", address ");
    write_hex(&out, address);
    write_text(&out, ": not in graft's LoRA kernel (loaded at ");
    write_hex(&out, library_base());
    write_text(&out, "), handed on\n");
    ssize_t ignored = write(STDERR_FILENO, line, (size_t)(out - line));
    (void)ignored;
}

static void on_fault(int sig, siginfo_t *info, void *context) {
    const uintptr_t ip = (uintptr_t)((ucontext_t *)context)->uc_mcontext.gregs[REG_RIP];
    sigjmp_buf *jump = armed;
    if (jump != NULL) {
        armed = NULL;
        fault_signal = sig, fault_code = info->si_code, fault_ip = ip, fault_address = (uintptr_t)info->si_addr;
        memcpy(fault_bytes, (const void *)ip, sizeof fault_bytes); /* inside our own text: readable */
        siglongjmp(*jump, 1);
    }
    describe_foreign_fault(sig, ip, (uintptr_t)info->si_addr);
    for (int k = 0; k < 4; k++) {
        if (guarded_signals[k] != sig)
            continue;
        struct sigaction *before = &handed_on[k];
        if (before->sa_flags & SA_SIGINFO && before->sa_sigaction != NULL) {
            before->sa_sigaction(sig, info, context);
        } else if (before->sa_handler != SIG_DFL && before->sa_handler != SIG_IGN) {
            before->sa_handler(sig);
        } else {
            signal(sig, SIG_DFL); /* the faulting instruction runs again and takes the default action */
            if (info->si_code <= 0)
                raise(sig); /* sent, not a fault: nothing runs again */
        }
    }
}

/* Install the fault handler once per process (graft calls it as it loads the library); 0 on success. */
int64_t graft_lora_install_guard(void) {
    static int installed;
    if (installed)
        return 0;
    struct sigaction ours;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_fault;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    for (int k = 0; k < 4; k++)
        if (sigaction(guarded_signals[k], &ours, &handed_on[k]) != 0)
            return -1;
    installed = 1;
    return 0;
}

/* The last fault inside the kernel, as text (signal, code, where in this library, the bytes there). */
int64_t graft_lora_fault(char *text, int64_t size) {
    char bytes[16 * 3 + 1] = "";
    for (int k = 0; k < 16; k++)
        snprintf(bytes + 3 * k, 4, "%02x ", fault_bytes[k]);
    return snprintf(text, (size_t)size, "signal %d (code %d) at %s+0x%lx, address 0x%lx; instruction bytes %s",
                    (int)fault_signal, (int)fault_code, "lora_kernel", (unsigned long)(fault_ip - library_base()),
                    (unsigned long)fault_address, bytes);
}

/* Run rows in order, each saved first; a fault restores the row it hit and returns its index. */
static int64_t run_guarded(const struct call *c, void (*row)(const struct call *, int64_t), size_t element) {
    const size_t row_bytes = (size_t)c->out_offsets[c->n_slices] * element;
    if (row_bytes > saved_capacity) {
        unsigned char *bigger = realloc(saved_row, row_bytes);
        if (bigger == NULL)
            return -1;
        saved_row = bigger, saved_capacity = row_bytes;
    }
    volatile int64_t index = 0;
    sigjmp_buf jump;
    if (sigsetjmp(jump, 1)) {
        memcpy((unsigned char *)c->y + c->rows[index] * c->y_stride * (int64_t)element, saved_row, row_bytes);
        return index;
    }
    armed = &jump;
    for (; index < c->n_rows; index++) {
        unsigned char *y_row = (unsigned char *)c->y + c->rows[index] * c->y_stride * (int64_t)element;
        memcpy(saved_row, y_row, row_bytes);
        row(c, index);
    }
    armed = NULL;
    return c->n_rows;
}

/* n_rows when every row was added; -1 refused (nothing written); k < n_rows: a fault at row k. */
int64_t graft_lora_add_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                           const float *b_t, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                           int64_t n_tokens, int64_t n_slots, int64_t in_features, int64_t rank, int64_t n_slices,
                           const int64_t *out_offsets, float scale) {
    const struct call c = {x, a, b_t, y, rows, slots, out_offsets, x_stride, y_stride, n_rows, in_features, rank,
                           n_slices, scale};
    return proven(&c, n_tokens, n_slots, 1) ? run_guarded(&c, row_f32, sizeof(float)) : -1;
}

int64_t graft_lora_add_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const uint16_t *a,
                            const uint16_t *b_pairs, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                            int64_t n_tokens, int64_t n_slots, int64_t in_features, int64_t rank, int64_t n_slices,
                            const int64_t *out_offsets, float scale) {
    const struct call c = {x, a, b_pairs, y, rows, slots, out_offsets, x_stride, y_stride, n_rows, in_features, rank,
                           n_slices, scale};
    return proven(&c, n_tokens, n_slots, 2) ? run_guarded(&c, row_bf16, sizeof(uint16_t)) : -1;
}
