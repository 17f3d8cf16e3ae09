// zs_xxx_init: the _INIT macros' values for callers that cannot expand C
// macros (Python's cffi, Rust, Julia, SWIG), sized by the caller's header.
#include "capi/handles.h"

using namespace zs;
using namespace zs::capi;

#define ZS_DEFINE_INIT(T, arg)                                                             \
  ZS_API zs_status T##_init(T* arg, size_t size) {                                       \
    return guarded([&] { init_sized(arg, size, #arg); });                                 \
  }

extern "C" {
ZS_DEFINE_INIT(zs_context_options, options)
ZS_DEFINE_INIT(zs_param_options, options)
ZS_DEFINE_INIT(zs_optim_hparams, hparams)
ZS_DEFINE_INIT(zs_memory_stats, stats)
ZS_DEFINE_INIT(zs_fetch_stats, stats)
ZS_DEFINE_INIT(zs_param_info, info)
ZS_DEFINE_INIT(zs_step_result, result)
ZS_DEFINE_INIT(zs_coord_stats, stats)
ZS_DEFINE_INIT(zs_step_stats, stats)
ZS_DEFINE_INIT(zs_checkpoint_save_options, options)
ZS_DEFINE_INIT(zs_checkpoint_load_options, options)
ZS_DEFINE_INIT(zs_checkpoint_info, info)
ZS_DEFINE_INIT(zs_checkpoint_export_options, options)
ZS_DEFINE_INIT(zs_export_options, options)
ZS_DEFINE_INIT(zs_safetensors_load_options, options)
}  // extern "C"
