// The target's processed distribution and the state it depends on (sampling.cpp).
//
// One sampling-options type, SamplingOptions, flows unchanged from Python
// (dflash2_gguf.decoder.sampling.SamplingParams, where the defaults are defined) to here: its fields are
// listed once in DFLASH2_SAMPLING_FIELDS, which declares the struct and its Python binding
// (module.cpp). Adding a knob = one line here + one field in SamplingParams (+ its use below).
//
// The processed distribution of one target row, in llama.cpp's sampler order (common/sampling.cpp
// and src/llama-sampler.cpp at 0c1e570; llama-cpp-python 0.3.36's `Llama._init_sampler` chain):
//   logit bias -> repetition penalties -> grammar mask -> top_k -> top_p -> min_p -> temperature.
// Bias, penalties and grammar depend on the text so far: they live in SamplerState, which the
// driver keeps for the committed text and clones per verify row (committed text + the drafts
// before that row), so committed state never advances with unverified drafts.
#pragma once

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

struct llama_vocab;
struct llama_sampler;

namespace dflash2 {

using LogitBias = std::vector<std::pair<int32_t, float>>;  // (token id, added to its logit; -inf bans)

// X(type, name): every sampling option, in one list. Python sets every field (defaults live in
// dflash2_gguf/decoder/sampling.py::SamplingParams); the C++ value-initialised values mean "off/greedy".
#define DFLASH2_SAMPLING_FIELDS(X)                                                                     \
    X(float, temperature)        /* <= 0: greedy (argmax of the processed logits) */                   \
    X(int32_t, top_k)            /* <= 0: off */                                                       \
    X(float, top_p)              /* >= 1: off (0 is read as off too: value-initialised) */             \
    X(float, min_p)              /* <= 0: off */                                                       \
    X(uint64_t, seed)            /* xoshiro256** seed */                                               \
    X(float, repeat_penalty)     /* llama.cpp penalty_repeat; 1 (or 0) = off */                        \
    X(int32_t, repeat_last_n)    /* penalty window in tokens; 0 = off; -1 = the context size */        \
    X(float, presence_penalty)   /* llama.cpp penalty_present */                                       \
    X(float, frequency_penalty)  /* llama.cpp penalty_freq */                                          \
    X(bool, penalize_prompt)     /* prompt tokens enter the window (llama-server) or not (l-c-p) */    \
    X(LogitBias, logit_bias)     /* added to the raw logits first */                                   \
    X(std::string, grammar)      /* GBNF, root rule "root"; "" = none */                               \
    X(int32_t, n_probs)          /* > 0: report logprobs with the top n_probs alternatives */

struct SamplingOptions {
#define DFLASH2_DECLARE_FIELD(type, name) type name{};
    DFLASH2_SAMPLING_FIELDS(DFLASH2_DECLARE_FIELD)
#undef DFLASH2_DECLARE_FIELD

    bool greedy() const { return temperature <= 0.0f; }
    bool has_penalties() const {
        return repeat_last_n != 0 && ((repeat_penalty != 0.0f && repeat_penalty != 1.0f) ||
                                      presence_penalty != 0.0f || frequency_penalty != 0.0f);
    }
    // Throws std::invalid_argument naming the field when a value is out of range.
    void validate(int n_vocab) const;
};

// xoshiro256** seeded with splitmix64; uniform() is a 53-bit double in [0, 1).
class Rng {
  public:
    void seed(uint64_t s);
    double uniform();
    // Index drawn from unnormalised non-negative weights (zeros never drawn); -1 if all are zero.
    int32_t draw(const std::vector<float> & w);
  private:
    uint64_t s_[4] = {0, 0, 0, 0};
};

// top_k -> top_p -> min_p -> temperature on (already biased / penalised / masked) logits:
// dense probabilities, 0 for removed tokens. Tie order: higher logit first, then lower id.
// dflash2_gguf/decoder/sampling.py::processed_probs is the numpy twin (test oracle).
void truncated_probs(const float * logits, int n, const SamplingOptions & so, std::vector<float> & out);

// Index of the first maximum (llama.cpp's greedy sampler).
int argmax(const float * x, int n);

// The text-dependent part of the processed distribution: the repetition-penalty window
// (llama.cpp's `penalties` sampler semantics: a ring of the last repeat_last_n accepted tokens
// and their counts) and the grammar (libllama's grammar sampler, cloned with the state).
// Copyable: a copy clones the grammar sampler.
class SamplerState {
  public:
    SamplerState() = default;
    // Throws std::invalid_argument when the grammar does not parse.
    SamplerState(const llama_vocab * vocab, const SamplingOptions & so, int n_ctx);
    SamplerState(const SamplerState & o);
    SamplerState & operator=(const SamplerState & o);
    ~SamplerState();

    // A token of the prompt: enters the penalty window when penalize_prompt (never the grammar).
    void accept_prompt(int32_t tok);
    // A committed (or, on a clone, a drafted) token: penalty window and grammar. The token must
    // be allowed by the grammar (libllama aborts on a disallowed end-of-generation token).
    void accept(int32_t tok);

    // Logit bias + penalties (+ the grammar mask when `grammar`) on a copy of `raw`, into `out`.
    // penalties = false leaves them out (test hook of the negative control only).
    void process(const float * raw, int n_vocab, std::vector<float> & out, bool grammar, bool penalties = true) const;
    bool has_grammar() const { return grammar_ != nullptr; }
    // Grammar check of n candidate ids: ok[i] = 1 when allowed (all 1 without a grammar).
    void allowed(const int32_t * ids, int n, std::vector<uint8_t> & ok) const;

  private:
    void push_window(int32_t tok);
    const llama_vocab * vocab_ = nullptr;
    const SamplingOptions * so_ = nullptr;
    int last_n_ = 0;
    std::deque<int32_t> window_;
    std::unordered_map<int32_t, int> count_;
    llama_sampler * grammar_ = nullptr;
};

// log softmax of `logits` at temperature 1: logprob of `tok` and the n most likely (id, logprob),
// most likely first (ties: lower id first); tokens at -inf (banned by a grammar or logit bias)
// are never listed, so the list may be shorter than n.
struct TokenLogprob {
    int32_t token = -1;
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;
};
TokenLogprob token_logprob(const std::vector<float> & logits, int32_t tok, int n_top);

}  // namespace dflash2
