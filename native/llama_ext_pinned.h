// Declarations of libllama symbols that are not part of llama.h's stable C API.
//
// Pinned to llama.cpp commit 0c1e570, the copy vendored by llama-cpp-python 0.3.36. They come from
// `src/llama-ext.h` (C++ linkage; exported from libllama.so) and `src/llama-model.h`. The compiler
// checks every call against these prototypes and the linker resolves them against the installed
// libllama; if a later llama.cpp changes one, the import-time check in module.cpp fails with a
// clear message rather than calling through a wrong signature.
#pragma once

#include "llama.h"

#include <cstdint>

// src/llama-ext.h: stage the input of layer `il` (layer-input index = HF layer id + 1) so that
// the next decode records it; read it back after the decode as [n_outputs x n_embd] floats.
LLAMA_API void    llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t il, bool value);
LLAMA_API float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t il);

// src/llama-ext.h: the "nextn" embeddings. For a dflash drafter this is where the DFlash 2
// candidate-selector lattice is written.
// masked: true = only rows with batch.logits != 0; false = every row of the batch.
LLAMA_API void    llama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked);
LLAMA_API float * llama_get_embeddings_nextn(llama_context * ctx);
LLAMA_API float * llama_get_embeddings_nextn_ith(llama_context * ctx, int32_t i);

// src/llama-ext.h: top-k of the DFlash 2 candidate selector (0 for a DFlash 1 drafter), and the
// drafter's target layer ids as stored in `dflash.target_layers` (HF ids + 1).
LLAMA_API int32_t         llama_model_dflash_selector_top_k(const llama_model * model);
LLAMA_API const int32_t * llama_model_target_layer_ids(const llama_model * model);
LLAMA_API uint32_t        llama_model_target_layer_ids_n(const llama_model * model);

// src/llama-ext.h: the context set as `ctx_other` (the target context of a drafter).
LLAMA_API llama_context * llama_get_ctx_other(llama_context * ctx);

namespace dflash2 {
// The llama.cpp commit these declarations were read from.
inline constexpr const char * kPinnedLlamaCppCommit = "0c1e570";
// llama_version() of that build.
inline constexpr const char * kPinnedLlamaVersion = "0.5.0-dev";
}  // namespace dflash2
