// The RAM prompt cache (prompt_cache.cpp): saved prefixes beyond the one live in the contexts.
//
// The live prompt cache is the contexts themselves: a generation reuses the longest common token
// prefix of its prompt with the tokens the target holds (driver.cpp, Engine::begin). This cache
// keeps a few more prefixes in host memory (llama-server's `--cache-ram`, tools/server at
// 0c1e570), each the target's KV of sequence 0 and the drafter's injected-feature KV
// (llama_state_seq_get_data), so that a short side request (an agent's title or summary call)
// does not evict a long conversation: before the live state is overwritten it is saved here, and
// a prompt that shares more with a saved prefix than with the live one restores that prefix.
// Entries are evicted least recently used first to stay within the byte budget. On targets whose
// memory cannot be cut to any prefix (target_memory.h) an entry also keeps the prompt checkpoints
// of its sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "target_memory.h"

struct llama_context;

namespace dflash2 {

class PromptCache {
  public:
    explicit PromptCache(size_t budget_bytes) : budget_(budget_bytes) {}

    // Save the live state of seq 0 of both contexts (`dft` may be null): `tokens` are the tokens
    // the target holds, the drafter holds features of the first n_dft_valid. Entries that are a
    // prefix of `tokens` are dropped (superseded). Returns false when it does not fit the budget.
    // `ckpts`: the target's prompt checkpoints of that sequence (kept with the entry).
    bool save(llama_context * tgt, llama_context * dft, const std::vector<int32_t> & tokens, int n_dft_valid,
              const std::vector<StateCheckpoint> & ckpts = {});
    // Entry whose usable prefix for `prompt` is the longest (-1 if none), and that length. The
    // usable prefix is `usable(entry tokens, common prefix length, entry checkpoints)`; by
    // default the common prefix itself.
    using Usable = std::function<int(const std::vector<int32_t> &, int, const std::vector<StateCheckpoint> &)>;
    int best(const std::vector<int32_t> & prompt, int & lcp, const Usable & usable = nullptr) const;
    // Load entry i into both contexts (replacing seq 0); its tokens, drafter prefix and target
    // checkpoints out. Throws Error(kErrInternal) when libllama refuses the state.
    void restore(int i, llama_context * tgt, llama_context * dft, std::vector<int32_t> & tokens, int & n_dft_valid,
                 std::vector<StateCheckpoint> * ckpts = nullptr);

    size_t bytes() const { return bytes_; }
    size_t budget() const { return budget_; }
    int size() const { return (int) entries_.size(); }

  private:
    struct Entry {
        std::vector<int32_t> tokens;
        std::vector<uint8_t> tgt, dft;
        std::vector<StateCheckpoint> ckpts;
        int n_dft_valid = 0;
        size_t bytes() const;
        uint64_t used = 0;
    };
    void evict_to(size_t budget);
    size_t budget_, bytes_ = 0;
    uint64_t clock_ = 0;
    std::vector<Entry> entries_;
};

// Length of the longest common prefix of a and b[0, nb).
int common_prefix(const std::vector<int32_t> & a, const std::vector<int32_t> & b, int nb);

}  // namespace dflash2
