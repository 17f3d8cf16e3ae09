// A TCP store server's keys kept in a file, so that a server started again
// on the same file starts with every key the last one held: zsrun restarts
// a dead tools/zsstore on the same port with its journal (ZS_STORE_JOURNAL),
// and the ranks, which resend a call its death cut short, never notice but
// for the wait (docs/healing.md, section 5).
//
// The file is "zeroshard-store-journal/1\n", then one record per change:
// u32 key_length, u64 value_length, key, value (the key's whole value now,
// little-endian lengths). A change is appended with one write(2) before the
// server replies to it, so a server killed after that write leaves it in the
// page cache for the next (a host's loss takes the ranks too); a record cut
// short by a kill in that write is dropped at the next open.
#pragma once

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace zs {

class StoreJournal {
 public:
  // Opens path (creating it), reads every whole record into *keys (a later
  // record of a key replaces an earlier one) and rewrites the file with one
  // record per key, so that it grows only with one run's changes.
  // Code::Bootstrap naming the path when it cannot be read or written, or
  // holds something else than a journal.
  StoreJournal(const std::string& path, std::unordered_map<std::string, std::string>* keys);
  ~StoreJournal();
  StoreJournal(const StoreJournal&) = delete;
  StoreJournal& operator=(const StoreJournal&) = delete;

  // Appends the changes (key, its whole value now) in one write: all of
  // them reach the file or, cut short by a kill, none is read back. "" when
  // written, else why not (the server then removes the file and goes on in
  // memory: a restart from it would serve other keys than these).
  std::string record(const std::vector<std::pair<const std::string*, const std::string*>>& changes);

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace zs
