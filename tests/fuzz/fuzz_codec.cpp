// libFuzzer harness for the object codec (the decoder of gather_object & co, which reads bytes
// sent by other processes): whatever the input, decoding either returns a value or raises
// ddp::Error with Errc::invalid_argument; it never crashes, reads out of bounds (ASan), hits
// undefined behaviour (UBSan) or allocates more than the input could describe (run with
// -malloc_limit_mb). A decoded value re-encodes to bytes that decode and re-encode unchanged.
//
// The first input byte picks the type; the rest is the encoding (type tag included).
#include <ddp/codec.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

template <class T>
void decode_as(const std::uint8_t* data, std::size_t size) {
  std::optional<T> value;
  try {
    value = ddp::detail::decode_object<T>(data, size);
  } catch (const ddp::Error& e) {
    if (e.code() != ddp::Errc::invalid_argument) {
      std::fprintf(stderr, "unexpected error code %d: %s\n", static_cast<int>(e.code()), e.what());
      std::abort();
    }
    return;
  }
  // Compared as bytes (NaN != NaN): encode(decode(encode(v))) == encode(v).
  const std::string again = ddp::detail::encode_object(*value);
  if (ddp::detail::encode_object(ddp::detail::decode_object<T>(again.data(), again.size())) !=
      again) {
    std::fprintf(stderr, "a decoded value does not survive a round trip\n");
    std::abort();
  }
}

using Deep = std::vector<std::vector<std::vector<std::vector<std::string>>>>;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t* body = data + 1;
  const std::size_t n = size - 1;
  switch (data[0] % 8) {
    case 0: decode_as<std::string>(body, n); break;
    case 1: decode_as<std::vector<double>>(body, n); break;
    case 2: decode_as<std::vector<std::string>>(body, n); break;
    case 3: decode_as<std::pair<std::int32_t, std::optional<std::string>>>(body, n); break;
    case 4: decode_as<Deep>(body, n); break;
    case 5: decode_as<std::optional<std::vector<std::int64_t>>>(body, n); break;
    case 6: decode_as<std::vector<std::pair<std::string, std::vector<float>>>>(body, n); break;
    default: decode_as<std::uint64_t>(body, n); break;
  }
  return 0;
}
