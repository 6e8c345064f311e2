// The DFlash / DFlash 2 speculative decoding driver on libllama (see driver.cpp).
#pragma once

#include <string>

namespace dflash2 {

// Returns an empty string when the loaded libllama is the pinned build, otherwise a message that
// names what differs and how to fix it.
std::string check_libllama();

}  // namespace dflash2
