// The one description of the interface between the C++ kernels and Python: the dtype enum, one
// parameter struct per kernel, and the exported functions. pagedkv/native_abi.py reads this file
// to build its ctypes structures and the dtype table, so it keeps to a form a small parser reads:
//
//   typedef enum { NAME = value, ... } name;      explicit values, one member per line
//   typedef struct { type name; ... } name;       one field per line; types: int32_t, int64_t,
//                                                 float, an enum of this file, or a pointer
//                                                 (`const`) to void, float, int32_t or int64_t
//   int pagedkv_K(const pagedkv_K_params* params, char* err, int err_len);
//                                                 kernel K: 0 when done, else nonzero with a
//                                                 message in err (err_len bytes, terminated)
//   type name(args);                              the queries at the end
//
// and comments, the include guard and the extern "C" lines; the parser refuses anything else.
// Every kernel is called as `Library.call("K", field=value, ...)` with every field named. At
// build time native.py generates from this file a source that exports each struct's size and
// each field's offset and size as the compiler lays them out (pagedkv_abi_entry); the library is
// refused at load, in favour of the torch paths, when ctypes lays anything out differently.
#ifndef PAGEDKV_ABI_H
#define PAGEDKV_ABI_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Element types; Python maps PAGEDKV_DTYPE_<NAME> to torch.<name>.
typedef enum {
  PAGEDKV_DTYPE_FLOAT32 = 0,
  PAGEDKV_DTYPE_BFLOAT16 = 1,
  PAGEDKV_DTYPE_FLOAT16 = 2,
  PAGEDKV_DTYPE_INT8 = 3,            // a quantized KV cache, with float32 scales
  PAGEDKV_DTYPE_FLOAT8_E4M3FN = 4,   // the same in float8 e4m3fn
} pagedkv_dtype;

// Paged attention (paged_attention.cpp): every query row attends to its sequence's keys through
// the block table. Sequence b's queries are its last tokens; query i of qlen_b sits at position
// seq_lens[b] - qlen_b + i and sees keys at positions up to its own.
typedef struct {
  pagedkv_dtype dtype;              // of q and out: FLOAT32, BFLOAT16 or FLOAT16
  pagedkv_dtype kv_dtype;           // of k and v: dtype itself, or INT8 / FLOAT8_E4M3FN with scales
  const void* q;                    // [num_tokens, num_q_heads, head_dim], rows q_stride apart
  const void* k;                    // [num_blocks, num_kv_heads, block_size, head_dim] contiguous
  const void* v;                    // as k
  void* out;                        // as q, rows out_stride apart
  const float* k_scales;            // [num_blocks, num_kv_heads, block_size] of a quantized cache (K, V rotated), else null
  const float* v_scales;            // as k_scales
  const int32_t* query_start_loc;   // [num_seqs + 1]; null: one query per sequence (decode)
  const int32_t* seq_lens;          // [num_seqs] keys of each sequence
  const int32_t* block_tables;      // [num_seqs, max_blocks]
  int64_t num_tokens;
  int64_t num_seqs;
  int64_t max_blocks;
  int64_t num_blocks;
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t head_dim;
  int64_t q_stride;                 // elements between the rows of q
  int64_t out_stride;               // elements between the rows of out
  float scale;                      // applied to q . k
  int32_t threads;
  // Cascade (null pre: none): sequence b's first pre[b] blocks, all before its first query, are
  // shared with the other members of its group, group g being group_members[group_start[g] ..
  // group_start[g+1]).
  const int32_t* pre;               // [num_seqs]
  const int32_t* group_start;       // [num_groups + 1]
  const int32_t* group_members;
  int64_t num_groups;
  // A sliding window (0: none): a query at position p sees only keys at p - window < k <= p.
  // Not together with a cascade plan.
  int64_t window;
  // Gemma 2's soft-capping (0: none): each score s = scale q . k becomes softcap tanh(s / softcap).
  float softcap;
} pagedkv_paged_attention_params;

// RMSNorm with the residual add (layer_ops.cpp): residual (when given) = x + residual (x times
// x_scale first, rounded, where x_scale is set), then out = weight * normalised (residual or x),
// rounded where torch rounds.
typedef struct {
  pagedkv_dtype dtype;              // of every tensor: FLOAT32, BFLOAT16 or FLOAT16
  const void* x;                    // [rows, n], rows x_stride apart
  int64_t x_stride;
  void* residual;                   // [rows, n] contiguous, updated in place; null: none
  const void* weight;               // [n]
  void* out;                        // [rows, n] contiguous
  int64_t rows;
  int64_t n;
  float eps;
  int32_t threads;
  float x_scale;                    // with a residual: x's factor before the add (Granite's); 0: 1
} pagedkv_rms_norm_params;

