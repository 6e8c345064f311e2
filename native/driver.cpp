// The DFlash / DFlash 2 speculative decoding loop on libllama.
//
// The units (upstream's common/speculative.cpp keeps the same split: a draft strategy apart from
// the verify loop and the sampler):
//   pairing.cpp       drafter/target validation before any drafter context exists
//   capture.cpp       the target features the drafter is conditioned on (layer_inp or cb_eval)
//   drafter.cpp       a block pass -> drafts, candidates and the exact q each draft was drawn from
//   sampling.cpp      the target's processed distribution (bias, penalties, grammar, truncation)
//   acceptance.cpp    the rejection rule, given the processed distribution of each verify row
//   prompt_cache.cpp  saved prefixes in RAM beyond the live one
//   driver.cpp        this loop, shaped like mlx-lm's speculative_generate_step:
//
//   begin:  reuse the longest common prefix of the prompt with the cached tokens (the drafter's
//           valid prefix is tracked on its own: features are injected only up to the last cycle
//           that continued), remove everything after it from both caches, prefill the rest while
//           capturing features, inject them, and take the first token from the target.
//   step:   anchor = last committed token (not yet in the target cache), at position P.
//           1. draft (drafter.cpp) at most n_max tokens from the full trained block;
//           2. verify [anchor, d1..dk] in one target pass (logits of every row + features);
//           3. accept (acceptance.cpp): row i's processed distribution is conditioned on the
//              committed text plus d1..d_{i} through a clone of the committed sampler state, so
//              committed penalty / grammar state never advances with unverified drafts;
//           4. commit the accepted drafts and the next token (advancing the committed state),
//              roll the target back to P + a + 1, inject the features of rows 0..a into the
//              drafter at P..P+a; the last committed token is the next anchor.
#include "driver.h"

#include "gguf.h"
#include "llama_ext_pinned.h"
#include "pairing.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

