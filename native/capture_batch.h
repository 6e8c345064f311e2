// Batched greedy generation with target feature capture: the drafter's training data
// (capture_batch.cpp).
//
// One BatchCapture owns a target model + context with `n_parallel` sequence slots. Each step()
// is ONE llama_decode holding the next token of every running sequence (one seq_id per slot)
// plus the whole prompt of each sequence admitted into a free slot in that step (continuous
// batching: a finished sequence frees its slot, the next prompt is prefilled into it in the
// next call, beside the others' one-token rows). Greedy = argmax of the target's raw logits.
// Every row fed is captured through FeatureCapture (capture.h) at the target layer ids, so a
// finished sequence carries the features of all its rows, prompt and response, from the same
// decode calls that generated it: one pass over every token.
//
// Row order of the features, per capture path:
//   layer_inp: libllama writes layer inputs in batch order after every decode, whatever the
//              ubatch split (llama_context::output_reorder at 0c1e570 permutes them back with
//              the ubatch's batch_idxs), so the KV cache keeps one stream per sequence
//              (kv_unified = false): each row attends over its own sequence's cells only;
//   cb_eval:   the callback sees ubatches in compute order, which is batch order only with a
//              unified KV cache (split_simple; one stream per sequence regroups rows by
//              sequence with split_equal), so this path runs with kv_unified = true.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "capture.h"

struct llama_model;
struct llama_context;

namespace dflash2 {

// Construction options. Sizes are in tokens; n_gpu_layers as in llama.cpp (-1 = all).
struct BatchCaptureOptions {
    std::string target_path;
    std::vector<int32_t> target_layer_ids;  // HF layer ids (output of decoder layer k), feature order
    int n_parallel   = 16;    // sequence slots (n_seq_max)
    int n_ctx_seq    = 1024;  // cells per sequence: prompt + response must fit
    int n_batch      = 2048;  // most rows per llama_decode (>= n_parallel; a prompt must fit)
    int n_ubatch     = 512;   // most rows per compute graph (llama.cpp -ub)
    int n_threads    = 0;     // 0: hardware concurrency
    int n_gpu_layers = 0;
    int flash_attn   = -1;    // -1 auto, 0 off, 1 on
    bool repack      = true;  // llama.cpp --repack (use_extra_bufts)
    std::string capture = "auto";  // "auto" | "layer_inp" | "cb_eval"
};

// One finished sequence.
struct CapturedSequence {
    int64_t key = 0;                 // the key it was queued with
    std::vector<int32_t> prompt;     // prompt ids
    std::vector<int32_t> response;   // greedy ids; ends with the EOG token when one was produced
    std::vector<uint16_t> features;  // IEEE float16 bits [prompt + response rows x width()]
    std::string stop_reason;         // "eog" | "length" (max_new_tokens) | "context" (n_ctx_seq full)
};

struct BatchCaptureStats {
    int64_t n_prompt = 0;      // prompt rows fed
    int64_t n_generated = 0;   // tokens generated
    int64_t n_decode = 0;      // llama_decode calls
    double t_decode_ms = 0;    // inside llama_decode (+ synchronize)
    double t_total_ms = 0;     // inside step()
};

class BatchCapture {
  public:
    // Throws Error(kErrLoad) when the target cannot be loaded or its context created,
    // Error(kErrIncompatible) for a layer id outside 0..n_layer-2 (the last layer's output is
    // pruned to the logit rows) and Error(kErrUnsupported) for capture="layer_inp" on an
    // architecture that does not record layer inputs; std::invalid_argument for bad sizes.
    explicit BatchCapture(const BatchCaptureOptions & opt);
    ~BatchCapture();
    BatchCapture(const BatchCapture &) = delete;
    BatchCapture & operator=(const BatchCapture &) = delete;

    void close();  // frees the context, then the model; safe to call twice
    bool closed() const { return ctx_ == nullptr; }

    // Queue a prompt (generation starts at position 0 of its own sequence). Throws
    // std::invalid_argument when it is empty, does not leave room for one generated token in
    // n_ctx_seq, or is longer than n_batch; Error(kErrClosed) after close().
    void submit(int64_t key, const std::vector<int32_t> & prompt, int max_new_tokens);
    // One llama_decode: feeds every running sequence's last token and admits queued prompts
    // into free slots (in queue order, while the batch has room). Returns the sequences that
    // finished in it: a sequence is finished once its last token's row has been fed, so its
    // features cover every token. Throws Error(kErrDecode) when llama_decode fails,
    // Error(kErrInternal) when the capture saw an unexpected layout or a feature beyond float16's
    // range (65504). Returns an empty list when nothing is queued or running.
    std::vector<CapturedSequence> step();
    bool idle() const;     // nothing queued, nothing running
    void clear();          // drop queued and running sequences, empty the KV cache

    const BatchCaptureStats & stats() const { return stats_; }
    void reset_stats() { stats_ = BatchCaptureStats(); }

    int n_vocab() const { return n_vocab_; }
    int n_embd() const { return n_embd_; }
    int n_layer() const { return n_layer_; }
    int n_parallel() const { return opt_.n_parallel; }
    int n_ctx_seq() const { return opt_.n_ctx_seq; }
    int width() const { return (int) opt_.target_layer_ids.size() * n_embd_; }
    std::string capture_path() const { return path_; }
    std::vector<int32_t> target_layer_ids() const { return opt_.target_layer_ids; }

    // Text helpers on the target vocabulary (as Engine's).
    std::vector<int32_t> tokenize(const std::string & text, bool add_special, bool parse_special) const;
    bool is_eog(int32_t tok) const;

  private:
    struct Pending {
        int64_t key;
        std::vector<int32_t> prompt;
        int max_new;
    };
    struct Slot {
        bool used = false, finished = false;
        CapturedSequence seq;
        int max_new = 0;
        int n_fed = 0;  // rows of this sequence already decoded (= its KV cells)
    };
    void require_open() const;
    void append_features(Slot & slot, int row0, int n_rows);

    BatchCaptureOptions opt_;
    llama_model * model_ = nullptr;
    llama_context * ctx_ = nullptr;
    std::unique_ptr<FeatureCapture> cap_;
    std::string path_;
    int n_vocab_ = 0, n_embd_ = 0, n_layer_ = 0;
    std::deque<Pending> queue_;
    std::vector<Slot> slots_;
    BatchCaptureStats stats_;
    std::vector<float> row_;  // scratch: one row of every target layer
};

}  // namespace dflash2
