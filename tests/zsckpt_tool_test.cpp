// The offline tool on a checkpoint saved by real ranks: inspect, verify
// (and its failure naming file and tensor), export of full tensors, and
// reshard to a world size that then loads the same values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/ckpt_model.h"
#include "tests/support/multirank.h"

using zs::test::CkptModel;
using zs::test::RankEnv;
using zs::test::run_ranks;
namespace fs = std::filesystem;

namespace {

struct Out {
  int rc;
  std::string text;
};

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

Out run(const std::string& args) {
  const std::string cmd = std::string(ZS_BIN_DIR) + "/zsckpt " + args + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Out o{-1, ""};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) o.text.append(buf, n);
  const int st = pclose(p);
  o.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return o;
}

}  // namespace

TEST(Zsckpt, InspectVerifyExportReshard) {
  const std::string dir = zs::test::make_temp_dir("zsckpt");
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    zs::test::train_ckpt_model(m, 2);
    zs_checkpoint_save_options o = ZS_CHECKPOINT_SAVE_OPTIONS_INIT;
    o.user_json = "{\"run\": \"tool\"}";
    ZS_ASSERT_OK(zs_checkpoint_save(m.ctx, m.params.data(), m.params.size(), m.opt, dir.c_str(), &o));
    const auto v = zs::test::full_values(m);
    if (env.rank == 0) zs::test::write_floats(dir + "/saved.bin", v);
    // the same from the live run, one gathered param at a time
    zs_export_options eo = ZS_EXPORT_OPTIONS_INIT;
    const std::string live = dir + "/live.safetensors";
    ZS_ASSERT_OK(zs_export_safetensors(m.ctx, m.params.data(), m.params.size(), live.c_str(), &eo));
    EXPECT_EQ(zs_export_safetensors(m.ctx, m.params.data(), m.params.size(), "/nonexistent/x.safetensors", &eo),
              ZS_ERR_IO);  // every rank, not only the writer
    // A gather still in flight (a prefetch of a step left open) is waited
    // for, not refused; the file is the same.
    zs_gather inflight = nullptr;
    ZS_ASSERT_OK(zs_fetch(&inflight, m.ctx, m.params.data(), 1));
    const std::string again = dir + "/live_again.safetensors";
    ZS_ASSERT_OK(zs_export_safetensors(m.ctx, m.params.data(), m.params.size(), again.c_str(), &eo));
    ZS_ASSERT_OK(zs_gather_wait(inflight, ZS_WAIT_FOREVER));
    ZS_ASSERT_OK(zs_gather_destroy(inflight));
    ZS_ASSERT_OK(zs_release(m.ctx, m.params.data(), 1));
    if (env.rank == 0) {
      EXPECT_EQ(file_bytes(again), file_bytes(live));
    }
    zs::test::destroy_ckpt_model(m);
  });
  Out o = run("inspect " + dir);
  EXPECT_EQ(o.rc, 0) << o.text;
  EXPECT_NE(o.text.find("world size   2"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("adamw, 2 group(s), steps 2"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("{\"run\":\"tool\"}"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("exp_avg, exp_avg_sq, master, param"), std::string::npos) << o.text;
  o = run("verify " + dir);
  EXPECT_EQ(o.rc, 0) << o.text;
  EXPECT_NE(o.text.find("ok"), std::string::npos) << o.text;
  o = run("bogus " + dir);
  EXPECT_EQ(o.rc, 2) << o.text;

  // export: full tensors under their names, bf16 as saved and fp32 masters
  o = run("export " + dir + " " + dir + "/model.safetensors");
  ASSERT_EQ(o.rc, 0) << o.text;
  std::ifstream f(dir + "/model.safetensors", std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, ' ');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const auto h = nlohmann::json::parse(header);
  EXPECT_EQ(h["w1"]["dtype"], "BF16");
  EXPECT_EQ(h["w1"]["shape"], nlohmann::json::parse("[7, 5]"));
  EXPECT_EQ(h["s"]["shape"], nlohmann::json::array());
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  // its bytes are the saved values, param by param
  const auto saved = zs::test::read_floats(dir + "/saved.bin");
  size_t at = 0;
  for (const char* name : {"w1", "b1", "w2", "s"}) {
    const auto off = h[name]["data_offsets"];
    const uint64_t b = off[0].get<uint64_t>(), e = off[1].get<uint64_t>();
    std::vector<uint16_t> raw((e - b) / 2);
    f.seekg(static_cast<std::streamoff>(8 + n + b));
    f.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(e - b));
    for (uint16_t r : raw) {
      const uint32_t u = static_cast<uint32_t>(r) << 16;
      float x;
      std::memcpy(&x, &u, 4);
      ASSERT_EQ(x, saved[at]) << name << " element " << at;
      ++at;
    }
  }
  EXPECT_EQ(at, saved.size());
  {
    std::ifstream a(dir + "/model.safetensors", std::ios::binary), b(dir + "/live.safetensors", std::ios::binary);
    const std::string sa((std::istreambuf_iterator<char>(a)), std::istreambuf_iterator<char>());
    const std::string sb((std::istreambuf_iterator<char>(b)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(sa == sb) << "live export differs from the checkpoint's export (" << sa.size() << " vs "
                          << sb.size() << " bytes)";
  }
  o = run("export " + dir + " " + dir + "/model32.safetensors --fp32");
  ASSERT_EQ(o.rc, 0) << o.text;
  // twice the data bytes (the header differs only in offsets)
  EXPECT_GE(fs::file_size(dir + "/model32.safetensors") - fs::file_size(dir + "/model.safetensors"),
            2 * saved.size());

  // the exported file loads into a fresh model at 3 ranks (each rank reads
  // its own bytes), bf16 as saved; fp32 params at 2 from the fp32 export
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    zs_safetensors_load_options lo = ZS_SAFETENSORS_LOAD_OPTIONS_INIT;
    const std::string file = dir + "/model.safetensors";
    ZS_ASSERT_OK(zs_load_safetensors(m.ctx, m.params.data(), m.params.size(), m.opt, file.c_str(), &lo));
    EXPECT_TRUE(zs::test::full_values(m) == saved);
    // a missing tensor is named, and changes nothing
    const char* names[] = {"w1", "b1", "w2", "nope"};
    lo.names = names;
    EXPECT_EQ(zs_load_safetensors(m.ctx, m.params.data(), 4, nullptr, file.c_str(), &lo), ZS_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(zs_last_error()).find("has no tensor 'nope'"), std::string::npos) << zs_last_error();
    zs::test::destroy_ckpt_model(m);
  });
  // a file only rank 0 sees: it reads one tensor at a time and scatters;
  // read by every rank, the others' missing file fails everyone alike
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    const auto before = zs::test::full_values(m);
    zs_safetensors_load_options lo = ZS_SAFETENSORS_LOAD_OPTIONS_INIT;
    const std::string file = env.rank == 0 ? dir + "/model.safetensors" : dir + "/only-on-rank-0";
    EXPECT_EQ(zs_load_safetensors(m.ctx, m.params.data(), m.params.size(), m.opt, file.c_str(), &lo), ZS_ERR_IO);
    const std::string msg = zs_last_error();
    if (env.rank == 0) {
      EXPECT_NE(msg.find("failed on rank"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("only-on-rank-0"), std::string::npos) << msg;
    }
    EXPECT_TRUE(zs::test::full_values(m) == before);
    lo.from_rank0 = 1;
    ZS_ASSERT_OK(zs_load_safetensors(m.ctx, m.params.data(), m.params.size(), m.opt, file.c_str(), &lo));
    EXPECT_TRUE(zs::test::full_values(m) == saved);
    for (zs_param p : m.params) {  // the fp32 masters took the file's values too
      float* master = nullptr;
      void* shard = nullptr;
      uint64_t shard_numel = 0;
      ZS_ASSERT_OK(zs_optimizer_state_data(m.opt, p, 0, &master, &shard_numel));
      ZS_ASSERT_OK(zs_param_shard_data(p, &shard, nullptr));
      for (uint64_t j = 0; j < shard_numel; ++j) {
        const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(shard)[j]) << 16;
        float w;
        std::memcpy(&w, &u, 4);
        ASSERT_EQ(master[j], w) << j;
      }
    }
    zs::test::destroy_ckpt_model(m);
  });
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m32 = zs::test::make_ckpt_model(env, ZS_FLOAT32, ZS_OPTIM_ADAMW);
    ASSERT_NE(m32.ctx, nullptr);
    zs_safetensors_load_options lo32 = ZS_SAFETENSORS_LOAD_OPTIONS_INIT;
    const std::string file32 = dir + "/model32.safetensors";
    ZS_ASSERT_OK(zs_load_safetensors(m32.ctx, m32.params.data(), m32.params.size(), m32.opt, file32.c_str(), &lo32));
    const auto v32 = zs::test::full_values(m32);
    ASSERT_EQ(v32.size(), saved.size());
    for (size_t i = 0; i < v32.size(); ++i) EXPECT_NEAR(v32[i], saved[i], std::fabs(saved[i]) * 4e-3) << i;
    zs::test::destroy_ckpt_model(m32);
  });

  // loaded without the optimizer, the weights still survive its next
  // step: the 16-bit params' fp32 masters re-read what the load changed
  // (before, an lr-0 step wrote the old masters back over them)
  run_ranks(2, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    zs_safetensors_load_options lo = ZS_SAFETENSORS_LOAD_OPTIONS_INIT;
    const std::string file = dir + "/model.safetensors";
    ZS_ASSERT_OK(zs_load_safetensors(m.ctx, m.params.data(), m.params.size(), nullptr, file.c_str(), &lo));
    ASSERT_TRUE(zs::test::full_values(m) == saved);
    ZS_ASSERT_OK(zs_optimizer_set_lr(m.opt, -1, 0.0));
    for (zs_param p : m.params) {
      zs_param_info info = ZS_PARAM_INFO_INIT;
      ZS_ASSERT_OK(zs_param_get_info(p, &info));
      std::vector<uint16_t> zero(info.numel, 0);
      ZS_ASSERT_OK(zs_grad_push(p, zero.data(), ZS_BFLOAT16, zero.size() * 2));
    }
    zs_step_result r = ZS_STEP_RESULT_INIT;
    ZS_ASSERT_OK(zs_optimizer_step(m.opt, &r));
    EXPECT_TRUE(zs::test::full_values(m) == saved) << "the optimizer step undid the load";
    zs::test::destroy_ckpt_model(m);
  });

  // reshard to 3, then load at 3: the same values
  o = run("reshard " + dir + " " + dir + "/three --world 3");
  ASSERT_EQ(o.rc, 0) << o.text;
  EXPECT_EQ(run("verify " + dir + "/three").rc, 0);
  EXPECT_NE(run("inspect " + dir + "/three").text.find("world size   3"), std::string::npos);
  EXPECT_EQ(run("reshard " + dir + " " + dir + "/three --world 3").rc, 1);  // exists
  run_ranks(3, [&](const RankEnv& env) {
    CkptModel m = zs::test::make_ckpt_model(env, ZS_BFLOAT16, ZS_OPTIM_ADAMW);
    ASSERT_NE(m.ctx, nullptr);
    zs_checkpoint_load_options lo = ZS_CHECKPOINT_LOAD_OPTIONS_INIT;
    const std::string three = dir + "/three";
    ZS_ASSERT_OK(zs_checkpoint_load(m.ctx, m.params.data(), m.params.size(), m.opt, three.c_str(), &lo, nullptr));
    EXPECT_TRUE(zs::test::full_values(m) == saved);
    zs::test::destroy_ckpt_model(m);
  });

  // a flipped byte: verify fails, naming the file and tensor
  const std::string f0 = dir + "/step-2/rank-00000-of-00002.safetensors";
  {
    std::fstream g(f0, std::ios::in | std::ios::out | std::ios::binary);
    g.seekp(static_cast<std::streamoff>(fs::file_size(f0) - 3));
    g.put('\x7f');
  }
  o = run("verify " + dir);
  EXPECT_EQ(o.rc, 1) << o.text;
  EXPECT_NE(o.text.find("rank-00000-of-00002.safetensors': tensor '"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("fails its checksum"), std::string::npos) << o.text;
  fs::remove_all(dir);
}

