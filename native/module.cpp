// Thin nanobind binding over driver.cpp: type conversion, GIL release and error mapping only.
//
// Errors: dflash2::Error becomes the Python exception class registered by
// dflash2_gguf._native_loader (dflash2_gguf.errors.DFlashError and its subclasses, built by a
// factory(message, code, rc)); std::invalid_argument becomes ValueError (nanobind default).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "capture_batch.h"
#include "driver.h"

#include <atomic>
#include <cstdio>
#include "llama_ext_pinned.h"

namespace nb = nanobind;
using namespace nb::literals;

// IEEE float16 bits, exposed to numpy as float16 (nanobind's dtype_traits customisation point).
struct Float16 {
    uint16_t bits;
};
namespace nanobind::detail {
template <> struct dtype_traits<Float16> {
    static constexpr dlpack::dtype value{(uint8_t) dlpack::dtype_code::Float, 16, 1};
    static constexpr auto name = const_name("float16");
};
}  // namespace nanobind::detail

namespace {

// llama.cpp / ggml log filter (process-wide, as llama_log_set is). Default: errors only, so a
// library user does not get thousands of loader lines on stderr; `verbose` shows everything.
std::atomic<int> g_log_min_level{GGML_LOG_LEVEL_ERROR};
std::atomic<bool> g_log_last_shown{false};

void log_filter(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_CONT) {  // continuation of the previous message
        if (g_log_last_shown) std::fputs(text, stderr);
        return;
    }
    const bool show = (int) level >= g_log_min_level.load();
    g_log_last_shown = show;
    if (show) std::fputs(text, stderr);
}

PyObject * g_error_factory = nullptr;  // callable(message, code, rc) -> exception instance

using F32Array = nb::ndarray<nb::numpy, float>;
using I32Array = nb::ndarray<nb::numpy, int32_t>;

template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T> && v, std::initializer_list<size_t> shape) {
    auto * heap = new std::vector<T>(std::move(v));
    nb::capsule owner(heap, [](void * p) noexcept { delete static_cast<std::vector<T> *>(p); });
    return nb::ndarray<nb::numpy, T>(heap->data(), shape, owner);
}

nb::dict stats_dict(const dflash2::Stats & s) {
    nb::dict d;
    d["n_prompt"] = s.n_prompt;
    d["n_cached"] = s.n_cached;
    d["n_cache_restored"] = s.n_cache_restored;
    d["n_generated"] = s.n_generated;
    d["n_cycles"] = s.n_cycles;
    d["n_committed_cycles"] = s.n_committed_cycles;
    d["n_drafted"] = s.n_drafted;
    d["n_accepted"] = s.n_accepted;
    d["pos_reached"] = s.pos_reached;
    d["pos_accepted"] = s.pos_accepted;
    d["t_prefill_ms"] = s.t_prefill_ms;
    d["t_target_ms"] = s.t_target_ms;
    d["t_draft_ms"] = s.t_draft_ms;
    d["t_inject_ms"] = s.t_inject_ms;
    d["t_sample_ms"] = s.t_sample_ms;
    d["t_total_ms"] = s.t_total_ms;
    d["stop_reason"] = s.stop_reason;
    d["k_hist"] = s.k_hist;
    d["n_drafter_skipped"] = s.n_drafter_skipped;
    d["predicted_tokens"] = s.predicted_tokens;
    d["predicted_ms"] = s.predicted_ms;
    d["measured_ms"] = s.measured_ms;
    d["rollback"] = s.rollback;
    d["n_rollbacks"] = s.n_rollbacks;
    d["n_redecoded"] = s.n_redecoded;
    d["t_rollback_ms"] = s.t_rollback_ms;
    d["n_checkpoints"] = s.n_checkpoints;
    d["n_ctx_shifts"] = s.n_ctx_shifts;
    d["n_continued"] = s.n_continued;
    nb::dict src;
    for (int i = 0; i < dflash2::kNumSources; ++i) {
        nb::dict e;
        e["cycles"] = s.src_cycles[i];
        e["drafted"] = s.src_drafted[i];
        e["accepted"] = s.src_accepted[i];
        src[dflash2::source_name(i)] = e;
    }
    d["sources"] = src;
    return d;
}

