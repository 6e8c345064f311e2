// Pairing and validation (see pairing.h).
#include "pairing.h"

#include "error.h"
#include "gguf.h"
#include "llama.h"
#include "llama_ext_pinned.h"

#include <atomic>
#include <cstdio>
#include <cstring>

namespace dflash2 {

// Target architectures whose graph records layer inputs (res->t_layer_inp[il]) at 0c1e570:
// the model classes in src/models/*.cpp that assign t_layer_inp, mapped to their arch names in
// src/llama-model.cpp / src/llama-arch.cpp. Any other architecture ABORTS the process inside
// libllama when layer-input extraction is enabled, so it gets the cb_eval path instead.
const std::set<std::string> & layer_inp_archs() {
    static const std::set<std::string> s = {
        "llama", "qwen3", "qwen3moe", "qwen35", "qwen35moe", "qwen3next", "qwen4exp", "lfm2",
        "muse-glimmer", "gpt-oss", "deepseek4", "minimax-01", "minimax-m2", "bailingmoe3",
        "nemotron_h", "nanbeige", "hunyuan_vl", "mimo2", "gemma4",
    };
    return s;
}

std::string meta_str(const llama_model * m, const char * key) {
    char buf[512];
    const int32_t n = llama_model_meta_val_str(m, key, buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

std::vector<int32_t> tokenize_text(const llama_model * m, const std::string & text, bool add_special, bool parse_special) {
    const llama_vocab * v = llama_model_get_vocab(m);
    std::vector<int32_t> out(text.size() + 8);
    int n;
    try {  // libllama throws std::out_of_range for vocabularies without byte-fallback tokens
        n = llama_tokenize(v, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
        if (n < 0) {
            out.resize(-n);
            n = llama_tokenize(v, text.data(), (int32_t) text.size(), out.data(), (int32_t) out.size(), add_special, parse_special);
        }
    } catch (const std::exception & e) {
        throw std::invalid_argument(std::string("the target's tokenizer cannot encode this text: ") + e.what());
    }
    if (n < 0) throw Error(kErrInternal, "llama_tokenize failed");
    out.resize(n);
    return out;
}

namespace {

// True when the CPU backend of this libllama build offers llama.cpp's AMX buffer type (built with
// AMX on a CPU that has it). Its matrix kernels crash at the first decode (SIGSEGV in
// ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824; seen here on a Sapphire Rapids-class Xeon
// with the SmolLM2 Q4_1 target), and weights go to that buffer type only with repacking on
// (use_extra_bufts; src/llama-model.cpp, make_cpu_buft_list).
bool cpu_offers_amx_buffer_type() {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) return false;
    auto get_extra_bufts = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(cpu), "ggml_backend_dev_get_extra_bufts");
    if (!get_extra_bufts) return false;
    for (ggml_backend_buffer_type_t * b = get_extra_bufts(cpu); b && *b; ++b) {
        if (std::strcmp(ggml_backend_buft_name(*b), "AMX") == 0) return true;
    }
    return false;
}

}  // namespace

llama_model * load_gguf(const std::string & path, int n_gpu_layers, bool repack, const char * role) {
    static const bool amx = cpu_offers_amx_buffer_type();
    if (repack && amx) {
        static std::atomic<bool> warned{false};
        if (!warned.exchange(true)) {
            std::fprintf(stderr,
                "[dflash2-gguf] this llama.cpp build has AMX kernels, which crash at the first decode "
                "(ggml-org/llama.cpp#20824): weights load without repacking (--no-repack). For repacked "
                "weights, rebuild llama-cpp-python without them: bash scripts/setup.sh\n");
        }
        repack = false;
    }
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = n_gpu_layers;
    mp.use_extra_bufts = repack;
    llama_model * m = llama_model_load_from_file(path.c_str(), mp);
    if (!m) throw Error(kErrLoad, std::string("failed to load ") + role + " GGUF '" + path + "'");
    return m;
}

namespace {

int64_t gguf_int(const gguf_context * g, const char * key, int64_t dflt) {
    const int64_t id = gguf_find_key(g, key);
    if (id < 0) return dflt;
    switch (gguf_get_kv_type(g, id)) {
        case GGUF_TYPE_UINT8:  return gguf_get_val_u8(g, id);
        case GGUF_TYPE_INT8:   return gguf_get_val_i8(g, id);
        case GGUF_TYPE_UINT16: return gguf_get_val_u16(g, id);
        case GGUF_TYPE_INT16:  return gguf_get_val_i16(g, id);
        case GGUF_TYPE_UINT32: return gguf_get_val_u32(g, id);
        case GGUF_TYPE_INT32:  return gguf_get_val_i32(g, id);
        case GGUF_TYPE_UINT64: return (int64_t) gguf_get_val_u64(g, id);
        case GGUF_TYPE_INT64:  return gguf_get_val_i64(g, id);
        default: return dflt;
    }
}

}  // namespace

DrafterMeta read_drafter_meta(const std::string & path) {
    gguf_init_params ip = {/*no_alloc*/ true, /*ctx*/ nullptr};
    gguf_context * g = gguf_init_from_file(path.c_str(), ip);
    if (!g) throw Error(kErrLoad, "cannot read drafter GGUF '" + path + "' (missing or not a GGUF file)");
    DrafterMeta m;
    const int64_t ia = gguf_find_key(g, "general.architecture");
    if (ia >= 0 && gguf_get_kv_type(g, ia) == GGUF_TYPE_STRING) m.arch = gguf_get_val_str(g, ia);
    m.n_embd     = gguf_int(g, "dflash.embedding_length", -1);
    m.block_size = gguf_int(g, "dflash.block_size", -1);
    m.top_k      = gguf_int(g, "dflash.selector_top_k", 0);
    const int64_t it = gguf_find_key(g, "tokenizer.ggml.tokens");
    if (it >= 0 && gguf_get_kv_type(g, it) == GGUF_TYPE_ARRAY) m.n_vocab = (int64_t) gguf_get_arr_n(g, it);
    const int64_t il = gguf_find_key(g, "dflash.target_layers");
    if (il >= 0 && gguf_get_kv_type(g, il) == GGUF_TYPE_ARRAY) {
        const size_t n = gguf_get_arr_n(g, il);
        const gguf_type t = gguf_get_arr_type(g, il);
        const void * d = gguf_get_arr_data(g, il);
        for (size_t i = 0; i < n; ++i) {
            if (t == GGUF_TYPE_INT32) m.target_layers.push_back(((const int32_t *) d)[i]);
            else if (t == GGUF_TYPE_UINT32) m.target_layers.push_back((int32_t) ((const uint32_t *) d)[i]);
            else if (t == GGUF_TYPE_INT64) m.target_layers.push_back((int32_t) ((const int64_t *) d)[i]);
        }
    }
    gguf_free(g);
    return m;
}


std::string validate_pairing(const DrafterMeta & dm, const std::string & drafter_path, const llama_model * target,
                             const std::string & capture) {
    if (dm.arch != "dflash") {
        throw Error(kErrIncompatible, "drafter '" + drafter_path + "' has general.architecture '" + dm.arch +
                                          "', expected 'dflash'");
    }
    const std::string arch = meta_str(target, "general.architecture");
    const int64_t n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(target));
    const int64_t n_embd = llama_model_n_embd(target);
    const int64_t n_layer = llama_model_n_layer(target);
    if (dm.n_vocab != n_vocab) {
        throw Error(kErrIncompatible, "vocabulary mismatch: drafter has " + std::to_string(dm.n_vocab) +
            " tokens, target has " + std::to_string(n_vocab));
    }
    if (dm.n_embd != n_embd) {
        throw Error(kErrIncompatible, "hidden size mismatch: drafter dflash.embedding_length = " +
            std::to_string(dm.n_embd) + ", target hidden size = " + std::to_string(n_embd));
    }
    if (dm.target_layers.empty()) {
        throw Error(kErrIncompatible, "drafter has no dflash.target_layers");
    }
    for (int32_t lid : dm.target_layers) {
        // lid = HF layer id + 1 = the target's layer-input index; the last layer's output
        // (lid == n_layer) is neither recorded as a layer input nor unpruned in cb_eval.
        if (lid < 1 || lid >= n_layer) {
            throw Error(kErrIncompatible, "drafter target layer (HF id " + std::to_string(lid - 1) +
                ", GGUF value " + std::to_string(lid) + ") is outside the target's usable layers: HF ids 0.." +
                std::to_string(n_layer - 2) + " for a " + std::to_string(n_layer) + "-layer target");
        }
    }
    if (dm.top_k > 0 && dm.n_embd < dm.top_k * (dm.top_k + 1)) {
        throw Error(kErrIncompatible, "DFlash 2 drafter too narrow: hidden size " + std::to_string(dm.n_embd) +
            " < selector_top_k*(selector_top_k+1) = " + std::to_string(dm.top_k * (dm.top_k + 1)) +
            " (the selector lattice is packed into the hidden-size output rows)");
    }
    if (dm.top_k > n_vocab) throw Error(kErrIncompatible, "selector_top_k exceeds the vocabulary");
    if (dm.block_size < 2) throw Error(kErrIncompatible, "drafter has no usable dflash.block_size");
    const bool rec = layer_inp_archs().count(arch) > 0;
    if (capture == "layer_inp" && !rec) {
        throw Error(kErrUnsupported, "target architecture '" + arch +
            "' does not record layer inputs in llama.cpp 0c1e570 (enabling them would abort the process); "
            "use capture='cb_eval' or 'auto'");
    }
    return capture == "auto" ? (rec ? "layer_inp" : "cb_eval") : capture;
}

}  // namespace dflash2
