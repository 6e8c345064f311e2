// Errors of the native driver: a category code, a message that names the problem and the fix, and
// the libllama return code when there is one. module.cpp maps them to dflash2_gguf.errors classes.
#pragma once

#include <stdexcept>
#include <string>

namespace dflash2 {

// Error categories carried by every Error (and by the Python exception it becomes).
enum ErrorCode : int {
    kErrLoad         = 1,  // a GGUF could not be read or loaded
    kErrIncompatible = 2,  // drafter/target pairing mismatch (vocab, hidden, layer ids, width)
    kErrUnsupported  = 3,  // a configuration this driver refuses (e.g. context shift on a recurrent target)
    kErrDecode       = 4,  // llama_decode / llama_process returned non-zero (rc carried)
    kErrContextFull  = 5,  // prompt + generation does not fit the context
    kErrClosed       = 6,  // the engine was closed
    kErrInternal     = 7,  // an invariant of the driver failed
};

class Error : public std::runtime_error {
  public:
    Error(int code, const std::string & msg, int rc = 0) : std::runtime_error(msg), code_(code), rc_(rc) {}
    int code() const { return code_; }
    int rc() const { return rc_; }  // the libllama return code, when there is one
  private:
    int code_;
    int rc_;
};

}  // namespace dflash2
