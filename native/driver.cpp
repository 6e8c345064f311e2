// The DFlash / DFlash 2 speculative decoding driver on libllama.
#include "driver.h"

#include "llama_ext_pinned.h"

#include <cstring>

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

}  // namespace dflash2
