#include "impl/checkpoint/state_names.h"

#include "impl/common/error.h"

namespace zs::ckpt {

std::string state_name(const Optimizer& opt, const Param& p, int slot) {
  if (slot == 0) return kMaster;
  if (slot == 1) return opt.kind() == OptimKind::Sgd || opt.steps_muon(p) ? "momentum" : "exp_avg";
  return "exp_avg_sq";
}

const char* optim_kind_name(OptimKind kind) {
  switch (kind) {
    case OptimKind::AdamW: return "adamw";
    case OptimKind::Adam: return "adam";
    case OptimKind::Sgd: return "sgd";
    case OptimKind::External: return "external";
    case OptimKind::Muon: return "muon";
  }
  return "?";
}

OptimKind parse_optim_kind(const std::string& s, const std::string& where) {
  if (s == "adamw") return OptimKind::AdamW;
  if (s == "adam") return OptimKind::Adam;
  if (s == "sgd") return OptimKind::Sgd;
  if (s == "external") return OptimKind::External;
  if (s == "muon") return OptimKind::Muon;
  fail(Code::Io, where, ": optimizer kind '", s, "': expected adamw, adam, sgd, external or muon");
}

nlohmann::json hparams_to_json(const Hparams& h) {
  return {{"lr", h.lr},         {"beta1", h.beta1},       {"beta2", h.beta2},
          {"eps", h.eps},       {"weight_decay", h.weight_decay},
          {"momentum", h.momentum}, {"dampening", h.dampening},
          {"nesterov", h.nesterov}, {"bias_correction", h.bias_correction},
          {"use_muon", h.use_muon}, {"ns_method", h.ns_method}, {"ns_steps", h.ns_steps}};
}

Hparams hparams_from_json(const nlohmann::json& j, const std::string& where) {
  Hparams h;
  try {
    h.lr = j.at("lr").get<double>();
    h.beta1 = j.at("beta1").get<double>();
    h.beta2 = j.at("beta2").get<double>();
    h.eps = j.at("eps").get<double>();
    h.weight_decay = j.at("weight_decay").get<double>();
    h.momentum = j.at("momentum").get<double>();
    h.dampening = j.at("dampening").get<double>();
    h.nesterov = j.at("nesterov").get<bool>();
    h.bias_correction = j.at("bias_correction").get<bool>();
    // Absent from checkpoints written before ZS_OPTIM_MUON: the defaults.
    h.use_muon = j.value("use_muon", h.use_muon);
    h.ns_method = j.value("ns_method", h.ns_method);
    h.ns_steps = j.value("ns_steps", h.ns_steps);
  } catch (const nlohmann::json::exception& e) {
    fail(Code::Io, where, ": hyper-parameters: ", e.what());
  }
  return h;
}

NameOf checkpoint_names(const std::vector<std::shared_ptr<Param>>& params,
                        const std::vector<std::string>& names, const char* what) {
  if (!names.empty() && names.size() != params.size())
    fail(Code::InvalidArgument, what, ": ", names.size(), " names for ", params.size(), " params");
  NameOf out;
  std::map<std::string, size_t> seen;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    if (p.unregistered) fail(Code::InvalidArgument, what, ": ", p.describe(), " was unregistered");
    const std::string& n = names.empty() ? p.name : names[i];
    if (n.empty()) fail(Code::InvalidArgument, what, ": params[", i, "] has an empty name");
    auto [it, fresh] = seen.emplace(n, i);
    if (!fresh)
      fail(Code::InvalidArgument, what, ": params[", it->second, "] and params[", i, "] are both named '", n,
           "' (names identify params in a checkpoint)");
    if (!out.emplace(&p, n).second)
      fail(Code::InvalidArgument, what, ": params[", i, "] (", p.describe(), ") is listed twice");
  }
  return out;
}

}  // namespace zs::ckpt