// out = act(gate) * up of a fused gate | up projection (layer_ops.cpp): act SiLU, or GELU (tanh).
typedef struct {
  pagedkv_dtype dtype;              // FLOAT32, BFLOAT16 or FLOAT16
  const void* x;                    // [rows, 2 n], rows x_stride apart: gate | up
  int64_t x_stride;
  void* out;                        // [rows, n] contiguous
  int64_t rows;
  int64_t n;
  int32_t threads;
  int32_t gelu;                     // 0: SiLU (Llama); 1: GELU, tanh approximation (Gemma)
} pagedkv_silu_mul_params;

// LoRA adapters' deltas (layer_ops.cpp; model/lora.py): out[r] += (x[r] A_s^T) B_s for each row r
// under an adapter s = slots[r] >= 0, with A_s [rank_s, k] and B_s [rank_s, n] (the adapter's B
// transposed, its scale folded in) in x's dtype. Rows with slot -1 and adapters of rank 0 are
// left as they are. Sums in float32; out rounded once.
typedef struct {
  pagedkv_dtype dtype;              // of x, out, A and B: FLOAT32, BFLOAT16 or FLOAT16
  const void* x;                    // [rows, k], rows x_stride apart
  int64_t x_stride;
  void* out;                        // [rows, n], rows out_stride apart
  int64_t out_stride;
  const int32_t* slots;             // [rows]: each row's adapter, or -1
  const int64_t* a;                 // [adapters]: the address of each adapter's A (contiguous)
  const int64_t* b;                 // [adapters]: the address of each adapter's B (contiguous)
  const int32_t* ranks;             // [adapters]: 0 to 1024; 0 where an adapter changes nothing here
  int64_t adapters;
  int64_t rows;
  int64_t k;
  int64_t n;
  int32_t threads;
} pagedkv_lora_params;

// RoPE on the q and k heads of a fused q | k | v projection, in place, after the projection's bias
// and the per-head q/k norms where the model has them, then (with slots) the store of the new k
// and v into a paged cache of the same dtype (layer_ops.cpp).
typedef struct {
  pagedkv_dtype dtype;              // of qkv and the caches: FLOAT32, BFLOAT16 or FLOAT16
  void* qkv;                        // [num_tokens, (num_q_heads + 2 num_kv_heads) head_dim]
  int64_t num_tokens;
  int64_t row_stride;               // elements between the rows of qkv
  int64_t num_q_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  const int64_t* positions;         // [num_tokens]
  const float* cos;                 // [max_positions, rotary_dim]; null (and sin): no rotation (NoPE)
  const float* sin;                 // [max_positions, rotary_dim], rotate_half's sign folded in
  int64_t max_positions;
  const int64_t* slots;             // [num_tokens] flat cache slots; null: rotate only
  void* k_cache;                    // [num_blocks, num_kv_heads, block_size, head_dim]
  void* v_cache;                    // as k_cache
  int64_t num_blocks;
  int64_t block_size;
  int32_t threads;
  const void* bias;                 // [(num_q_heads + 2 num_kv_heads) head_dim] added first; or null
  const void* q_norm;               // [head_dim] RMSNorm weight of every q head before RoPE; or null
  const void* k_norm;               // [head_dim] the same for k heads (Qwen3); or null
  float norm_eps;
  int64_t rotary_dim;               // leading dims of each head that RoPE turns, even (Phi-4-mini: 3/4); 0: all
} pagedkv_rope_cache_params;

// New K or V rows rotated (vec.h: hadamard), quantized into their slots, each (token, head) row
// with its own scale (kv_quant.cpp).
typedef struct {
  pagedkv_dtype dtype;              // of data: INT8 or FLOAT8_E4M3FN
  pagedkv_dtype x_dtype;            // FLOAT32, BFLOAT16 or FLOAT16
  const void* x;                    // [num_tokens, num_heads, head_dim], tokens x_stride apart
  int64_t x_stride;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_dim;
  const int64_t* slots;             // [num_tokens]
  void* data;                       // [num_blocks, num_heads, block_size, head_dim]
  float* scales;                    // [num_blocks, num_heads, block_size]
  int64_t num_blocks;
  int64_t block_size;
} pagedkv_quant_write_params;

