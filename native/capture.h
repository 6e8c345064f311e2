// Feature capture: the target hidden states the drafter is conditioned on (capture.cpp).
//
// Two paths, chosen by pairing.cpp from the target architecture:
//   layer_inp: libllama records the inputs of the chosen layers (llama_set_embeddings_layer_inp,
//              src/llama-ext.h at 0c1e570) for the 19 architectures whose graph stores them;
//   cb_eval:   a graph-evaluation callback copies `l_out-{lid-1}` (the same tensor: the output
//              of HF layer lid-1) for every other architecture (slower: forces graph splits).
// Rows come in batch order; row(slot, i) is target layer slot `slot`, batch row i of the last
// target decode.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct llama_context;
struct llama_context_params;

namespace dflash2 {

class FeatureCapture {
  public:
    // lids: layer-input indices (HF id + 1); n_layer: the target's layer count.
    FeatureCapture(const std::string & path, const std::vector<int32_t> & lids, int n_embd, int n_layer);
    // Before the target context exists: installs the cb_eval callback (cb_eval path).
    void configure(llama_context_params & cp);
    // After it exists: enables layer-input recording (layer_inp path).
    void enable(llama_context * ctx_tgt);
    // Before / after each target decode of n rows (after: throws Error(kErrInternal) when the
    // callback saw an unexpected layout or row count).
    void reset();
    void check(int n_rows) const;
    // Batch row i of slot s of the last decode: n_embd floats.
    const float * row(llama_context * ctx_tgt, int slot, int i) const;
    // Rows row0..row0+n-1 of every slot, gathered as [n x n_slots*n_embd] (the drafter's input).
    void gather(llama_context * ctx_tgt, int row0, int n, std::vector<float> & out) const;

    const std::string & path() const { return path_; }
    int n_slots() const { return (int) lids_.size(); }
    int width() const { return (int) lids_.size() * n_embd_; }

    // cb_eval state (public for the C callback)
    std::vector<int> slot_of_il;             // target layer index -> slot or -1
    std::vector<std::vector<float>> rows;    // per slot, rows in ubatch order
    std::string error;
    int n_embd_ = 0;

  private:
    std::string path_;
    std::vector<int32_t> lids_;
};

}  // namespace dflash2
