// HR_CHECK(cond, parts...): TORCH_CHECK whose message is assembled here without iostreams.
//
// TORCH_CHECK formats numbers through std::ostream (c10::str), and this library is compiled
// on the user's machine by whatever C++ compiler is there. When that compiler's headers are newer
// than the C++ runtime the process loads (seen on a CUDA image: torch 2.11, Python 3.12), the
// ostream number inserter instantiated in this library crashes with SIGSEGV, so a bad argument
// killed the process instead of raising its error. Strings and std::to_string need none of it:
// with one string argument TORCH_CHECK passes the message through untouched.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace hetero_run_cpu {

inline void append_part(std::string& s, const char* part) { s += part; }
inline void append_part(std::string& s, const std::string& part) { s += part; }
inline void append_part(std::string& s, c10::ScalarType type) { s += c10::toString(type); }
inline void append_part(std::string& s, double value) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", value);
  s += buf;
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append_part(std::string& s, T value) {
  s += std::to_string(value);
}
inline void append_part(std::string& s, c10::IntArrayRef sizes) {  // as [2, 64]
  s += '[';
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  s += ']';
}

template <typename... Parts>
std::string check_message(const Parts&... parts) {
  std::string s;
  (append_part(s, parts), ...);
  return s;
}

}  // namespace hetero_run_cpu

#define HR_CHECK(cond, ...) TORCH_CHECK(cond, ::hetero_run_cpu::check_message(__VA_ARGS__))
