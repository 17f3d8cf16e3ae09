// zsckpt — look at, check, consolidate and reshard zeroshard checkpoints,
// offline: no ranks, no GPU, only the public C API and the files.
//
//   zsckpt inspect PATH [--tag T] [--json]
//   zsckpt verify  PATH [--tag T]
//   zsckpt export  PATH OUT.safetensors [--tag T] [--fp32]
//   zsckpt reshard PATH OUT_DIR --world N [--tag T]
//   zsckpt import  SRC OUT_DIR [--tag T]
//   zsckpt export-deepspeed PATH OUT_DIR [--world N] [--tag T]
//
// PATH is a checkpoint directory (it holds manifest.json) or a directory of
// them, where --tag picks one and `latest` is the default. A progress bar
// goes to stderr when it is a terminal. Exit status: 0 done, 1 the
// checkpoint failed (the message names the file and tensor), 2 bad usage.
// import reads a DeepSpeed ZeRO checkpoint directory or a torch DCP one
// (FSDP2's) into OUT_DIR/<tag>: their files need torch, so it runs
// `python -m zeroshard.convert` with $ZS_PYTHON (default python3).
// export-deepspeed is the other way: PATH (a checkpoint, a directory of
// them, or a Hugging Face Trainer folder holding zeroshard/) written into
// OUT_DIR in DeepSpeed ZeRO-3's layout for N ranks (default: PATH's world
// size), which DeepSpeed resumes at N ranks and its zero_to_fp32.py reads;
// DeepSpeed's files are pickles of its classes, so this runs
// `python -m zeroshard.convert --to-deepspeed` the same way.
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "zeroshard/zeroshard.h"