// out = x W^T in bfloat16 on CPUs with AVX512_BF16 (gemm.cpp; pagedkv_bf16_gemm says whether this
// build has it): float32 sums, rounded once to bfloat16.
typedef struct {
  const void* x;                    // [rows, k] bfloat16, rows x_stride apart
  int64_t x_stride;
  const void* w;                    // W [n, k] bfloat16 in panels of 32 rows, each [k / 2, 32, 2] (prepacked.py)
  void* out;                        // [rows, n] bfloat16, rows out_stride apart
  int64_t out_stride;
  int64_t rows;
  int64_t n;
  int64_t k;                        // even
  int32_t threads;
} pagedkv_gemm_bf16_params;
// The same with 4-bit weights, w = (q - 8) * scale + zero per group of k (gemm.cpp: in bf16 with
// AVX512_BF16, else in float32 FMAs), for x and out in bfloat16 or float32.
typedef struct {
  pagedkv_dtype dtype;              // of x and out: BFLOAT16 or FLOAT32
  const void* x;                    // [rows, k], rows x_stride apart
  int64_t x_stride;
  const void* codes;                // uint8 [n / 32, k / 2, 32]: a panel's codes per k pair (gemm.cpp)
  const void* scales;               // bfloat16 [n / 32, k / group, 2, 32]: scales, then zeros
  void* out;                        // [rows, n], rows out_stride apart
  int64_t out_stride;
  int64_t rows;
  int64_t n;                        // a multiple of 32
  int64_t k;                        // a multiple of group
  int64_t group;                    // even
  int32_t threads;
} pagedkv_gemm_int4_params;
// out = x W^T in float32, every ISA (gemm.cpp): W in panels of 2 x pagedkv_vector_width() rows.
typedef struct {
  const float* x;                   // [rows, k], rows x_stride apart
  int64_t x_stride;
  const float* w;                   // W [n, k] in panels of c = 2 x vector width rows, each [k, c];
                                    // the last padded with zero rows to c (prepacked.py)
  float* out;                       // [rows, n], rows out_stride apart
  int64_t out_stride;
  int64_t rows;
  int64_t n;
  int64_t k;
  int32_t threads;
} pagedkv_gemm_f32_params;
// Greedy tokens (argmax.cpp): out[r] = the index of row r's first maximum; a row holding NaN gives
// its first NaN's index (torch's max counts NaN as the largest).
typedef struct {
  const float* x;                   // [rows, n], rows x_stride apart
  int64_t x_stride;
  int64_t* out;                     // [rows]
  int64_t rows;
  int64_t n;                        // at most 2^24 (indices are counted in float32 lanes)
  int32_t threads;
} pagedkv_argmax_params;
// A recorded sequence of kernel calls, run in order (graph.cpp; model/decode_graph.py): stops at
// the first that fails, its message prefixed with its index.
typedef struct {
  const void* kernels;              // [count] the kernels' functions (pagedkv_<kernel> above)
  const void* params;               // [count] pointers to their parameter structs
  int64_t count;
} pagedkv_run_graph_params;
int pagedkv_paged_attention(const pagedkv_paged_attention_params* params, char* err, int err_len);
int pagedkv_rms_norm(const pagedkv_rms_norm_params* params, char* err, int err_len);
int pagedkv_silu_mul(const pagedkv_silu_mul_params* params, char* err, int err_len);
int pagedkv_rope_cache(const pagedkv_rope_cache_params* params, char* err, int err_len);
int pagedkv_lora(const pagedkv_lora_params* params, char* err, int err_len);
int pagedkv_quant_write(const pagedkv_quant_write_params* params, char* err, int err_len);
int pagedkv_gemm_bf16(const pagedkv_gemm_bf16_params* params, char* err, int err_len);
int pagedkv_gemm_int4(const pagedkv_gemm_int4_params* params, char* err, int err_len);
int pagedkv_gemm_f32(const pagedkv_gemm_f32_params* params, char* err, int err_len);
int pagedkv_argmax(const pagedkv_argmax_params* params, char* err, int err_len);
int pagedkv_run_graph(const pagedkv_run_graph_params* params, char* err, int err_len);

// The vector backend the library was built for (vec.h): avx512, avx2, neon or portable.
const char* pagedkv_isa(void);
// float32 lanes per vector: 16 with AVX-512, 8 with AVX2 or portable, 4 with NEON.
int pagedkv_vector_width(void);
// 1 when gemm_bf16 and gemm_int4 are built (AVX-512 with AVX512_BF16), else 0.
int pagedkv_bf16_gemm(void);
// 1 when gemm_bf16 multiplies 8 rows or more with AMX tiles (built for a CPU with AMX-BF16, which
// Linux lent this process, and $PAGEDKV_AMX is not 0), else 0.
int pagedkv_amx(void);
// Entry i of the layout table generated from this file (sizeof / offsetof expressions with
// their values, and the enum members); null past the last one.
const char* pagedkv_abi_entry(int64_t i, int64_t* value);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // PAGEDKV_ABI_H
