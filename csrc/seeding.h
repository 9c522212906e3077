// Seed words for Mersenne Twister generators, from a 64-bit seed.
//
// A per-sample transform runs with the global generators of Python, numpy and torch set to
// states that depend on the sample's seed alone. Their own seeding functions run a serial
// recurrence over the 624-word state (Python's init_by_array three times over it); these
// words come from a counter-based mix instead: independent of one another, so the compiler
// and the CPU compute them in parallel, at a fraction of the cost.
#pragma once

#include <cstddef>
#include <cstdint>

namespace streamcache {

constexpr size_t kMtStateWords = 624;

// Tags that give each generator its own stream of words for the same seed (a transform that
// draws from two generators must not see the same numbers twice).
constexpr uint64_t kStreamPython = 0x5059'5448'4F4E'0001ULL;
constexpr uint64_t kStreamNumpy = 0x4E55'4D50'5900'0002ULL;
constexpr uint64_t kStreamTorch = 0x544F'5243'4800'0003ULL;

// The SplitMix64 finalizer: a bijection of 64-bit integers that mixes every input bit.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58'476D'1CE4'E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D0'49BB'1331'11EBULL;
  return z ^ (z >> 31);
}

// out[0..n) (n even): with key = mix64(seed ^ stream), word pair k is the low and high half
// of mix64(key + (k + 1) * 0x9E3779B97F4A7C15).
void mt_state_words(uint64_t seed, uint64_t stream, uint32_t* out, size_t n);

// The same words, each zero-extended to 64 bits (a layout that keeps 32-bit words in 64).
void mt_state_words64(uint64_t seed, uint64_t stream, uint64_t* out, size_t n);

}  // namespace streamcache