// inspect reads the manifest without the engine's checks: fields of the
// wrong type were an uncaught type_error (std::terminate), a float integer
// an out-of-range conversion, and a missing key a const operator[].
TEST(Zsckpt, InspectOfAHostileManifestFailsCleanly) {
  const std::string dir = zs::test::make_temp_dir("zsckpt_hostile");
  auto inspect = [&](const std::string& manifest) {
    std::ofstream(dir + "/manifest.json") << manifest;
    return run("inspect " + dir);
  };
  Out o = inspect(R"({"world_size": 1e300, "step": -3, "params": [{"name": "w"}], "optimizer": {"kind": "sgd"}})");
  EXPECT_EQ(o.rc, 0) << o.text;
  EXPECT_NE(o.text.find("world size   1e+300"), std::string::npos) << o.text;
  EXPECT_NE(o.text.find("step         -3"), std::string::npos) << o.text;
  o = inspect(R"({"files": [{"bytes": "many"}, 3], "tag": 7})");
  EXPECT_EQ(o.rc, 1) << o.text;
  EXPECT_NE(o.text.find("is not a checkpoint manifest"), std::string::npos) << o.text;
  o = inspect("[1, 2]");
  EXPECT_EQ(o.rc, 1) << o.text;
  fs::remove_all(dir);
}
