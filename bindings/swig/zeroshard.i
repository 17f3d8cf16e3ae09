/*
 * SWIG interface over include/zeroshard/zeroshard.h: the C ABI for
 * languages without a hand-written binding. Java is built and tested
 * (bindings/swig/CMakeLists.txt): the generated low-level classes
 * zeroshard.ZsNative / ZsNativeJNI, and hand-written AutoCloseable classes
 * over them in bindings/swig/java/zeroshard/.
 *
 * What this file decides (the typemaps are Java's; another language would
 * add its own beside them):
 *  - Every function returning zs_status throws when the status is not
 *    ZS_OK (Java: zeroshard.ZeroShardException carrying the status and
 *    zs_last_error(), read on the calling thread right after the call).
 *  - Enums are plain integer constants (ZsNative.ZS_OK, ZS_FLOAT32, ...).
 *  - Buffer fields of structs (zs_param_options.data) are set from a direct
 *    ByteBuffer (kept alive by the caller until the call that reads it);
 *    their getter gives null.
 *  - Handle outputs (zs_context* out, ...) go through small boxes:
 *    new_zs_context_box(), zs_context_box_value(b), delete_zs_context_box(b).
 *  - Param lists (const zs_param*, size_t) go through zs_param arrays:
 *    new_zs_param_array(n), zs_param_array_setitem(a, i, p), delete_...
 *  - int/double/int64 and enum outputs are one-element arrays (typemaps.i
 *    OUTPUT); const char** outputs a String[1] receiving a copy.
 *  - Buffers (void*, const void*) are direct java.nio.ByteBuffers; their
 *    byte size is passed separately, as in C.
 *  - uint64_t is a Java long (values above 2^63 wrap, as in C casts).
 *  - Options structs are constructed filled with the library's defaults
 *    (their zs_xxx_init), so `size` is right for this header.
 * Functions handing out pointers into engine memory (zs_param_data,
 * zs_param_shard_data, zs_grad_shard_data, zs_optimizer_state_data,
 * zs_optimizer_named_state,
 * zs_param_to_dlpack) and the checkpoint and safetensors functions (their
 * name lists and progress callbacks) are not wrapped: use zs_param_copy_to /
 * zs_param_write for data. Nor is zs_grad_push_many (an array of buffers):
 * zs_grad_push each gradient; nor zs_grad_push_borrowed / zs_grad_released
 * (the engine reads the caller's memory after the call returns, a lifetime
 * a Java array cannot promise): zs_grad_push copies.
 */
%module ZsNative

%{
#include <math.h>
#include <stdlib.h>
#include <zeroshard/zeroshard.h>
%}

/* The JNI library: -Dzeroshard.jni=/path/libzeroshard_java.so, else
 * libzeroshard_java.so from java.library.path. */
%pragma(java) jniclasscode=%{
  static {
    String path = System.getProperty("zeroshard.jni");
    if (path != null) System.load(path);
    else System.loadLibrary("zeroshard_java");
  }
%}

%include "stdint.i"
%include "typemaps.i"
%include "cpointer.i"
%include "carrays.i"
%include "enumsimple.swg"
%javaconst(1);

/* uint64_t as a Java long (SWIG's default is BigInteger). */
%apply long long { uint64_t, unsigned long long };
%apply long long *OUTPUT { uint64_t* shard_numel };
%apply long long *OUTPUT { int64_t* step };
%apply int *OUTPUT { int* rank, int* world_size, int* local_rank, int* local_world_size, int* size,
                     int* world_rank, int* done, int* group_index, int* count, int* same };
%apply double *OUTPUT { double* scale };
%apply int *OUTPUT { zs_param_status* status, zs_device_type* type };
%apply int *OUTPUT { int* major, int* minor, int* patch, int* device_id };

/* const char** outputs (strings the library owns): a String[] of at least
 * one element, set to a copy of the string (null for NULL). */
%typemap(jni) const char** "jobjectArray"
%typemap(jtype) const char** "String[]"
%typemap(jstype) const char** "String[]"
%typemap(javain) const char** "$javainput"
%typemap(in) const char** (const char* temp = NULL) {
  if (!$input || (*jenv)->GetArrayLength(jenv, $input) < 1) {
    SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "a String[] of at least one element is required");
    return $null;
  }
  $1 = ($1_ltype)&temp;
}
%typemap(argout) const char** {
  jstring s_ = temp$argnum ? (*jenv)->NewStringUTF(jenv, temp$argnum) : NULL;
  (*jenv)->SetObjectArrayElement(jenv, $input, 0, s_);
}

/* ---- status -> exception ------------------------------------------------ */
%typemap(jni) zs_status "jint"
%typemap(jtype) zs_status "int"
%typemap(jstype) zs_status "int"
%typemap(javaout) zs_status { return $jnicall; }
/* The status is returned (always ZS_OK to Java); a failure is thrown by the
 * "ret" typemap, which runs after argout and freearg (so string arguments
 * are released first), on the thread whose zs_last_error() it reads. */
