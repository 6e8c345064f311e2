// Thin nanobind binding over driver.cpp: type conversion and GIL release only.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "driver.h"
#include "llama_ext_pinned.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
    m.doc() = "dflash2_gguf native driver (private; use the dflash2_gguf package)";
    m.attr("PINNED_LLAMA_CPP_COMMIT") = dflash2::kPinnedLlamaCppCommit;
    m.def("llama_version", []() { return std::string(llama_version()); },
          "llama_version() of the libllama this module is linked to.");
    m.def("check_libllama", &dflash2::check_libllama,
          "Empty string if the loaded libllama is the pinned build, else the reason it is not.");
}