namespace dflash2 {

std::string check_libllama() {
    const char * v = llama_version();
    if (v == nullptr || std::strcmp(v, kPinnedLlamaVersion) != 0) {
        return std::string("loaded libllama reports version '") + (v ? v : "(null)") +
               "', expected '" + kPinnedLlamaVersion + "' (llama.cpp " + kPinnedLlamaCppCommit +
               "): reinstall with `pip install --force-reinstall llama-cpp-python==0.3.36` and "
               "rebuild dflash2-gguf against it";
    }
    return {};
}

namespace {

double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

struct BatchGuard {
    llama_batch b;
    explicit BatchGuard(int n) : b(llama_batch_init(n, 0, 1)) {}
    ~BatchGuard() { llama_batch_free(b); }
};

// Tokens about to be discarded from the live cache that make it worth saving to the RAM cache.
constexpr int kMinSaveTokens = 32;
// Prompt checkpoints (target_memory.h): this many tokens before the end of each prompt, and every
// kCheckpointEvery tokens of a long prefill (llama-server places its own near the end of the
// prompt and at user-message starts, tools/server/server-context.cpp at 0c1e570).
constexpr int kCheckpointTail = 4;
constexpr int kCheckpointEvery = 2048;

}  // namespace

Engine::Engine(const EngineOptions & opt) : opt_(opt) {
    llama_backend_init();
    const int n_thr_hw = (int) std::max(1u, std::thread::hardware_concurrency());
    const int n_threads = opt.n_threads > 0 ? opt.n_threads : n_thr_hw;
    const int n_threads_dft = opt.n_threads_draft > 0 ? opt.n_threads_draft : n_threads;
    if (opt.n_ctx < 8) throw std::invalid_argument("n_ctx must be >= 8");
    if (opt.capture != "auto" && opt.capture != "layer_inp" && opt.capture != "cb_eval") {
        throw std::invalid_argument("capture must be 'auto', 'layer_inp' or 'cb_eval'");
    }
    if (opt.cache_ram_mib < 0) throw std::invalid_argument("cache_ram_mib must be >= 0");

    // 1. Drafter metadata (cheap, before loading anything big).
    const bool want_dft = !opt.drafter_path.empty();
    DrafterMeta dm;
    if (want_dft) dm = read_drafter_meta(opt.drafter_path);

    // 2. Target model.
    model_tgt_ = load_gguf(opt.target_path, opt.n_gpu_layers, opt.repack, "target");
    try {
        arch_tgt_    = meta_str(model_tgt_, "general.architecture");
        n_vocab_     = llama_vocab_n_tokens(llama_model_get_vocab(model_tgt_));
        n_embd_      = llama_model_n_embd(model_tgt_);
        n_layer_tgt_ = llama_model_n_layer(model_tgt_);
        if (arch_tgt_ == "dflash") throw Error(kErrIncompatible, "the target is a dflash drafter; pass the target model first");

        // 3. Pairing, before the drafter context exists.
        if (want_dft) {
            capture_ = validate_pairing(dm, opt.drafter_path, model_tgt_, opt.capture);
            lids_ = dm.target_layers;
            block_size_ = (int) dm.block_size;
            top_k_sel_ = (int) dm.top_k;
            cap_ = std::make_unique<FeatureCapture>(capture_, lids_, n_embd_, n_layer_tgt_);
        }

        // 4. Target context.
        n_ctx_tgt_ = opt.n_ctx;
        n_batch_tgt_ = std::max(std::min(opt.n_batch, n_ctx_tgt_), 16);
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = (uint32_t) n_ctx_tgt_;
        cp.n_batch = (uint32_t) n_batch_tgt_;
        cp.n_ubatch = (uint32_t) n_batch_tgt_;
        cp.n_seq_max = 1;
        cp.n_threads = n_threads;
        cp.n_threads_batch = n_threads;
        cp.flash_attn_type = (llama_flash_attn_type) opt.flash_attn;
        cp.no_perf = true;
        cp.swa_full = opt.swa_full;
        if (cap_) cap_->configure(cp);
        // a recurrent target keeps state snapshots for the most drafts a cycle verifies
        if (opt.context_draft_max < 0) throw std::invalid_argument("context_draft_max must be >= 0");
        // (fewer than n_batch - 1: libllama keeps the trailing 1 + n_rs_seq tokens in one ubatch,
        // llama_batch_allocr::split_equal; a cycle then verifies at most that many drafts)
        // Context drafts past kRecurrentContextDrafts are not worth a snapshot each: a recurrent state
        // is tens of MB on real models (a cycle then verifies at most that many context drafts).
        const int n_rollback_max = std::min(std::max(want_dft ? block_size_ - 1 : 0,
                                                     std::min(opt.context_draft_max, kRecurrentContextDrafts)),
                                            n_batch_tgt_ - 2);
        TargetMemory::configure(model_tgt_, n_rollback_max, cp);
        ctx_tgt_ = llama_init_from_model(model_tgt_, cp);
        if (!ctx_tgt_) throw Error(kErrLoad, "failed to create the target context (n_ctx " + std::to_string(n_ctx_tgt_) + ")");
        mem_ = std::make_unique<TargetMemory>(ctx_tgt_, model_tgt_, n_rollback_max);

        // 5. Drafter model + context (ctx_other = target context).
        if (want_dft) {
            DrafterOptions d;
            d.path = opt.drafter_path;
            d.n_ctx = n_ctx_dft_ = opt.n_ctx_draft > 0 ? opt.n_ctx_draft : n_ctx_tgt_;
            d.n_threads = n_threads_dft;
            d.n_gpu_layers = opt.n_gpu_layers_draft;
            d.flash_attn = opt.flash_attn;
            d.repack = opt.repack;
            d.kv_f32 = opt.kv_f32_draft;
            d.block_size = block_size_;
            d.top_k = top_k_sel_;
            dft_ = std::make_unique<Drafter>(d, ctx_tgt_, n_vocab_, n_embd_);
            mask_token_ = dft_->mask_token();
            cap_->enable(ctx_tgt_);
        }
        if (opt.cache_ram_mib > 0) cache_ = std::make_unique<PromptCache>((size_t) opt.cache_ram_mib << 20);
        if (dft_) sources_.push_back(dft_.get());
        sources_.push_back(&lookup_);
        sources_.push_back(&pool_);
    } catch (...) {
        close();
        throw;
    }
}

Engine::~Engine() { close(); }

void Engine::close() {
    cache_.reset();
    mem_.reset();
    sources_.clear();
    dft_.reset();                                                 // the drafter (ctx_other user) first,
    if (ctx_tgt_) { llama_free(ctx_tgt_); ctx_tgt_ = nullptr; }   // contexts before models
    if (model_tgt_) { llama_model_free(model_tgt_); model_tgt_ = nullptr; }
    cap_.reset();
    active_ = false;
    tokens_.clear();
    pending_.clear();
    n_pending_ = 0;
    n_past_ = n_dft_valid_ = 0;
}

// The parity hooks use the contexts for other passes: nothing cached stays valid.
void Engine::forget_cache() {
    active_ = false;
    pending_.clear();
    n_pending_ = 0;
    llama_memory_clear(llama_get_memory(ctx_tgt_), true);
    mem_->checkpoints().clear();
    if (dft_) dft_->clear();
    tokens_.clear();
    n_past_ = n_dft_valid_ = 0;
}

void Engine::require_open() const {
    if (ctx_tgt_ == nullptr) throw Error(kErrClosed, "the decoder is closed");
}

// ---------------------------------------------------------------------------------------------
// libllama calls

void Engine::decode_target(const int32_t * toks, int n, int pos0, bool all_logits, bool want_features) {
    BatchGuard g(n);
    for (int i = 0; i < n; ++i) {
        g.b.token[i] = toks[i];
        g.b.pos[i] = pos0 + i;
        g.b.n_seq_id[i] = 1;
        g.b.seq_id[i][0] = 0;
        g.b.logits[i] = all_logits || i == n - 1;
    }
    g.b.n_tokens = n;
    if (cap_) cap_->reset();
    const int rc = llama_decode(ctx_tgt_, g.b);
    if (rc != 0) throw Error(kErrDecode, "target llama_decode failed (rc " + std::to_string(rc) + ")", rc);
    llama_synchronize(ctx_tgt_);
    if (want_features && cap_) cap_->check(n);
}

void Engine::inject_rows(int row0, int n_rows, int pos0) {
    cap_->gather(ctx_tgt_, row0, n_rows, feat_);
    dft_->inject(feat_.data(), n_rows, cap_->width(), pos0);
}

bool Engine::is_eog(int32_t tok) const { return llama_vocab_is_eog(llama_model_get_vocab(model_tgt_), tok); }

// ---------------------------------------------------------------------------------------------
// the target's processed distribution of one verify row

const std::vector<float> & Engine::row_probs(int row, const SamplerState & st, bool penalties) {
    st.process(llama_get_logits_ith(ctx_tgt_, row), n_vocab_, logits_, /*grammar*/ true, penalties);
    truncated_probs(logits_.data(), n_vocab_, gp_.sampling, probs_);
    return probs_;
}

// Greedy: argmax of the processed logits. The grammar is checked on the argmax first and applied
// to the whole vocabulary only when it rejects it (llama.cpp's common_sampler_sample does the
// same: masking removes tokens, so an allowed argmax stays the argmax).
int32_t Engine::greedy_token(const float * raw, const SamplerState & st) {
    st.process(raw, n_vocab_, logits_, /*grammar*/ false);
    int32_t t = argmax(logits_.data(), n_vocab_);
    if (st.has_grammar()) {
        st.allowed(&t, 1, ok_);
        if (!ok_[0]) {
            st.process(raw, n_vocab_, logits_, /*grammar*/ true);
            t = argmax(logits_.data(), n_vocab_);
        }
    }
    if (logits_[t] == -INFINITY) {
        throw Error(kErrInternal, "no token is allowed here (the grammar and logit_bias ban every token)");
    }
    return t;
}

int32_t Engine::sample_row(int row, const SamplerState & st) {
    if (gp_.sampling.greedy()) return greedy_token(llama_get_logits_ith(ctx_tgt_, row), st);
    const int32_t t = rng_.draw(row_probs(row, st, true));
    if (t < 0) throw Error(kErrInternal, "no token is allowed here (the grammar and logit_bias ban every token)");
    return t;
}

// ---------------------------------------------------------------------------------------------
// committing a token

void Engine::commit(Chunk & c, int32_t tok, bool from_draft, const float * raw) {
    if (gp_.sampling.n_probs > 0) {
        state_.process(raw, n_vocab_, lp_, /*grammar*/ true);
        c.logprobs.push_back(token_logprob(lp_, tok, gp_.sampling.n_probs));
    }
    state_.accept(tok);
    tokens_.push_back(tok);
    gen_tokens_.push_back(tok);
    c.tokens.push_back(tok);
    c.from_draft.push_back(from_draft ? 1 : 0);
    gen_from_draft_.push_back(from_draft ? 1 : 0);
    stats_.n_generated++;
    if (!gp_.ignore_eog && is_eog(tok)) {
        done_ = true;
        stats_.stop_reason = "eog";
        return;
    }
    if (!gp_.stop.empty()) {
        char buf[256];
        int n = llama_token_to_piece(llama_model_get_vocab(model_tgt_), tok, buf, sizeof(buf), 0, false);
        if (n > 0) {
            const size_t old = gen_text_.size();
            gen_text_.append(buf, n);
            for (const auto & s : gp_.stop) {
                if (s.empty()) continue;
                const size_t from = old >= s.size() ? old - s.size() + 1 : 0;
                if (gen_text_.find(s, from) != std::string::npos) {
                    done_ = true;
                    stats_.stop_reason = "stop";
                    return;
                }
            }
        }
    }
    if (stats_.n_generated >= gp_.n_predict) {
        done_ = true;
        stats_.stop_reason = "length";
    }
}

// ---------------------------------------------------------------------------------------------
// the prompt cache

// How many leading prompt tokens the caches can keep, after restoring a better RAM-cached prefix
// (saving the live one first when it would lose at least kMinSaveTokens). At least one prompt
// token is always evaluated again, so that a full-prefix hit still yields the first token's
// logits; with a drafter in use the reuse stops where the drafter's injected features stop.
// On a target whose memory cannot be cut anywhere (recurrent state, sliding window), the reuse
// stops at the latest prompt checkpoint within the shared prefix (target_memory.h).
int Engine::reuse_prefix(const std::vector<int32_t> & prompt) {
    const int n = (int) prompt.size();
    // the drafter's features bound the reuse when it drafts (its cache holds no more)
    auto bound = [&](int lcp, int n_dft) {
        int w = std::min(lcp, n - 1);
        if (dft_ && gp_.use_drafter) w = std::min(w, n_dft);
        return w;
    };
    int live = mem_->usable_prefix(n_past_, bound(common_prefix(tokens_, prompt, std::min(n_past_, n)),
                                                  n_dft_valid_ + n_pending_), mem_->checkpoints(), true);
    if (cache_) {
        int lcp = 0;
        const PromptCache::Usable usable = [&](const std::vector<int32_t> & toks, int l, const std::vector<StateCheckpoint> & ck) {
            return mem_->usable_prefix((int) toks.size(), bound(l, n), ck, false);
        };
        const int bi = cache_->best(prompt, lcp, usable);
        const bool restore = bi >= 0 && lcp > live;
        const int held_lcp = common_prefix(tokens_, prompt, std::min(n_past_, n));
        if (n_past_ - held_lcp >= kMinSaveTokens) {
            flush_pending();  // the saved drafter state then holds every feature of the prefix
            cache_->save(ctx_tgt_, dft_ ? dft_->ctx() : nullptr,
                         std::vector<int32_t>(tokens_.begin(), tokens_.begin() + n_past_), n_dft_valid_,
                         mem_->checkpoints());
        }
        if (restore) {
            const int bi2 = cache_->best(prompt, lcp, usable);  // indices move when save() drops entries
            cache_->restore(bi2, ctx_tgt_, dft_ ? dft_->ctx() : nullptr, tokens_, n_dft_valid_, &mem_->checkpoints());
            pending_.clear();  // they belonged to the replaced state
            n_pending_ = 0;
            n_past_ = (int) tokens_.size();
            live = mem_->usable_prefix(n_past_, bound(common_prefix(tokens_, prompt, std::min(n_past_, n)), n_dft_valid_),
                                       mem_->checkpoints(), true);
            stats_.n_cache_restored = live;
        }
    }
    return live;
}

// ---------------------------------------------------------------------------------------------
// adaptive draft length

void Engine::flush_pending() {
    if (n_pending_ == 0) return;
    dft_->inject(pending_.data(), n_pending_, cap_->width(), n_dft_valid_);
    n_dft_valid_ += n_pending_;
    n_pending_ = 0;
    pending_.clear();
}

// Rows row0..row0+n-1 of the last target pass (positions n_dft_valid_ + n_pending_..) wait in
// pending_; past kMaxPendingBytes they go to the drafter now (bounded memory on long contexts).
void Engine::add_pending(int row0, int n) {
    const size_t w = (size_t) cap_->width();
    cap_->gather(ctx_tgt_, row0, n, feat_);
    pending_.insert(pending_.end(), feat_.begin(), feat_.begin() + (size_t) n * w);
    n_pending_ += n;
    if (pending_.size() * sizeof(float) > kMaxPendingBytes) flush_pending();
}

// Keep the drafter's features of positions [0, n) only: injected ones past n leave its cache,
// pending ones past n are dropped.
void Engine::truncate_features(int n) {
    if (n <= n_dft_valid_) {
        n_dft_valid_ = std::max(n, 0);
        dft_->remove_from(n_dft_valid_);
        pending_.clear();
        n_pending_ = 0;
    } else if (n < n_dft_valid_ + n_pending_) {
        n_pending_ = n - n_dft_valid_;
        pending_.resize((size_t) n_pending_ * cap_->width());
    }
}

int Engine::cost_rows() const {
    // a DFlash block, and the longest context draft + its anchor as far as the synthetic prompt of
    // measure_costs (min(48, n_ctx / 2) tokens) leaves room for it
    const int ctx_rows = std::min(opt_.context_draft_max + 1, n_ctx_tgt_ - std::min(48, n_ctx_tgt_ / 2) - 1);
    return std::max({block_size_, 1, ctx_rows});
}

CostModel Engine::measure_costs(int reps) {
    require_open();
    if (reps < 1) throw std::invalid_argument("reps must be >= 1");
    const int n = std::min(48, n_ctx_tgt_ / 2);
    // rows (cost_rows()): past 8 every 4th up to 16, every 8th up to 32, every 16th after, and the
    // last are measured, the others interpolated (the cost is close to linear there)
    const int rows = cost_rows();
    auto measured_row = [rows](int r) {
        return r <= 8 || r == rows || (r <= 16 && r % 4 == 0) || (r <= 32 && r % 8 == 0) || r % 16 == 0;
    };
    if (n + rows + 1 > n_ctx_tgt_) throw Error(kErrContextFull, "n_ctx is too small to measure the cost model");
    forget_cache();
    std::vector<int32_t> toks(n + rows);
    for (int i = 0; i < n + rows; ++i) toks[i] = (int32_t) ((i * 7919 + 13) % n_vocab_);
    CostModel c;
    c.verify_ms.assign(rows, 0.0);
    decode_target(toks.data(), n, 0, false, dft_ != nullptr);
    if (dft_) inject_rows(0, n, 0);
    // the fastest of the repetitions: other work on the machine only ever adds time, and a load
    // that inflates the one-row pass less than the multi-row ones would keep drafting off for good
    // (a row count the policy never picks is never observed again)
    auto fastest = [](const std::vector<double> & v) { return *std::min_element(v.begin(), v.end()); };
    // a recurrent target goes back to n through a state copy (rows may exceed its snapshots);
    // the copy and restore are timed for the checkpoint rollback's cost
    std::vector<uint8_t> state;
    std::vector<double> t_save, t_restore;
    if (mem_->recurrent()) state = mem_->save_partial();
    auto rewind = [&]() {
        if (mem_->recurrent()) {
            const double t0 = now_ms();
            mem_->restore_partial(state);
            t_restore.push_back(now_ms() - t0);
        }
        llama_memory_seq_rm(llama_get_memory(ctx_tgt_), 0, n, -1);
    };
    std::vector<int> measured;
    for (int r = 1; r <= rows; ++r) {
        if (!measured_row(r)) continue;
        measured.push_back(r);
        std::vector<double> t;
        for (int i = 0; i < reps + 1; ++i) {  // the first pass warms up
            if (mem_->recurrent()) {
                const double t0 = now_ms();
                state = mem_->save_partial();
                t_save.push_back(now_ms() - t0);
            }
            const double t0 = now_ms();
            decode_target(toks.data() + n, r, n, true, dft_ != nullptr);
            if (i > 0) t.push_back(now_ms() - t0);
            rewind();
        }
        c.verify_ms[r - 1] = fastest(t);
    }
    for (size_t j = 1; j < measured.size(); ++j) {
        const int r0 = measured[j - 1], r1 = measured[j];
        for (int r = r0 + 1; r < r1; ++r) {
            const double f = (double) (r - r0) / (double) (r1 - r0);
            c.verify_ms[r - 1] = (1.0 - f) * c.verify_ms[r0 - 1] + f * c.verify_ms[r1 - 1];
        }
    }
    // checkpoint rollback: copy + restore + (on a rejection) a short re-decode, ~ one row
    if (mem_->rollback() == Rollback::kCheckpoint) c.rollback_ms = fastest(t_save) + fastest(t_restore) + c.verify_ms[0];
    if (dft_) {
        std::vector<double> t;
        for (int i = 0; i < reps + 1; ++i) {
            const double t0 = now_ms();
            dft_->run_block(toks[n], n);
            if (i > 0) t.push_back(now_ms() - t0);
            dft_->remove_from(n);
        }
        c.draft_ms = fastest(t);
    }
    forget_cache();
    cost_ = c;
    return c;
}

// ---------------------------------------------------------------------------------------------
// the loop

Chunk Engine::begin(const std::vector<int32_t> & prompt, const GenParams & gp) {
    require_open();
    if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
    if (gp.n_predict < 1) throw std::invalid_argument("n_predict must be >= 1");
    gp.sampling.validate(n_vocab_);
    gp.ngram.validate();  // before anything changes: a bad value leaves the caches as they were
    for (int32_t t : prompt) {
        if (t < 0 || t >= n_vocab_) throw std::invalid_argument("token id " + std::to_string(t) + " is outside the vocabulary");
    }
    if ((int) prompt.size() + 1 > n_ctx_tgt_) {
        throw Error(kErrContextFull, "prompt of " + std::to_string(prompt.size()) + " tokens does not fit n_ctx " +
                                         std::to_string(n_ctx_tgt_));
    }
    active_ = false;  // until the prefill succeeded
    gp_ = gp;
    state_ = SamplerState(llama_model_get_vocab(model_tgt_), gp_.sampling, n_ctx_tgt_);  // throws on a bad grammar
    stats_ = Stats();
    stats_.n_prompt = (int64_t) prompt.size();
    const int bs = std::max(block_size_ - 1, 1);
    stats_.pos_reached.assign(bs, 0);
    stats_.pos_accepted.assign(bs, 0);
    if (gp.accept_mode != kAcceptRejection && gp.accept_mode != kAcceptTargetSample) {
        throw std::invalid_argument("accept_mode must be 0 (rejection sampling) or 1 (target sample)");
    }
    rng_.seed(gp_.sampling.seed);
    rng_draft_.seed(gp_.sampling.seed ^ 0x9E3779B97F4A7C15ULL);
    gen_text_.clear();
    gen_from_draft_.clear();
    gen_tokens_.clear();
    if (gp.context_shift) {
        if (!llama_memory_can_shift(llama_get_memory(ctx_tgt_)) || mem_->recurrent()) {
            throw Error(kErrUnsupported, "context shift is not supported by this target ('" + arch_tgt_ +
                "': its memory cannot be shifted); use a larger context (-c) instead");
        }
        if (gp.n_keep < -1 || gp.n_discard < 0) throw std::invalid_argument("n_keep must be >= -1 and n_discard >= 0");
    }
    done_ = false;
    const double t0 = now_ms();
    t_begin_ = t0;

    const bool feats = dft_ != nullptr && gp_.use_drafter;
    const int n = (int) prompt.size();
    const int reuse = gp_.cache_prompt ? reuse_prefix(prompt) : 0;
    // everything past the reused prefix leaves both caches
    mem_->cut_to(reuse, n_past_);
    n_past_ = reuse;
    tokens_.assign(prompt.begin(), prompt.begin() + reuse);
    if (dft_) truncate_features(reuse);
    // the gate, the calibration and the cost model carry over from earlier generations: a new
    // request starts with what the last ones learnt (and probes again on the gate's schedule);
    // the context drafts' calibration keeps it as a weaker prior (another text copies another way).
    // While the gate is closed the prompt's features wait in pending_ like the skipped cycles'
    // (the drafter pass that would use them may never come).
    const bool lazy = gp_.adaptive && cost_.valid() && !gate_.open(cost_);
    ctx_calib_.new_request();
    stats_.n_cached = reuse;

    // prompt checkpoints (targets that need them): kCheckpointTail tokens before the end, so that
    // the next turn of a chat (whose template may render the last tokens of this prompt another
    // way) and a repeat of this prompt find one, and every kCheckpointEvery tokens of a long prefill
    const bool ckpt = mem_->needs_prompt_checkpoints();
    const int ckpt_tail = n - kCheckpointTail;
    for (int off = reuse; off < n;) {
        int m = std::min(n_batch_tgt_, n - off);
        if (ckpt) {
            const int next_every = (off / kCheckpointEvery + 1) * kCheckpointEvery;
            if (next_every < ckpt_tail) m = std::min(m, next_every - off);
            else if (off < ckpt_tail) m = std::min(m, ckpt_tail - off);
        }
        decode_target(prompt.data() + off, m, off, false, feats);
        n_past_ = off + m;
        if (ckpt && n_past_ <= ckpt_tail && (n_past_ == ckpt_tail || n_past_ % kCheckpointEvery == 0)) {
            mem_->save_checkpoint(n_past_);
        }
        // a drafter context shorter than the target's keeps what fits (drafting stops later)
        const int fit = std::min(m, n_ctx_dft_ - off);
        if (feats && fit > 0) {
            if (lazy) {
                add_pending(0, fit);
            } else {
                flush_pending();
                inject_rows(0, fit, off);
                n_dft_valid_ = off + fit;
            }
        }
        off += m;
    }
    tokens_ = prompt;
    n_prompt_ = n;
    active_ = true;
    if (gp_.use_drafter) {
        for (DraftSource * src : sources_) {
            if (gp_.spec_types & src->spec_bit()) src->begin(tokens_, gp_.ngram);
        }
    }
    stats_.rollback = rollback_name(mem_->rollback());
    stats_.n_checkpoints = (int64_t) mem_->checkpoints().size();
    for (int t : prompt) state_.accept_prompt(t);

    Chunk c;
    const double t1 = now_ms();
    const int32_t tok = sample_row(-1, state_);
    commit(c, tok, false, llama_get_logits_ith(ctx_tgt_, -1));
    stats_.t_sample_ms += now_ms() - t1;
    stats_.t_prefill_ms = t1 - t0;
    c.done = done_;
    stats_.t_total_ms = now_ms() - t_begin_;
    return c;
}

Chunk Engine::step() {
    require_open();
    if (!active_) throw Error(kErrInternal, "step() called before begin()");
    Chunk c;
    if (done_) { c.done = true; return c; }
    if (gp_.context_shift && n_past_ + 1 >= n_ctx_tgt_) shift_context();
    const int P = n_past_;
    const int32_t anchor = tokens_.back();
    const int remaining = (int) (gp_.n_predict - stats_.n_generated);
    if (P + 1 > n_ctx_tgt_) {
        done_ = true;
        stats_.stop_reason = "context";
        c.done = true;
        return c;
    }
    int k_max = 0;
    const bool drafting = dft_ != nullptr && gp_.use_drafter;  // the drafter's features are kept
    // The most drafts this cycle: a verify pass fits one target batch and the target's rollback
    // (native: n_rs_seq); with a context shift the cycle stops one cell short, so that the shift
    // comes at the same position as without drafts (P + 1 == n_ctx) and the text stays the target's.
    const int k_cap = std::max(0, std::min({remaining - 1, n_ctx_tgt_ - (gp_.context_shift ? 2 : 1) - P,
                                            n_batch_tgt_ - 1, mem_->max_drafts()}));
    if (drafting && (gp_.spec_types & kSpecDflash) && n_dft_valid_ + n_pending_ == P && P + block_size_ <= n_ctx_dft_) {
        k_max = block_size_ - 1;
        if (gp_.n_draft_max >= 0) k_max = std::min(k_max, gp_.n_draft_max);
        k_max = std::min(k_max, k_cap);
    }
    const double t_cycle = now_ms();
    // adaptive: run the drafter only while its cycles pay; then verify the k that maximises the
    // expected tokens per millisecond (draft_policy.h). Nothing here depends on this cycle's
    // verification.
    const bool adaptive = gp_.adaptive && cost_.valid() && (int) cost_.verify_ms.size() > k_max;
    // Context drafts first (no drafter pass): they win the cycle when their expected tokens per
    // ms beat what DFlash cycles have been delivering (or DFlash cannot draft); without
    // adaptation, as llama.cpp orders its types, an n-gram match wins.
    int ctx_src = -1, ctx_match = 0;
    double ctx_rate = -1.0;
    int k_ctx = 0;
    if (gp_.use_drafter && (gp_.spec_types & (kSpecNgramSimple | kSpecNgramMod))) {
        int cap = std::min(k_cap, opt_.context_draft_max);
        if (gp_.n_draft_max >= 0) cap = std::min(cap, gp_.n_draft_max);  // at most n_max drafts a cycle, any source
        k_ctx = context_drafts(cap, gp_.adaptive && cost_.valid(), ctx_src, ctx_match, ctx_rate);
    }
    bool use_ctx = false;
    if (k_ctx > 0) {
        if (k_max == 0 || !adaptive) use_ctx = true;
        else use_ctx = gate_.rate() >= 0.0 ? ctx_rate >= gate_.rate() : !gate_.open(cost_);
    }
    // Context drafts continued by the DFlash block: the context drafts fill the block's first
    // k_ctx positions (instead of mask tokens) and the lattice walk drafts on after them. Without
    // adaptation whenever the context draft is shorter than the block; adaptive, when the gate is
    // open and what DFlash cycles have been adding (their expected accepted drafts, reached if
    // every context draft is accepted) pays the drafter pass and the longer verify pass.
    bool continued = false;
    if (use_ctx && k_ctx < k_max) {
        if (!adaptive) {
            continued = true;
        } else if (dfl_tokens_ > 1.0 && gate_.rate() > 0.0 && gate_.open(cost_)) {
            double p_all = 1.0;
            for (int i = 0; i < k_ctx; ++i) p_all *= std::clamp(ctx_acc_[i], 0.0, 1.0);
            const int k_cont = std::min(k_max, k_ctx + (int) std::lround(dfl_k_));
            const double r = (expected_tokens(ctx_acc_, k_ctx) + p_all * (dfl_tokens_ - 1.0)) /
                             (cost_.verify_ms[k_cont] + cost_.draft_ms + cost_.rollback_ms);
            continued = r > ctx_rate;
        }
    }
    const int k_prefix = continued ? k_ctx : 0;  // drafts_[0, k_prefix) come from the context
    const bool run_drafter = continued || (!use_ctx && k_max > 0 && (!adaptive || gate_.draft_now(cost_)));
    if (k_max > 0 && !run_drafter) stats_.n_drafter_skipped++;
    double t0 = now_ms();
    int k = use_ctx ? k_ctx : 0;
    double draft_ms = 0;
    // Which drafts to verify, decided row by row BEFORE each draft is drawn (drafter.h): p_min on
    // the row's confidence, and the adaptive policy: continue while the best k, with this row's
    // calibrated acceptance assumed for the rows after it, still includes this row.
    std::vector<double> acc(ctx_acc_.begin(), ctx_acc_.begin() + (continued ? k_ctx : 0));
    auto keep = [&](int i, float conf) {
        if (gp_.p_min > 0.0f && conf < gp_.p_min) return false;
        if (!adaptive) return true;
        const double ai = calib_.predict(conf);
        if (i < gp_.n_draft_min) {  // the floor: decided before the draw like the rest
            acc.push_back(ai);
            return true;
        }
        std::vector<double> a(acc);
        a.resize(k_max, ai);
        if (choose_draft_length(cost_, a, k_max, 0.0) < i + 1) return false;
        acc.push_back(ai);
        return true;
    };
    if (run_drafter) {
        // the features that waited while the gate was closed go in first; their injection is
        // timed as injection, not as the drafter pass (the cost model's draft_ms is one block pass)
        if (n_pending_ > 0) {
            flush_pending();
            const double t_flush = now_ms();
            stats_.t_inject_ms += t_flush - t0;
            t0 = t_flush;
        }
        std::vector<int32_t> prefix(k_prefix);
        for (int i = 0; i < k_prefix; ++i) prefix[i] = drafts_[i].token;
        DraftRequest req;
        req.history = &tokens_;
        req.pos = P;
        req.k_max = k_max;
        req.prefix = &prefix;
        req.ngram = &gp_.ngram;
        req.sampling = &gp_.sampling;
        req.state = &state_;
        req.rng = gp_.accept_mode == kAcceptTargetSample ? &rng_draft_ : &rng_;
        req.keep = keep;
        k = k_prefix + dft_->draft(req, src_out_);
        drafts_.resize(k_prefix);
        for (DraftRow & row : src_out_.rows) drafts_.push_back(std::move(row));
        draft_ms = now_ms() - t0;
        stats_.t_draft_ms += draft_ms;
        cost_.observe_draft(draft_ms);
    }
    double pred_tokens = 1.0, pred_ms = adaptive ? cost_.verify_ms[0] : 0.0;
    if (adaptive && continued) {
        pred_tokens = expected_tokens(acc, k);
        pred_ms = cost_.verify_ms[k] + cost_.draft_ms + cost_.rollback_ms;
    } else if (adaptive && use_ctx && (int) cost_.verify_ms.size() > k) {
        pred_tokens = expected_tokens(ctx_acc_, k);
        pred_ms = cost_.verify_ms[k] + cost_.rollback_ms;
    } else if (adaptive && run_drafter) {
        pred_tokens = expected_tokens(acc, k);
        pred_ms = cost_.verify_ms[k] + cost_.draft_ms + (k > 0 ? cost_.rollback_ms : 0.0);
        gate_.observe_drafting(pred_tokens / pred_ms);
        // what a DFlash cycle adds, for continuing context drafts with the block
        constexpr double a = 0.3;
        dfl_tokens_ = dfl_tokens_ < 0.0 ? pred_tokens : (1.0 - a) * dfl_tokens_ + a * pred_tokens;
        dfl_k_ = dfl_k_ < 0.0 ? k : (1.0 - a) * dfl_k_ + a * k;
    }

    // verify [anchor, d1..dk] in one target pass (a recurrent target without native rollback
    // copies its state first)
    double rb_ms = 0;
    if (k > 0 && mem_->rollback() == Rollback::kCheckpoint) {
        t0 = now_ms();
        mem_->before_verify(P, k);
        rb_ms += now_ms() - t0;
    }
    t0 = now_ms();
    std::vector<int32_t> vt(k + 1);
    vt[0] = anchor;
    for (int i = 0; i < k; ++i) vt[i + 1] = drafts_[i].token;
    decode_target(vt.data(), k + 1, P, true, drafting);
    const double verify_ms = now_ms() - t0;
    stats_.t_target_ms += verify_ms;
    cost_.observe_verify(k + 1, verify_ms);

    // accept: row i sees the committed state advanced by d1..di (a clone; state_ is untouched)
    t0 = now_ms();
    SamplerState row_st = state_;
    int row_at = 0;  // drafts row_st has accepted
    auto advance_to = [&](int row) { while (row_at < row) row_st.accept(drafts_[row_at++].token); };
    AcceptResult ar;
    if (gp_.sampling.greedy()) {
        ar = accept_greedy(drafts_, k, [&](int row) {
            advance_to(row);
            return greedy_token(llama_get_logits_ith(ctx_tgt_, row), row_st);
        });
    } else if (gp_.accept_mode == kAcceptTargetSample) {
        // llama-server's rule (common_sampler_sample_and_accept_n): the target's own draw per
        // row, from rng_ exactly as the target alone would draw it; a draft counts when equal
        ar = accept_greedy(drafts_, k, [&](int row) {
            advance_to(row);
            return sample_row(row, row_st);
        });
    } else {
        const int fault = gp_.test_fault;
        if (fault == kFaultPenaltyWithDrafts) advance_to(k);
        ar = accept_sampled(drafts_, k, [&](int row, bool for_next) -> const std::vector<float> & {
            if (fault != kFaultPenaltyWithDrafts) advance_to(row);
            return row_probs(row, row_st, !(for_next && fault == kFaultBonusWithoutPenalty));
        }, rng_, fault);
        if (ar.next < 0) throw Error(kErrInternal, "no token is allowed here (the grammar and logit_bias ban every token)");
    }
    const int a = ar.n_accepted;
    // the context rows: drafts_[0, k_ctx_rows), the drafter's after them
    const int k_ctx_rows = continued ? k_prefix : use_ctx ? k : 0;
    if (run_drafter) {  // calibrate the drafter's confidence: drafts reached, accepted or not
        for (int i = k_ctx_rows; i < k && i <= a; ++i) calib_.observe(drafts_[i].conf, i < a);
    }
    if (use_ctx) {  // and each context source's acceptance by match length
        for (int i = 0; i < k_ctx_rows && i <= a; ++i) ctx_calib_.observe(ctx_src, ctx_match + i, i < a);
    }
    if (k_ctx_rows > 0) {
        stats_.src_cycles[ctx_src]++;
        stats_.src_drafted[ctx_src] += k_ctx_rows;
        stats_.src_accepted[ctx_src] += std::min(a, k_ctx_rows);
    }
    if (k > k_ctx_rows) {
        stats_.src_cycles[0]++;
        stats_.src_drafted[0] += k - k_ctx_rows;
        stats_.src_accepted[0] += std::max(0, a - k_ctx_rows);
    }
    if (continued && k > k_ctx_rows) stats_.n_continued++;
    stats_.n_cycles++;
    if ((int) stats_.k_hist.size() <= k) stats_.k_hist.resize(k + 1, 0);
    stats_.k_hist[k]++;
    stats_.n_drafted += k;
    stats_.n_accepted += a;
    if ((int) stats_.pos_reached.size() < k) {  // context drafts can run past the drafter's block
        stats_.pos_reached.resize(k, 0);
        stats_.pos_accepted.resize(k, 0);
    }
    for (int i = 0; i < k && i <= a; ++i) {
        stats_.pos_reached[i]++;
        if (i < a) stats_.pos_accepted[i]++;
    }
    const int64_t before = stats_.n_generated;
    for (int i = 0; i < a && !done_; ++i) commit(c, drafts_[i].token, true, llama_get_logits_ith(ctx_tgt_, i));
    if (!done_) commit(c, ar.next, false, llama_get_logits_ith(ctx_tgt_, a));
    stats_.n_committed_cycles += stats_.n_generated - before;
    stats_.t_sample_ms += now_ms() - t0;

    // the features of rows 0..a go to the drafter now when it drafted this cycle, else they wait
    // in pending_ and go in one batch when it drafts again (pending_ outlives the generation: the
    // next request's prompt cache reuses them like injected ones). Before the rollback: a
    // re-decode would overwrite this pass's features.
    const int fit = std::min(a + 1, n_ctx_dft_ - P);
    if (drafting && fit > 0 && n_dft_valid_ + n_pending_ == P) {
        t0 = now_ms();
        if (n_pending_ == 0 && run_drafter) {
            inject_rows(0, fit, P);
            n_dft_valid_ = P + fit;
        } else {
            add_pending(0, fit);
        }
        stats_.t_inject_ms += now_ms() - t0;
    }
    // roll back: the target keeps anchor + accepted drafts; the last committed token is the next
    // anchor. A checkpoint restore returns to P: anchor + accepted drafts are decoded again.
    n_past_ = P + a + 1;
    if (a < k && gp_.test_fault != kFaultNoRollback) {
        t0 = now_ms();
        const int redo = mem_->cut_after_verify(P, n_past_, P + k + 1);
        if (redo > 0) {
            decode_target(vt.data(), redo, P, false, false);
            stats_.n_redecoded += redo;
        }
        rb_ms += now_ms() - t0;
        stats_.n_rollbacks++;
    }
    stats_.t_rollback_ms += rb_ms;
    if (k > 0 && mem_->rollback() == Rollback::kCheckpoint) cost_.observe_rollback(rb_ms);
    if (adaptive) {
        stats_.predicted_tokens += pred_tokens;
        stats_.predicted_ms += pred_ms;
        stats_.measured_ms += now_ms() - t_cycle;
    }
    c.done = done_;
    stats_.t_total_ms = now_ms() - t_begin_;
    return c;
}

// llama-server's context shift (tools/server/server-context.cpp, pre_decode at 0c1e570): keep the
// first n_keep tokens (a BOS on top), drop n_discard after them, move the rest down by n_discard
// in the target's cache and the drafter's (its injected features: RoPE'd K/V shift the same way).
void Engine::shift_context() {
    int n_keep = gp_.n_keep < 0 ? n_prompt_ : gp_.n_keep;
    if (llama_vocab_get_add_bos(llama_model_get_vocab(model_tgt_))) n_keep += 1;
    n_keep = std::max(0, std::min(n_ctx_tgt_ - 4, n_keep));
    const int n_left = n_past_ - n_keep;
    int n_discard = gp_.n_discard > 0 ? gp_.n_discard : n_left / 2;
    n_discard = std::clamp(n_discard, 0, std::max(0, n_left - 1));
    if (n_discard == 0) return;
    llama_memory_t mem = llama_get_memory(ctx_tgt_);
    llama_memory_seq_rm(mem, 0, n_keep, n_keep + n_discard);
    llama_memory_seq_add(mem, 0, n_keep + n_discard, n_past_, -n_discard);
    if (dft_) {
        flush_pending();  // the waiting features go in first, then move with the rest
        llama_memory_t dmem = llama_get_memory(dft_->ctx());
        llama_memory_seq_rm(dmem, 0, n_keep, n_keep + n_discard);
        llama_memory_seq_add(dmem, 0, n_keep + n_discard, n_dft_valid_, -n_discard);
        if (n_dft_valid_ >= n_keep + n_discard) n_dft_valid_ -= n_discard;
        else if (n_dft_valid_ > n_keep) n_dft_valid_ = n_keep;
    }
    tokens_.erase(tokens_.begin() + n_keep, tokens_.begin() + n_keep + n_discard);
    n_past_ -= n_discard;
    n_prompt_ = std::max(0, n_prompt_ - std::max(0, std::min(n_discard, n_prompt_ - n_keep)));
    mem_->checkpoints().clear();  // their positions are gone
    stats_.n_ctx_shifts++;
}

// Context drafts for this cycle (context_drafter.h): each enabled source looks the context up;
// the one whose best k (by the cost model, or its whole draft without adaptation) promises the
// most tokens per millisecond fills drafts_ with point masses. Returns that k (0: none).
int Engine::context_drafts(int k_cap, bool adaptive, int & source, int & match_len, double & rate) {
    int best_k = 0;
    if (k_cap <= 0) return 0;
    std::vector<double> a;
    DraftRequest req;
    req.history = &tokens_;
    req.pos = n_past_;
    req.k_max = k_cap;
    req.ngram = &gp_.ngram;
    for (DraftSource * src : sources_) {
        if (src->runs_model() || !(gp_.spec_types & src->spec_bit())) continue;
        const int s = src->index();
        DraftResult & d = src_out_;
        if (src->draft(req, d) == 0) continue;
        // draft i is reached only when drafts 0..i-1 were accepted, extending the match by i: its
        // acceptance is that of a match of match_len + i tokens
        a.resize(d.rows.size());
        for (size_t i = 0; i < a.size(); ++i) a[i] = ctx_calib_.predict(s, d.match_len + (int) i);
        int k = (int) a.size();
        double r = expected_tokens(a, k);
        if (adaptive) k = choose_draft_length(cost_, a, k, 0.0, &r);
        if (k == 0 || (best_k > 0 && r <= rate)) continue;
        best_k = k;
        rate = r;
        source = s;
        match_len = d.match_len;
        ctx_acc_.assign(a.begin(), a.begin() + k);
        drafts_.resize(k);
        for (int i = 0; i < k; ++i) {
            drafts_[i] = std::move(d.rows[i]);  // a point mass: q = 1 on the drafted token
            drafts_[i].conf = (float) a[i];
        }
    }
    return best_k;
}

std::vector<int32_t> Engine::generate(const std::vector<int32_t> & prompt, const GenParams & gp,
                                      const std::function<bool(const Chunk &)> & on_chunk) {
    Chunk c = begin(prompt, gp);
    if (on_chunk && !on_chunk(c)) return gen_tokens_;
    while (!c.done) {
        c = step();
        if (on_chunk && !on_chunk(c)) break;
    }
    return gen_tokens_;
}

// ---------------------------------------------------------------------------------------------
// text helpers

std::vector<int32_t> Engine::tokenize(const std::string & text, bool add_special, bool parse_special) const {
    require_open();
    return tokenize_text(model_tgt_, text, add_special, parse_special);
}

std::string Engine::detokenize(const std::vector<int32_t> & tokens, bool special) const {
    require_open();
    const llama_vocab * v = llama_model_get_vocab(model_tgt_);
    std::string out(tokens.size() * 8 + 16, '\0');
    int n = llama_detokenize(v, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    if (n < 0) {
        out.resize(-n);
        n = llama_detokenize(v, tokens.data(), (int32_t) tokens.size(), out.data(), (int32_t) out.size(), false, special);
    }
    if (n < 0) throw Error(kErrInternal, "llama_detokenize failed");
    out.resize(n);
    return out;
}

Engine::ChatInfo Engine::chat_info() const {
    require_open();
    ChatInfo ci;
    const llama_vocab * v = llama_model_get_vocab(model_tgt_);
    if (const char * t = llama_model_chat_template(model_tgt_, nullptr)) { ci.has_template = true; ci.chat_template = t; }
    if (const char * t = llama_model_chat_template(model_tgt_, "tool_use")) { ci.has_tool_use = true; ci.tool_use_template = t; }
    auto piece = [v](llama_token tok) {
        if (tok == LLAMA_TOKEN_NULL || tok < 0) return std::string();
        std::string out(256, '\0');
        int n = llama_token_to_piece(v, tok, out.data(), (int32_t) out.size(), 0, true);
        if (n < 0) {
            out.resize(-n);
            n = llama_token_to_piece(v, tok, out.data(), (int32_t) out.size(), 0, true);
        }
        out.resize(std::max(n, 0));
        return out;
    };
    ci.bos = piece(llama_vocab_bos(v));
    ci.eos = piece(llama_vocab_eos(v));
    ci.add_bos = llama_vocab_get_add_bos(v);
    ci.add_eos = llama_vocab_get_add_eos(v);
    return ci;
}

// ---------------------------------------------------------------------------------------------
// parity hooks

std::vector<float> Engine::capture_features(const std::vector<int32_t> & tokens) {
    require_open();
    if (!dft_) throw Error(kErrUnsupported, "capture_features needs a drafter (it defines the target layers)");
    if (tokens.empty() || (int) tokens.size() > n_ctx_tgt_) throw std::invalid_argument("bad token count");
    forget_cache();
    const size_t n_enc = lids_.size() * (size_t) n_embd_;
    std::vector<float> out(tokens.size() * n_enc);
    const int n = (int) tokens.size();
    for (int off = 0; off < n; off += n_batch_tgt_) {
        const int m = std::min(n_batch_tgt_, n - off);
        decode_target(tokens.data() + off, m, off, false, true);
        cap_->gather(ctx_tgt_, 0, m, feat_);
        std::memcpy(out.data() + (size_t) off * n_enc, feat_.data(), feat_.size() * sizeof(float));
    }
    forget_cache();
    return out;
}

DraftProbe Engine::draft_from_features(const std::vector<float> & features, int n_rows, int32_t anchor) {
    require_open();
    if (!dft_) throw Error(kErrUnsupported, "draft_from_features needs a drafter");
    const size_t n_enc = lids_.size() * (size_t) n_embd_;
    if (n_rows < 1 || features.size() != (size_t) n_rows * n_enc) throw std::invalid_argument("features must be [n_rows x n_lids*n_embd]");
    if (n_rows + block_size_ > n_ctx_dft_) throw Error(kErrContextFull, "features do not fit the drafter context");
    if (anchor < 0 || anchor >= n_vocab_) throw std::invalid_argument("anchor outside the vocabulary");
    forget_cache();
    dft_->clear();
    dft_->inject(features.data(), n_rows, (int) n_enc, 0);
    dft_->run_block(anchor, n_rows);
    DraftProbe pr;
    pr.n_rows = block_size_;
    pr.n_vocab = n_vocab_;
    pr.n_embd = n_embd_;
    pr.logits.resize((size_t) block_size_ * n_vocab_);
    for (int i = 0; i < block_size_; ++i) {
        std::memcpy(pr.logits.data() + (size_t) i * n_vocab_, llama_get_logits_ith(dft_->ctx(), i), n_vocab_ * sizeof(float));
    }
    if (top_k_sel_ > 0) {
        const float * lat = llama_get_embeddings_nextn(dft_->ctx());
        pr.lattice.assign(lat, lat + (size_t) block_size_ * n_embd_);
        const int K = top_k_sel_;
        int pred = 0;
        for (int i = 1; i < block_size_; ++i) {
            const float * row = lat + (size_t) i * n_embd_;
            const int j = argmax(row + K + (size_t) pred * K, K);
            pr.greedy.push_back((int32_t) row[j]);
            pred = j;
        }
    } else {
        for (int i = 1; i < block_size_; ++i) pr.greedy.push_back(argmax(pr.logits.data() + (size_t) i * n_vocab_, n_vocab_));
    }
    dft_->clear();
    return pr;
}

std::vector<float> Engine::target_logits(const std::vector<int32_t> & tokens) {
    require_open();
    if (tokens.empty() || (int) tokens.size() > n_ctx_tgt_) throw std::invalid_argument("bad token count");
    forget_cache();
    std::vector<float> out(tokens.size() * (size_t) n_vocab_);
    const int n = (int) tokens.size();
    for (int off = 0; off < n; off += n_batch_tgt_) {
        const int m = std::min(n_batch_tgt_, n - off);
        decode_target(tokens.data() + off, m, off, true, false);
        for (int i = 0; i < m; ++i) {
            std::memcpy(out.data() + (size_t) (off + i) * n_vocab_, llama_get_logits_ith(ctx_tgt_, i), n_vocab_ * sizeof(float));
        }
    }
    forget_cache();
    return out;
}

}  // namespace dflash2
