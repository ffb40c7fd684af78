/* What graft's LoRA kernel's three sources share (lora_kernel.c: the sums; lora_guard.c: the fault guard;
 * lora_probe.c: what the host has, and the kernel's own probe). */
#ifndef GRAFT_LORA_KERNEL_H
#define GRAFT_LORA_KERNEL_H
#include <stddef.h>
#include <stdint.h>

enum { HAS_FP32 = 1, HAS_BF16 = 2 };

struct call { /* one call's arguments, as graft_lora_add_* takes them */
    const void *x, *a, *b;
    void *y;
    const int64_t *rows, *slots, *out_offsets;
    int64_t x_stride, y_stride, n_rows, in_features, rank, n_slices;
    float scale;
};

typedef void row_function(const struct call *, int64_t index);

/* Run the call's rows in order under the fault guard: n_rows, or the row a fault stopped at, restored. */
__attribute__((visibility("hidden"))) int64_t run_guarded(const struct call *c, row_function *row, size_t element);

int64_t graft_lora_add_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride, const float *a,
                           const float *b_t, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                           int64_t n_tokens, int64_t n_slots, int64_t in_features, int64_t rank, int64_t n_slices,
                           const int64_t *out_offsets, float scale);
int64_t graft_lora_add_bf16(const uint16_t *x, int64_t x_stride, uint16_t *y, int64_t y_stride, const uint16_t *a,
                            const uint16_t *b_pairs, const int64_t *rows, const int64_t *slots, int64_t n_rows,
                            int64_t n_tokens, int64_t n_slots, int64_t in_features, int64_t rank, int64_t n_slices,
                            const int64_t *out_offsets, float scale);
#endif
