// Pairing and validation of a drafter with its target (pairing.cpp), before any drafter context
// exists: libllama does not check the pairing and aborts inside ggml on a mismatch.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

struct llama_model;

namespace dflash2 {

// Drafter metadata read with gguf.h (no tensors loaded).
struct DrafterMeta {
    std::string arch;
    int64_t n_embd = -1, block_size = -1, top_k = 0, n_vocab = -1;
    std::vector<int32_t> target_layers;  // dflash.target_layers: HF ids + 1 = layer-input indices
};

// Throws Error(kErrLoad) when the file is not a readable GGUF.
DrafterMeta read_drafter_meta(const std::string & path);

// Target architectures whose graph records layer inputs at 0c1e570 (the others take cb_eval).
const std::set<std::string> & layer_inp_archs();

// A string metadata value of a loaded model ("" when absent).
std::string meta_str(const llama_model * m, const char * key);

// Token ids of `text` in the model's vocabulary (llama_tokenize, two-call pattern). Throws
// std::invalid_argument when the tokenizer cannot encode the text (libllama throws
// std::out_of_range for vocabularies without byte-fallback tokens), Error(kErrInternal) when
// llama_tokenize fails.
std::vector<int32_t> tokenize_text(const llama_model * m, const std::string & text, bool add_special, bool parse_special);

// Load a GGUF with n_gpu_layers offloaded (llama.cpp semantics) and CPU weight repacking on or off
// (--repack / --no-repack; repacking is turned off, with a warning on stderr, where this libllama
// build offers llama.cpp's AMX buffer type, whose kernels crash: ggml-org/llama.cpp#20824).
// `role` names it in the error ("target", "drafter"). Throws
// Error(kErrLoad) when libllama cannot load it.
llama_model * load_gguf(const std::string & path, int n_gpu_layers, bool repack, const char * role);

// Checks drafter against target: dflash arch, vocabulary, hidden
// size, target layer ids inside the target's usable layers, DFlash 2 width (the lattice needs
// hidden >= top_k * (top_k + 1)), block size. Returns the capture path ("layer_inp" or
// "cb_eval") for `capture` ("auto" | "layer_inp" | "cb_eval"). Throws Error(kErrIncompatible or
// kErrUnsupported) with a message naming the mismatch and, where there is one, the fix.
std::string validate_pairing(const DrafterMeta & dm, const std::string & drafter_path, const llama_model * target,
                             const std::string & capture);

}  // namespace dflash2