// (key, prompt ids, response ids, features float16 [n_prompt + n_response, width], stop_reason)
nb::tuple captured_tuple(dflash2::CapturedSequence && c, size_t width) {
    const size_t n = c.prompt.size() + c.response.size();
    auto * heap = new std::vector<uint16_t>(std::move(c.features));
    nb::capsule owner(heap, [](void * p) noexcept { delete static_cast<std::vector<uint16_t> *>(p); });
    nb::ndarray<nb::numpy, Float16> feats(reinterpret_cast<Float16 *>(heap->data()), {n, width}, owner);
    return nb::make_tuple(c.key, c.prompt, c.response, feats, c.stop_reason);
}

// (tokens, from_draft, done, logprobs); logprobs: per token (logprob, [(id, logprob), ...]) or
// an empty list when n_probs == 0.
nb::tuple chunk_tuple(const dflash2::Chunk & c) {
    nb::list lp;
    for (const auto & t : c.logprobs) lp.append(nb::make_tuple(t.logprob, t.top));
    return nb::make_tuple(c.tokens, c.from_draft, c.done, lp);
}

}  // namespace

NB_MODULE(_native, m) {
    m.doc() = "dflash2_gguf native driver (private; use the dflash2_gguf package)";
    m.attr("PINNED_LLAMA_CPP_COMMIT") = dflash2::kPinnedLlamaCppCommit;
    m.def("llama_version", []() { return std::string(llama_version()); },
          "llama_version() of the libllama this module is linked to.");
    m.def("check_libllama", &dflash2::check_libllama,
          "Empty string if the loaded libllama is the pinned build, else the reason it is not.");
    m.def("set_log_level", [](int min_level) {
        g_log_min_level = min_level;
        llama_log_set(log_filter, nullptr);
    }, "min_level"_a,
    "Route llama.cpp/ggml logs through a filter that prints messages of ggml_log_level >= "
    "min_level to stderr (1 debug, 2 info, 3 warn, 4 error). Process-wide.");
    m.def("_set_error_factory", [](nb::object f) {
        Py_XDECREF(g_error_factory);
        g_error_factory = f.release().ptr();
    }, "Register callable(message, code, rc) -> exception used for driver errors.");

    nb::register_exception_translator([](const std::exception_ptr & p, void *) {
        try {
            std::rethrow_exception(p);
        } catch (const dflash2::Error & e) {
            if (!g_error_factory) {
                PyErr_SetString(PyExc_RuntimeError, e.what());
                return;
            }
            PyObject * exc = PyObject_CallFunction(g_error_factory, "sii", e.what(), e.code(), e.rc());
            if (!exc) return;  // the factory raised: keep its error
            PyErr_SetObject((PyObject *) Py_TYPE(exc), exc);
            Py_DECREF(exc);
        }
    });

    nb::class_<dflash2::EngineOptions>(m, "EngineOptions")
        .def(nb::init<>())
        .def_rw("target_path", &dflash2::EngineOptions::target_path)
        .def_rw("drafter_path", &dflash2::EngineOptions::drafter_path)
        .def_rw("n_ctx", &dflash2::EngineOptions::n_ctx)
        .def_rw("n_ctx_draft", &dflash2::EngineOptions::n_ctx_draft)
        .def_rw("n_batch", &dflash2::EngineOptions::n_batch)
        .def_rw("n_threads", &dflash2::EngineOptions::n_threads)
        .def_rw("n_threads_draft", &dflash2::EngineOptions::n_threads_draft)
        .def_rw("n_gpu_layers", &dflash2::EngineOptions::n_gpu_layers)
        .def_rw("n_gpu_layers_draft", &dflash2::EngineOptions::n_gpu_layers_draft)
        .def_rw("flash_attn", &dflash2::EngineOptions::flash_attn)
        .def_rw("kv_f32_draft", &dflash2::EngineOptions::kv_f32_draft)
        .def_rw("repack", &dflash2::EngineOptions::repack)
        .def_rw("capture", &dflash2::EngineOptions::capture)
        .def_rw("swa_full", &dflash2::EngineOptions::swa_full)
        .def_rw("context_draft_max", &dflash2::EngineOptions::context_draft_max)
        .def_rw("cache_ram_mib", &dflash2::EngineOptions::cache_ram_mib);

    // One binding line per field, generated from the one list of sampling options (sampling.h).
    auto so = nb::class_<dflash2::SamplingOptions>(m, "SamplingOptions").def(nb::init<>());
#define DFLASH2_BIND_FIELD(type, name) so.def_rw(#name, &dflash2::SamplingOptions::name);
    DFLASH2_SAMPLING_FIELDS(DFLASH2_BIND_FIELD)
#undef DFLASH2_BIND_FIELD
    nb::list sampling_fields;
#define DFLASH2_FIELD_NAME(type, name) sampling_fields.append(#name);
    DFLASH2_SAMPLING_FIELDS(DFLASH2_FIELD_NAME)
#undef DFLASH2_FIELD_NAME
    m.attr("SAMPLING_FIELDS") = nb::tuple(sampling_fields);

    nb::class_<dflash2::NgramParams>(m, "NgramParams")
        .def(nb::init<>())
        .def_rw("simple_size_n", &dflash2::NgramParams::simple_size_n)
        .def_rw("simple_size_m", &dflash2::NgramParams::simple_size_m)
        .def_rw("mod_n_match", &dflash2::NgramParams::mod_n_match)
        .def_rw("mod_n_max", &dflash2::NgramParams::mod_n_max)
        .def_rw("mod_n_min", &dflash2::NgramParams::mod_n_min);
    m.attr("SPEC_DFLASH") = (int) dflash2::kSpecDflash;
    m.attr("SPEC_NGRAM_SIMPLE") = (int) dflash2::kSpecNgramSimple;
    m.attr("SPEC_NGRAM_MOD") = (int) dflash2::kSpecNgramMod;

    nb::class_<dflash2::GenParams>(m, "GenParams")
        .def(nb::init<>())
        .def_rw("spec_types", &dflash2::GenParams::spec_types)
        .def_rw("accept_mode", &dflash2::GenParams::accept_mode)
        .def_rw("context_shift", &dflash2::GenParams::context_shift)
        .def_rw("n_keep", &dflash2::GenParams::n_keep)
        .def_rw("n_discard", &dflash2::GenParams::n_discard)
        .def_rw("ngram", &dflash2::GenParams::ngram)
        .def_rw("n_predict", &dflash2::GenParams::n_predict)
        .def_rw("sampling", &dflash2::GenParams::sampling)
        .def_rw("n_draft_max", &dflash2::GenParams::n_draft_max)
        .def_rw("p_min", &dflash2::GenParams::p_min)
        .def_rw("use_drafter", &dflash2::GenParams::use_drafter)
        .def_rw("ignore_eog", &dflash2::GenParams::ignore_eog)
        .def_rw("cache_prompt", &dflash2::GenParams::cache_prompt)
        .def_rw("adaptive", &dflash2::GenParams::adaptive)
        .def_rw("n_draft_min", &dflash2::GenParams::n_draft_min)
        .def_rw("stop", &dflash2::GenParams::stop)
        .def_rw("test_fault", &dflash2::GenParams::test_fault);

    nb::class_<dflash2::CostModel>(m, "CostModel")
        .def(nb::init<>())
        .def_rw("verify_ms", &dflash2::CostModel::verify_ms)
        .def_rw("draft_ms", &dflash2::CostModel::draft_ms)
        .def_rw("rollback_ms", &dflash2::CostModel::rollback_ms)
        .def_rw("fixed", &dflash2::CostModel::fixed)
        .def_prop_ro("valid", &dflash2::CostModel::valid);
    m.def("choose_draft_length", [](const dflash2::CostModel & c, const std::vector<double> & a, int k_max, double draft_ms) {
        double rate = 0;
        const int k = dflash2::choose_draft_length(c, a, k_max, draft_ms, &rate);
        return nb::make_tuple(k, rate);
    }, "cost"_a, "accept"_a, "k_max"_a, "draft_ms"_a = 0.0,
    "(k, tokens per ms): the k in 0..k_max maximising E(k) / (verify_ms[k] + draft_ms if k > 0), "
    "E(k) = 1 + sum_i prod_{j<=i} accept[j] (native/draft_policy.h).");

    auto check_source = [](int source) {
        if (source < 0 || source >= dflash2::kNumSources) {
            throw std::invalid_argument("source must be 0.." + std::to_string(dflash2::kNumSources - 1) + ", got " +
                                        std::to_string(source));
        }
    };
    nb::class_<dflash2::ContextCalibration>(m, "ContextCalibration",
        "P(a context draft is accepted | reached) by source index (1 ngram-simple, 2 ngram-mod) and match "
        "length (native/context_drafter.h).")
        .def(nb::init<>())
        .def("predict", [check_source](const dflash2::ContextCalibration & c, int source, int match_len) {
            check_source(source);
            return c.predict(source, match_len);
        }, "source"_a, "match_len"_a)
        .def("observe", [check_source](dflash2::ContextCalibration & c, int source, int match_len, bool accepted) {
            check_source(source);
            c.observe(source, match_len, accepted);
        }, "source"_a, "match_len"_a, "accepted"_a)
        .def("new_request", &dflash2::ContextCalibration::new_request);

    nb::class_<dflash2::BatchCaptureOptions>(m, "BatchCaptureOptions")
        .def(nb::init<>())
        .def_rw("target_path", &dflash2::BatchCaptureOptions::target_path)
        .def_rw("target_layer_ids", &dflash2::BatchCaptureOptions::target_layer_ids)
        .def_rw("n_parallel", &dflash2::BatchCaptureOptions::n_parallel)
        .def_rw("n_ctx_seq", &dflash2::BatchCaptureOptions::n_ctx_seq)
        .def_rw("n_batch", &dflash2::BatchCaptureOptions::n_batch)
        .def_rw("n_ubatch", &dflash2::BatchCaptureOptions::n_ubatch)
        .def_rw("n_threads", &dflash2::BatchCaptureOptions::n_threads)
        .def_rw("n_gpu_layers", &dflash2::BatchCaptureOptions::n_gpu_layers)
        .def_rw("flash_attn", &dflash2::BatchCaptureOptions::flash_attn)
        .def_rw("repack", &dflash2::BatchCaptureOptions::repack)
        .def_rw("capture", &dflash2::BatchCaptureOptions::capture);

    nb::class_<dflash2::BatchCapture>(m, "BatchCapture")
        .def(nb::init<const dflash2::BatchCaptureOptions &>(), "options"_a, nb::call_guard<nb::gil_scoped_release>())
        .def("close", &dflash2::BatchCapture::close, nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("closed", &dflash2::BatchCapture::closed)
        .def_prop_ro("n_vocab", &dflash2::BatchCapture::n_vocab)
        .def_prop_ro("n_embd", &dflash2::BatchCapture::n_embd)
        .def_prop_ro("n_layer", &dflash2::BatchCapture::n_layer)
        .def_prop_ro("n_parallel", &dflash2::BatchCapture::n_parallel)
        .def_prop_ro("n_ctx_seq", &dflash2::BatchCapture::n_ctx_seq)
        .def_prop_ro("width", &dflash2::BatchCapture::width)
        .def_prop_ro("capture_path", &dflash2::BatchCapture::capture_path)
        .def_prop_ro("target_layer_ids", &dflash2::BatchCapture::target_layer_ids)
        .def("submit", &dflash2::BatchCapture::submit, "key"_a, "prompt"_a, "max_new_tokens"_a)
        .def("step", [](dflash2::BatchCapture & c) {
            std::vector<dflash2::CapturedSequence> done;
            { nb::gil_scoped_release r; done = c.step(); }
            nb::list out;
            for (auto & s : done) out.append(captured_tuple(std::move(s), (size_t) c.width()));
            return out;
        }, "One llama_decode; the sequences finished in it as (key, prompt, response, features "
           "float16 [n_prompt + n_response, width], stop_reason) (native/capture_batch.h).")
        .def_prop_ro("idle", &dflash2::BatchCapture::idle)
        .def("clear", &dflash2::BatchCapture::clear)
        .def("stats", [](const dflash2::BatchCapture & c) {
            const auto & s = c.stats();
            nb::dict d;
            d["n_prompt"] = s.n_prompt;
            d["n_generated"] = s.n_generated;
            d["n_decode"] = s.n_decode;
            d["t_decode_ms"] = s.t_decode_ms;
            d["t_total_ms"] = s.t_total_ms;
            return d;
        })
        .def("reset_stats", &dflash2::BatchCapture::reset_stats)
        .def("tokenize", &dflash2::BatchCapture::tokenize, "text"_a, "add_special"_a, "parse_special"_a)
        .def("is_eog", &dflash2::BatchCapture::is_eog);

    nb::class_<dflash2::Engine>(m, "Engine")
        .def(nb::init<const dflash2::EngineOptions &>(), "options"_a, nb::call_guard<nb::gil_scoped_release>())
        .def("close", &dflash2::Engine::close, nb::call_guard<nb::gil_scoped_release>())
        .def_prop_ro("closed", &dflash2::Engine::closed)
        .def_prop_ro("has_drafter", &dflash2::Engine::has_drafter)
        .def_prop_ro("block_size", &dflash2::Engine::block_size)
        .def_prop_ro("selector_top_k", &dflash2::Engine::selector_top_k)
        .def_prop_ro("n_vocab", &dflash2::Engine::n_vocab)
        .def_prop_ro("n_embd", &dflash2::Engine::n_embd)
        .def_prop_ro("n_ctx", &dflash2::Engine::n_ctx)
        .def_prop_ro("mask_token", &dflash2::Engine::mask_token)
        .def_prop_ro("capture_path", &dflash2::Engine::capture_path)
        .def_prop_ro("rollback_mode", &dflash2::Engine::rollback_mode)
        .def_prop_ro("recurrent_target", &dflash2::Engine::recurrent_target)
        .def_prop_ro("n_swa", &dflash2::Engine::n_swa)
        .def_prop_ro("recurrent_state_bytes", &dflash2::Engine::recurrent_state_bytes)
        .def_prop_ro("target_arch", &dflash2::Engine::target_arch)
        .def_prop_ro("target_layers", &dflash2::Engine::target_layers)
        .def_prop_ro("n_cached_tokens", &dflash2::Engine::n_cached_tokens)
        .def("measure_costs", &dflash2::Engine::measure_costs, "reps"_a = 3, nb::call_guard<nb::gil_scoped_release>())
        .def("set_cost_model", &dflash2::Engine::set_cost_model, "cost"_a)
        .def("cost_model", &dflash2::Engine::cost_model)
        .def("cost_rows", &dflash2::Engine::cost_rows)
        .def("policy_state", [](dflash2::Engine & e) {
            nb::dict d;
            d["reached"] = e.calibration().reached();
            d["accepted"] = e.calibration().accepted();
            d["gate_rate"] = e.gate().rate();
            d["gate_interval"] = e.gate().interval();
            return d;
        }, "The adaptive policy's learnt state: calibration counts per confidence bin (reached, "
           "accepted), the gate's drafting rate (tokens/ms, -1 = none) and probe interval (cycles).")
        .def("set_policy_state", [](dflash2::Engine & e, const std::vector<double> & reached,
                                    const std::vector<double> & accepted, double gate_rate, int gate_interval) {
            e.calibration().set(reached, accepted);
            e.gate().set(gate_rate, gate_interval);
        }, "reached"_a, "accepted"_a, "gate_rate"_a, "gate_interval"_a,
        "Restore policy_state() (counts scaled down to at most 50 reached per bin; raises ValueError "
        "unless 10 bins each).")
        .def("prompt_cache_info", [](const dflash2::Engine & e) {
            nb::dict d;
            const auto * c = e.prompt_cache();
            d["entries"] = c ? c->size() : 0;
            d["bytes"] = c ? c->bytes() : 0;
            d["budget"] = c ? c->budget() : 0;
            return d;
        }, "RAM prompt cache: saved entries, their bytes and the byte budget.")
        .def("begin", [](dflash2::Engine & e, const std::vector<int32_t> & prompt, const dflash2::GenParams & gp) {
            dflash2::Chunk c;
            { nb::gil_scoped_release r; c = e.begin(prompt, gp); }
            return chunk_tuple(c);
        }, "prompt"_a, "params"_a)
        .def("step", [](dflash2::Engine & e) {
            dflash2::Chunk c;
            { nb::gil_scoped_release r; c = e.step(); }
            return chunk_tuple(c);
        })
        .def("generate", [](dflash2::Engine & e, const std::vector<int32_t> & prompt, const dflash2::GenParams & gp,
                            nb::object on_chunk) {
            std::vector<int32_t> out;
            if (on_chunk.is_none()) {
                nb::gil_scoped_release r;
                out = e.generate(prompt, gp, nullptr);
            } else {
                std::function<bool(const dflash2::Chunk &)> cb = [&on_chunk](const dflash2::Chunk & c) {
                    nb::gil_scoped_acquire a;
                    return nb::cast<bool>(on_chunk(chunk_tuple(c)));
                };
                nb::gil_scoped_release r;
                out = e.generate(prompt, gp, cb);
            }
            return out;
        }, "prompt"_a, "params"_a, "on_chunk"_a = nb::none())
        .def("stats", [](const dflash2::Engine & e) { return stats_dict(e.stats()); })
        .def("from_draft", [](const dflash2::Engine & e) {
            const auto & v = e.from_draft();
            return std::vector<bool>(v.begin(), v.end());
        })
        .def("tokenize", &dflash2::Engine::tokenize, "text"_a, "add_special"_a, "parse_special"_a)
        .def("detokenize", [](const dflash2::Engine & e, const std::vector<int32_t> & t, bool special) {
            const std::string s = e.detokenize(t, special);
            return nb::bytes(s.data(), s.size());
        }, "tokens"_a, "special"_a = false)
        .def("chat_info", [](const dflash2::Engine & e) {
            // {"chat_template": str | None, "tool_use_template": str | None, "bos": bytes, "eos": bytes,
            //  "add_bos": bool, "add_eos": bool}: what common_chat_templates_init reads
            const auto ci = e.chat_info();
            nb::dict d;
            d["chat_template"] = ci.has_template ? nb::object(nb::str(ci.chat_template.c_str())) : nb::none();
            d["tool_use_template"] = ci.has_tool_use ? nb::object(nb::str(ci.tool_use_template.c_str())) : nb::none();
            d["bos"] = nb::bytes(ci.bos.data(), ci.bos.size());
            d["eos"] = nb::bytes(ci.eos.data(), ci.eos.size());
            d["add_bos"] = ci.add_bos;
            d["add_eos"] = ci.add_eos;
            return d;
        })
        .def("is_eog", &dflash2::Engine::is_eog)
        .def("capture_features", [](dflash2::Engine & e, const std::vector<int32_t> & tokens) {
            std::vector<float> f;
            { nb::gil_scoped_release r; f = e.capture_features(tokens); }
            const size_t n = tokens.size(), cols = f.size() / n;
            return to_numpy(std::move(f), {n, cols});
        }, "tokens"_a)
        .def("target_logits", [](dflash2::Engine & e, const std::vector<int32_t> & tokens) {
            std::vector<float> f;
            { nb::gil_scoped_release r; f = e.target_logits(tokens); }
            const size_t n = tokens.size();
            return to_numpy(std::move(f), {n, (size_t) e.n_vocab()});
        }, "tokens"_a)
        .def("draft_from_features", [](dflash2::Engine & e, nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu> feats,
                                       int32_t anchor) {
            std::vector<float> f(feats.data(), feats.data() + feats.size());
            const int n_rows = (int) feats.shape(0);
            dflash2::DraftProbe p;
            { nb::gil_scoped_release r; p = e.draft_from_features(f, n_rows, anchor); }
            const size_t R = p.n_rows, V = p.n_vocab, E = p.n_embd;
            const bool has_lat = !p.lattice.empty();
            nb::object lat = has_lat ? nb::cast(to_numpy(std::move(p.lattice), {R, E})) : nb::none();
            return nb::make_tuple(to_numpy(std::move(p.logits), {R, V}), lat, to_numpy(std::move(p.greedy), {R - 1}));
        }, "features"_a, "anchor"_a);
}
