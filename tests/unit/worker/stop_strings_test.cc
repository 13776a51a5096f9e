#include "worker/engine/stop_strings.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvgrid::worker {
namespace {

// Feeds `deltas`; returns everything emitted and whether it stopped.
std::pair<std::string, bool> Feed(StopStringMatcher& m, const std::vector<std::string>& deltas) {
  std::string out;
  for (const std::string& d : deltas) {
    auto r = m.Push(d);
    out += r.emit;
    if (r.stopped) return {out, true};
  }
  return {out + m.Flush(), false};
}

TEST(StopStringsTest, StopSplitAcrossDeltasNeverLeaks) {
  StopStringMatcher m({"\nAnd"}, false);
  std::string seen;
  for (const char* d : {"the LORD", ".", "\n", "A", "nd God"}) {
    auto r = m.Push(d);
    seen += r.emit;
    EXPECT_EQ(seen.find('\n'), std::string::npos) << "leaked part of the stop string: " << seen;
    if (r.stopped) break;
  }
  EXPECT_EQ(seen, "the LORD.");
}

// Text inside min_tokens stops nothing but is still matched: a stop string that begins there
// and completes afterwards ends the stream; one that completed inside it does not.
TEST(StopStringsTest, StopStringsBeginningInsideMinTokensCount) {
  StopStringMatcher m({"\nAnd"}, false);
  std::string seen = m.Push("the LORD.\n", /*can_stop=*/false).emit;
  EXPECT_EQ(seen, "the LORD.");  // the newline may begin the stop string: held back
  auto r = m.Push("And God", /*can_stop=*/true);
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(seen + r.emit, "the LORD.");

  StopStringMatcher early({"ab", "xaby"}, false);
  // "ab" completes while stopping is not allowed; "xab" is held as a prefix of "xaby".
  EXPECT_EQ(early.Push("xab", /*can_stop=*/false).emit, "");
  r = early.Push("q", /*can_stop=*/true);
  EXPECT_FALSE(r.stopped);
  EXPECT_EQ(r.emit, "xabq");
  r = early.Push("ab", /*can_stop=*/true);  // a new "ab" completes now
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.emit, "");
}

TEST(StopStringsTest, IncludeStopAndEarliestMatchWins) {
  StopStringMatcher m({"cd", "bcde"}, true);
  auto [out, stopped] = Feed(m, {"ab", "cdef"});
  EXPECT_TRUE(stopped);
  EXPECT_EQ(out, "abcde");  // "bcde" starts before "cd"
}

TEST(StopStringsTest, HeldTextIsReleasedWhenItCannotMatch) {
  StopStringMatcher m({"LORD"}, false);
  auto r1 = m.Push("the LO");
  EXPECT_EQ(r1.emit, "the ");
  auto r2 = m.Push("ng day");
  EXPECT_EQ(r2.emit, "LOng day");
  EXPECT_FALSE(r2.stopped);
  EXPECT_EQ(m.Flush(), "");
}

TEST(StopStringsTest, FlushReturnsAPendingPrefixAtTheEnd) {
  StopStringMatcher m({"amen."}, false);
  auto [out, stopped] = Feed(m, {"so be it, ame"});
  EXPECT_FALSE(stopped);
  EXPECT_EQ(out, "so be it, ame");
}

TEST(StopStringsTest, NothingAfterAStop) {
  StopStringMatcher m({"x"}, false);
  EXPECT_TRUE(m.Push("abxcd").stopped);
  EXPECT_EQ(m.Push("more").emit, "");
  EXPECT_EQ(m.Flush(), "");
}

}  // namespace
}  // namespace kvgrid::worker
