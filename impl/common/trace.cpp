#include "impl/common/trace.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "impl/common/error.h"

namespace zs {
namespace {

// JSON string content: quotes, backslashes and control characters escaped.
std::string escaped(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace

std::shared_ptr<Trace> Trace::from_env(int rank) {
  const char* value = std::getenv("ZS_TRACE");
  if (value == nullptr || *value == '\0') return nullptr;
  std::string path = value;
  const size_t at = path.find("%r");
  if (at != std::string::npos)
    path.replace(at, 2, std::to_string(rank));
  else
    path += ".rank" + std::to_string(rank) + ".json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr)
    fail(Code::InvalidArgument, "ZS_TRACE: cannot write the trace file '", path, "': ",
         std::strerror(errno));
  return std::shared_ptr<Trace>(new Trace(f, path, rank));
}

Trace::Trace(std::FILE* f, std::string path, int rank)
    : file_(f), path_(std::move(path)), rank_(rank), origin_(Clock::now()) {
  std::fprintf(file_, "[\n{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %d, \"args\": "
                      "{\"name\": \"rank %d\"}},\n", rank_, rank_);
  std::fflush(file_);
}

Trace::~Trace() {
  std::lock_guard<std::mutex> lock(mu_);
  std::fputs("{}]\n", file_);  // closes the array (the empty object keeps the commas valid)
  std::fclose(file_);
}

int Trace::lane_id(const std::string& lane) {
  for (int i = 0; i < num_lanes_; ++i)
    if (lanes_[i] == lane) return i;
  if (num_lanes_ == 64) return 63;  // more lanes than any context has groups: share the last
  lanes_[num_lanes_] = lane;
  std::fprintf(file_, "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": %d, \"tid\": %d, "
                      "\"args\": {\"name\": \"%s\"}},\n", rank_, num_lanes_, escaped(lane).c_str());
  return num_lanes_++;
}

void Trace::event(const char* category, const std::string& name, const std::string& lane,
                  Clock::time_point begin, Clock::time_point end, const std::string& args_json) {
  using std::chrono::duration;
  const double ts = duration<double, std::micro>(begin - origin_).count();
  const double dur = duration<double, std::micro>(end - begin).count();
  std::lock_guard<std::mutex> lock(mu_);
  const int tid = lane_id(lane);
  std::fprintf(file_, "{\"name\": \"%s\", \"cat\": \"%s\", \"ph\": \"X\", \"pid\": %d, \"tid\": %d, "
                      "\"ts\": %.3f, \"dur\": %.3f%s%s},\n",
               escaped(name).c_str(), category, rank_, tid, ts, dur,
               args_json.empty() ? "" : ", \"args\": ", args_json.c_str());
  std::fflush(file_);
}

}  // namespace zs
