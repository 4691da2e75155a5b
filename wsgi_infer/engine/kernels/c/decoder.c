/* A step's decoder layers in one call (fused_decoder.py): the Llama layer (llama.py), or Gemma's (gemma3.py: norms
 * of each block's output, GeGLU, RoPE per kind), op for op, each through the kernel its torch path calls, so a
 * row's result is the same whichever path its step took, and then the model's final norm. What is left of a step in
 * Python is the embedding and the LM head. */
#include "common.h"
#include "packed_mm.h"

typedef struct {
    const float *input_norm, *post_attention_norm;
    const float *q_norm, *k_norm; /* per-head norms of queries and keys (Qwen3), or NULL */
    int64_t rope;                 /* 0: a layer without positions (SmolLM3's NoPE layers) */
    int64_t window;               /* a sliding window's tokens, or 0: the whole context */
    int64_t local_rope;           /* 1: the second RoPE tables (Gemma's sliding-window layers' own base) */
    int64_t gelu;                 /* 1: GeGLU (Gemma), 0: SwiGLU */
    const float *attention_out_norm, *mlp_out_norm; /* Gemma's norms of each block's output, or NULL */
    packed_weight qkv, o, gate_up, down;
} DecoderLayer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, rotary_dim, intermediate, block_size;
    float eps, scale;
    int threads;
    int planes;               /* the activations' (packed_mm) */
    const float *final_norm;  /* the model's norm after its layers */
} DecoderShape;

/* kv_caches: a layer's [slots, 2 * kv_heads, head_dim] each, IEEE halves. x: [rows, hidden], the embeddings in, the
 * final norm of the last layer's output plus the running sum out; residual: [rows, hidden], scratch (that sum).
 * cos_sin: cos, sin, then a second pair for layers with local_rope, each [rows, rotary dims]; slots: [rows] where
 * each row's key and value go; block_table, seqs, max_blocks, row_seqs, context_lens: as paged_attention reads
 * them. window_slots, window_block_table, window_max_blocks: the same for sliding-window layers where they keep
 * blocks of their own (kv_cache_manager.py), or NULL. stop: read before each layer; once set, the remaining layers
 * are skipped (the caller then discards the step). */
void decoder_layers(const DecoderLayer *layers, int64_t num_layers, const DecoderShape *shape, f16 *const *kv_caches,
                    float *x, float *residual, const float *const *cos_sin, const int64_t *slots,
                    const int64_t *block_table, int64_t seqs, int64_t max_blocks, const int64_t *row_seqs,
                    const int64_t *context_lens, const int64_t *window_slots, const int64_t *window_block_table,
                    int64_t window_max_blocks, int64_t rows, const volatile int *stop) {
    int64_t hidden = shape->hidden, head_dim = shape->head_dim, heads = shape->heads, kv_heads = shape->kv_heads;
    int64_t qkv_width = (heads + 2 * kv_heads) * head_dim, kv_width = 2 * kv_heads * head_dim;
    float *h = scratch(SCRATCH_NORMED, rows * hidden * sizeof(float));
    float *attn = scratch(SCRATCH_ATTENDED, rows * heads * head_dim * sizeof(float));
    float *qkv = scratch(SCRATCH_QKV, rows * qkv_width * sizeof(float));
    float *gate_up = scratch(SCRATCH_GATE_UP, rows * 2 * shape->intermediate * sizeof(float));
    float *act = scratch(SCRATCH_GATED, rows * shape->intermediate * sizeof(float));
    memcpy(residual, x, rows * hidden * sizeof(float)); /* the first norm adds nothing to the embeddings */
    for (int64_t l = 0; l < num_layers && !*stop; l++) { /* stop: set by another thread (step_interrupt.py) */
        const DecoderLayer *layer = layers + l;
        rms_norm(x, l == 0 ? NULL : residual, layer->input_norm, h, rows, hidden, shape->eps, shape->threads);
        packed_mm(h, rows, &layer->qkv, qkv, shape->planes, shape->threads);
        if (layer->q_norm)
            head_norm(qkv, qkv_width, layer->q_norm, layer->k_norm, rows, heads, kv_heads, head_dim, shape->eps,
                      shape->threads);
        const float *cos = cos_sin[2 * layer->local_rope], *sin = cos_sin[2 * layer->local_rope + 1];
        if (layer->rope)
            rotate(qkv, qkv_width, cos, sin, rows, heads + kv_heads, head_dim, shape->rotary_dim, shape->threads);
        int own = layer->window && window_block_table;
        const int64_t *layer_slots = own ? window_slots : slots, *table = own ? window_block_table : block_table;
        for (int64_t r = 0; r < rows; r++)
            store_halves(kv_caches[l] + layer_slots[r] * kv_width, qkv + r * qkv_width + heads * head_dim, kv_width);
        paged_attention(qkv, qkv_width, kv_caches[l], table, seqs, own ? window_max_blocks : max_blocks, row_seqs,
                        context_lens, shape->block_size, attn, rows, heads, kv_heads, head_dim, shape->scale,
                        layer->window, shape->threads);
        packed_mm(attn, rows, &layer->o, x, shape->planes, shape->threads);
        if (layer->attention_out_norm)
            rms_norm(x, NULL, layer->attention_out_norm, x, rows, hidden, shape->eps, shape->threads);
        rms_norm(x, residual, layer->post_attention_norm, h, rows, hidden, shape->eps, shape->threads);
        packed_mm(h, rows, &layer->gate_up, gate_up, shape->planes, shape->threads);
        gated_mul(gate_up, act, rows, shape->intermediate, (int)layer->gelu, shape->threads);
        packed_mm(act, rows, &layer->down, x, shape->planes, shape->threads);
        if (layer->mlp_out_norm) rms_norm(x, NULL, layer->mlp_out_norm, x, rows, hidden, shape->eps, shape->threads);
    }
    /* here, not in Python: a step's last small operations ran 5-10 times slower there, after the layers' weights
     * went through the caches (sizes.md) */
    if (!*stop) rms_norm(x, residual, shape->final_norm, x, rows, hidden, shape->eps, shape->threads);
}