namespace {

int usage() {
  std::fprintf(stderr,
               "usage: zsckpt inspect PATH [--tag T] [--json]\n"
               "       zsckpt verify  PATH [--tag T]\n"
               "       zsckpt export  PATH OUT.safetensors [--tag T] [--fp32]\n"
               "       zsckpt reshard PATH OUT_DIR --world N [--tag T]\n"
               "       zsckpt import  SRC OUT_DIR [--tag T]   (DeepSpeed or torch DCP; needs Python, torch)\n"
               "       zsckpt export-deepspeed PATH OUT_DIR [--world N] [--tag T]   (needs DeepSpeed)\n");
  return 2;
}

void progress_bar(void*, const char* phase, uint64_t done, uint64_t total) {
  if (total == 0) return;
  const int width = 40;
  const int filled = static_cast<int>(static_cast<double>(done) / static_cast<double>(total) * width);
  std::fprintf(stderr, "\r%-8s [%.*s%*s] %5.1f%% %8.1f MiB", phase, filled,
               "########################################", width - filled, "",
               100.0 * static_cast<double>(done) / static_cast<double>(total),
               static_cast<double>(done) / (1 << 20));
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

zs_progress_fn bar() { return isatty(2) ? progress_bar : nullptr; }

int failed(zs_status s) {
  std::fprintf(stderr, "zsckpt: %s: %s\n", zs_status_string(s), zs_last_error());
  return 1;
}

// Runs $ZS_PYTHON (default python3) with `args` in place of this process:
// the converter loads the library this tool runs on, unless told otherwise.
int run_python(std::vector<std::string> args, const char* what) {
  const char* env = std::getenv("ZS_PYTHON");
  const std::string python = env != nullptr && *env != '\0' ? env : "python3";
  args.insert(args.begin(), python);
  std::vector<char*> argv_out;
  for (auto& a : args) argv_out.push_back(a.data());
  argv_out.push_back(nullptr);
  Dl_info self{};
  if (std::getenv("ZEROSHARD_LIBRARY") == nullptr &&
      dladdr(reinterpret_cast<void*>(&zs_checkpoint_verify), &self) != 0 && self.dli_fname != nullptr)
    setenv("ZEROSHARD_LIBRARY", self.dli_fname, 1);
  std::fflush(stdout);
  execvp(python.c_str(), argv_out.data());
  std::fprintf(stderr,
               "zsckpt: %s: cannot run '%s' (%s): reading and writing DeepSpeed and DCP files needs Python with "
               "torch and the zeroshard package; set ZS_PYTHON to that interpreter\n",
               what, python.c_str(), std::strerror(errno));
  return 1;
}

// The manifest the engine would load, found the way it finds it.
std::string manifest_path(const std::string& path, const std::string& tag) {
  auto exists = [](const std::string& p) { return access(p.c_str(), F_OK) == 0; };
  if (!tag.empty()) return path + "/" + tag + "/manifest.json";
  if (exists(path + "/manifest.json")) return path + "/manifest.json";
  std::ifstream f(path + "/latest");
  std::string t;
  std::getline(f, t);
  return path + "/" + t + "/manifest.json";
}

// An integer field as inspect prints it. The manifest is read here without
// the engine's checks, so anything but an integer (a float could convert
// out of range) is printed as the JSON it is.
std::string integer(const nlohmann::json& j, const char* key) {
  if (!j.is_object() || !j.contains(key)) return "0";
  const auto& v = j.at(key);
  if (v.is_number_unsigned()) return std::to_string(v.get<uint64_t>());
  if (v.is_number_integer()) return std::to_string(v.get<int64_t>());
  return v.dump();
}

uint64_t count(const nlohmann::json& j, const char* key) {
  return j.is_object() && j.contains(key) && j.at(key).is_number_unsigned() ? j.at(key).get<uint64_t>() : 0;
}

int inspect(const std::string& path, const std::string& tag, bool as_json) {
  const std::string mp = manifest_path(path, tag);
  std::ifstream f(mp);
  if (!f) {
    std::fprintf(stderr, "zsckpt: cannot open '%s'\n", mp.c_str());
    return 1;
  }
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "zsckpt: '%s' is not JSON: %s\n", mp.c_str(), e.what());
    return 1;
  }
  if (as_json) {
    std::printf("%s\n", m.dump(1).c_str());
    return 0;
  }
  // A field of another type than a manifest has (a string for a number, an
  // array for an object) is a type_error here, not a crash; value() rather
  // than a const operator[], whose missing key is undefined.
  try {
    uint64_t bytes = 0, elems = 0;
    for (const auto& file : m.value("files", nlohmann::json::array())) bytes += count(file, "bytes");
    std::printf("checkpoint   %s\n", mp.substr(0, mp.size() - std::strlen("/manifest.json")).c_str());
    std::printf("tag          %s\n", m.value("tag", "").c_str());
    std::printf("engine       %s (format %s)\n", m.value("engine_version", "").c_str(),
                integer(m, "format_version").c_str());
    std::printf("world size   %s\n", integer(m, "world_size").c_str());
    std::printf("step         %s\n", integer(m, "step").c_str());
    const auto& opt = m["optimizer"];
    if (opt.is_null()) {
      std::printf("optimizer    none\n");
    } else {
      std::printf("optimizer    %s, %zu group(s), steps %s, loss scale %g\n", opt.value("kind", "").c_str(),
                  opt.value("groups", nlohmann::json::array()).size(), integer(opt, "steps").c_str(),
                  opt.value("loss_scaler", nlohmann::json::object()).value("scale", 0.0));
    }
    std::printf("files        %zu, %.2f MiB\n", m["files"].size(), static_cast<double>(bytes) / (1 << 20));
    std::printf("user         %s\n", m["user"].dump().c_str());
    std::printf("params       %zu\n", m["params"].size());
    for (const auto& p : m["params"]) {
      std::string states;
      const nlohmann::json p_states = p.value("states", nlohmann::json::object());
      for (const auto& [s, chunks] : p_states.items()) states += (states.empty() ? "" : ", ") + s;
      elems += count(p, "numel");
      std::printf("  %-40s %-5s %-18s %s\n", p.value("name", "").c_str(), p.value("dtype", "").c_str(),
                  p.value("shape", nlohmann::json()).dump().c_str(), states.c_str());
    }
    std::printf("elements     %llu\n", static_cast<unsigned long long>(elems));
  } catch (const nlohmann::json::exception& e) {
    std::fprintf(stderr, "zsckpt: '%s' is not a checkpoint manifest: %s\n", mp.c_str(), e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  const std::string cmd = argv[1];
  std::vector<std::string> pos;
  std::string tag;
  bool as_json = false, fp32 = false;
  int world = 0;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tag" && i + 1 < argc) {
      tag = argv[++i];
    } else if (a == "--json") {
      as_json = true;
    } else if (a == "--fp32") {
      fp32 = true;
    } else if (a == "--world" && i + 1 < argc) {
      world = std::atoi(argv[++i]);
    } else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "zsckpt: unknown option '%s'\n", a.c_str());
      return usage();
    } else {
      pos.push_back(a);
    }
  }
  const char* t = tag.empty() ? nullptr : tag.c_str();
  if (cmd == "inspect" && pos.size() == 1) return inspect(pos[0], tag, as_json);
  if (cmd == "verify" && pos.size() == 1) {
    const zs_status s = zs_checkpoint_verify(pos[0].c_str(), t, bar(), nullptr);
    if (s != ZS_OK) return failed(s);
    std::printf("ok: every checksum matches\n");
    return 0;
  }
  if (cmd == "export" && pos.size() == 2) {
    zs_checkpoint_export_options o = ZS_CHECKPOINT_EXPORT_OPTIONS_INIT;
    o.tag = t;
    o.fp32 = fp32 ? 1 : 0;
    o.progress = bar();
    const zs_status s = zs_checkpoint_export(pos[0].c_str(), pos[1].c_str(), &o);
    if (s != ZS_OK) return failed(s);
    std::printf("wrote %s\n", pos[1].c_str());
    return 0;
  }
  if (cmd == "reshard" && pos.size() == 2) {
    if (world < 1) {
      std::fprintf(stderr, "zsckpt: reshard needs --world N (N >= 1)\n");
      return usage();
    }
    const zs_status s = zs_checkpoint_reshard(pos[0].c_str(), t, pos[1].c_str(), world, bar(), nullptr);
    if (s != ZS_OK) return failed(s);
    std::printf("wrote %s for %d ranks\n", pos[1].c_str(), world);
    return 0;
  }
  if (cmd == "import" && pos.size() == 2) {
    std::vector<std::string> args{"-m", "zeroshard.convert", pos[0], pos[1]};
    if (t != nullptr) args.insert(args.end(), {"--tag", tag});
    return run_python(args, "import");
  }
  if (cmd == "export-deepspeed" && pos.size() == 2) {
    std::vector<std::string> args{"-m", "zeroshard.convert", "--to-deepspeed", pos[0], pos[1]};
    if (t != nullptr) args.insert(args.end(), {"--tag", tag});
    if (world > 0) args.insert(args.end(), {"--world", std::to_string(world)});
    return run_python(args, "export-deepspeed");
  }
  return usage();
}