%typemap(out) zs_status %{ $result = (jint)$1; %}
%typemap(ret) zs_status {
  if ($1 != ZS_OK) {
    const char* msg_ = zs_last_error();
    jclass cls_ = (*jenv)->FindClass(jenv, "zeroshard/ZeroShardException");
    if (cls_) {
      jmethodID ctor_ = (*jenv)->GetMethodID(jenv, cls_, "<init>", "(ILjava/lang/String;Ljava/lang/String;)V");
      if (ctor_) {
        jstring name_ = (*jenv)->NewStringUTF(jenv, zs_status_string($1));
        jstring text_ = (*jenv)->NewStringUTF(jenv, msg_ ? msg_ : "");
        jobject ex_ = (*jenv)->NewObject(jenv, cls_, ctor_, (jint)$1, name_, text_);
        if (ex_) (*jenv)->Throw(jenv, (jthrowable)ex_);
      }
    }
  }
}

/* ---- buffers: direct ByteBuffers ----------------------------------------- */
%typemap(jni) void*, const void* "jobject"
%typemap(jtype) void*, const void* "java.nio.ByteBuffer"
%typemap(jstype) void*, const void* "java.nio.ByteBuffer"
%typemap(javain) void*, const void* "$javainput"
%typemap(in) void*, const void* {
  $1 = NULL;
  if ($input) {
    $1 = ($1_ltype)(*jenv)->GetDirectBufferAddress(jenv, $input);
    if (!$1) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "a direct ByteBuffer is required");
      return $null;
    }
  }
}
/* Struct fields of type const void* (zs_param_options.data) keep the raw
 * pointer: the caller keeps the buffer alive until the call that reads it. */
%typemap(freearg) void*, const void* ""
/* Such fields are write-only from Java: their getter gives null. */
%typemap(out) void*, const void* %{ $result = 0; (void)$1; %}
%typemap(javaout) void*, const void* { return $jnicall; }

/* ---- handles, handle boxes and param arrays ------------------------------- */
%pointer_functions(zs_context, zs_context_box);
%pointer_functions(zs_group, zs_group_box);
%pointer_functions(zs_param, zs_param_box);
%pointer_functions(zs_gather, zs_gather_box);
%pointer_functions(zs_work, zs_work_box);
%pointer_functions(zs_optimizer, zs_optimizer_box);
%array_functions(zs_param, zs_param_array);
%array_functions(int64_t, int64_array);
%array_functions(int, int_array);

/* ---- options structs start filled with the library's defaults ------------ */
%define ZS_DEFAULTS(T)
%extend T {
  T() {
    T* s = (T*)calloc(1, sizeof(T));
    if (s) T##_init(s, sizeof(T));
    return s;
  }
  ~T() { free($self); }
}
%enddef
ZS_DEFAULTS(zs_context_options)
ZS_DEFAULTS(zs_memory_stats)
ZS_DEFAULTS(zs_fetch_stats)
ZS_DEFAULTS(zs_param_options)
ZS_DEFAULTS(zs_param_info)
ZS_DEFAULTS(zs_optim_hparams)
ZS_DEFAULTS(zs_step_result)
ZS_DEFAULTS(zs_coord_stats)
ZS_DEFAULTS(zs_step_stats)

/* ---- not wrapped (see above) --------------------------------------------- */
%ignore zs_param_data;
%ignore zs_param_shard_data;
%ignore zs_grad_shard_data;
%ignore zs_grad_push_many;
%ignore zs_grad_push_borrowed;
%ignore zs_grad_released;
%ignore zs_optimizer_state_data;
%ignore zs_optimizer_named_state;
%ignore zs_param_to_dlpack;
%ignore zs_checkpoint_save_options;
%ignore zs_checkpoint_load_options;
%ignore zs_checkpoint_info;
%ignore zs_checkpoint_export_options;
%ignore zs_export_options;
%ignore zs_safetensors_load_options;
%ignore zs_checkpoint_save;
%ignore zs_checkpoint_load;
%ignore zs_checkpoint_verify;
%ignore zs_checkpoint_export;
%ignore zs_checkpoint_reshard;
%ignore zs_export_safetensors;
%ignore zs_load_safetensors;
%ignore zs_checkpoint_save_options_init;
%ignore zs_checkpoint_load_options_init;
%ignore zs_checkpoint_info_init;
%ignore zs_checkpoint_export_options_init;
%ignore zs_export_options_init;
%ignore zs_safetensors_load_options_init;
%ignore zs_progress_fn;
%ignore zs_load_pretrained;
%ignore zs_load_pretrained_options;
%ignore zs_load_pretrained_options_init;
%ignore zs_pretrained_options;
%ignore zs_pretrained_options_init;
%ignore zs_export_live;

/* Not the engine: C's sinf (the platform's libm), for programs that must
 * compute bit for bit what a C program computes (TrainMlp against
 * examples/c/train_mlp.c). (float)Math.sin(x) differs from glibc's sinf in
 * the last bit for about 1% of the MLP's inputs. */
%inline %{
float zs_swig_c_sinf(float x) { return sinf(x); }
%}

#define ZS_API
%include <zeroshard/zeroshard.h>
