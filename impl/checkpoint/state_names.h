// How optimizer state is named in a checkpoint: tensor states per
// optimizer slot, the optimizer kind, and hyper-parameters as JSON.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "impl/optim/optimizer.h"

namespace zs::ckpt {

inline constexpr const char* kParam = "param";    // working dtype shard
inline constexpr const char* kMaster = "master";  // fp32 master (16-bit params)

// p's slot 0 "master", 1 "exp_avg" (Adam) / "momentum" (SGD, a Muon
// param), 2 "exp_avg_sq".
std::string state_name(const Optimizer& opt, const Param& p, int slot);
const char* optim_kind_name(OptimKind kind);
OptimKind parse_optim_kind(const std::string& s, const std::string& where);
nlohmann::json hparams_to_json(const Hparams& h);
Hparams hparams_from_json(const nlohmann::json& j, const std::string& where);

// The name each param goes by in a checkpoint: names[i] when given (one
// per param, else InvalidArgument), else its registration name; two params
// under one name is an InvalidArgument naming it.
using NameOf = std::map<const Param*, std::string>;
NameOf checkpoint_names(const std::vector<std::shared_ptr<Param>>& params,
                        const std::vector<std::string>& names, const char* what);

}  // namespace zs::ckpt
