//! The systest of git2-rs in miniature: the C compiler's view of the header
//! against this crate's. A C program generated here from the preprocessed
//! header prints every struct's size and alignment, every field's offset
//! and size, and every enum constant's value; Rust's side comes from
//! `size_of`/`align_of`/`offset_of!` over the table below. Every function
//! declared in `src/lib.rs` is compared, argument by argument, with the
//! header's prototype. Anything present on one side only is an error too.
use std::collections::{BTreeMap, BTreeSet};
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use zeroshard_sys::*;

fn size_of_pointee<T>(_: *const T) -> usize {
    size_of::<T>()
}

/// (struct, size, align, [(field, offset, size)]) as Rust lays them out.
macro_rules! rust_structs {
    ($($s:ident { $($f:ident),* $(,)? })*) => {{
        let mut v: Vec<StructLayout> = Vec::new();
        $(
            let u = std::mem::MaybeUninit::<$s>::uninit();
            let p = u.as_ptr();
            v.push((stringify!($s).to_string(), size_of::<$s>(), align_of::<$s>(), vec![$(
                // SAFETY: addr_of! makes no reference to the uninitialised value.
                (stringify!($f).to_string(), offset_of!($s, $f),
                 size_of_pointee(unsafe { std::ptr::addr_of!((*p).$f) })),
            )*]));
        )*
        v
    }};
}

macro_rules! rust_enums {
    ($($c:ident),* $(,)?) => {{
        let mut m = BTreeMap::new();
        $(m.insert(stringify!($c).to_string(), ($c as i64, size_of_pointee(&$c as *const _)));)*
        m
    }};
}

/// (struct, size, align, [(field, offset, size)])
type StructLayout = (String, usize, usize, Vec<(String, usize, usize)>);

fn rust_view() -> (Vec<StructLayout>, BTreeMap<String, (i64, usize)>) {
    let structs = rust_structs! {
        zs_context_options { size, rank, world_size, local_rank, local_world_size, store_host,
            store_port, file_store_path, config_json, config_path, timeout_ms, transport_host,
            device, backend }
        zs_memory_stats { size, shard_bytes, gathered_bytes, peak_gathered_bytes, unsharded_bytes,
            num_params, host_cache_bytes, grad_bytes, optimizer_bytes, hpz_secondary_bytes,
            device_cache_bytes, device_system_allocs, device_reuses, nvme_bytes, loco_error_bytes,
            device_bytes, host_bytes, host_pinned_bytes }
        zs_fetch_stats { size, gathers, hpz_gathers, hierarchical_gathers,
            gather_bytes_sent, gather_bytes_received, quantized_gather_bytes_sent,
            quantized_gather_bytes_received, reduce_scatter_bytes_sent, reduce_scatter_bytes_received,
            quantized_reduce_bytes_sent, quantized_reduce_bytes_received, allreduce_bytes_sent,
            allreduce_bytes_received, other_bytes_sent, other_bytes_received }
        zs_param_options { size, name, dtype, ndim, shape, init, data, data_bytes, src_rank, seed,
            a, b, group }
        zs_param_info { size, name, dtype, ndim, shape, numel, shard_numel, padded_numel,
            shard_offset, shard_valid, status, device_type, device_id, shard_version }
        zs_optim_hparams { size, lr, beta1, beta2, eps, weight_decay, momentum, dampening,
            nesterov, bias_correction, use_muon, ns_method, ns_steps }
        zs_step_result { size, skipped, grad_norm, loss_scale, step }
        zs_checkpoint_save_options { size, tag, user_json, timeout_ms, overwrite, update_latest,
            names, progress, progress_user, async_save }
        zs_checkpoint_load_options { size, tag, strict, names, progress, progress_user }
        zs_checkpoint_info { size, step, bytes_read, dir, user_json }
        zs_checkpoint_export_options { size, tag, fp32, progress, progress_user }
        zs_export_options { size, names, progress, progress_user }
        zs_safetensors_load_options { size, names, strict, from_rank0, progress, progress_user }
        zs_coord_stats { size, steps, fetch_calls, demand_fetches, prefetches, blocked_waits,
            reuse_hits, kept_for_reuse, persistent_params, live_elements, peak_live_elements,
            trace_invalidations, trace_length }
        zs_step_stats { size, step, step_seconds, gather_seconds, gather_bytes, gathers,
            reduce_scatter_seconds, reduce_scatter_bytes, reduce_scatters, allreduce_seconds,
            allreduce_bytes, other_comm_seconds, other_comm_bytes, wait_seconds,
            optimizer_seconds, peer_copy_seconds, peer_copy_bytes, replay_seconds }
    };
    let enums = rust_enums!(
        ZS_OK,
        ZS_ERR_INVALID_ARGUMENT,
        ZS_ERR_INVALID_HANDLE,
        ZS_ERR_INVALID_STATE,
        ZS_ERR_INVALID_CONFIG,
        ZS_ERR_OUT_OF_MEMORY,
        ZS_ERR_TIMEOUT,
        ZS_ERR_COMM,
        ZS_ERR_BOOTSTRAP,
        ZS_ERR_NOT_SUPPORTED,
        ZS_ERR_BUFFER_SIZE,
        ZS_ERR_INTERNAL,
        ZS_ERR_IO,
        ZS_ERR_RANK_LOST,
        ZS_ERR_STATE_LOST,
        ZS_ERR_NOT_TAKEN,
        ZS_STATUS_ENUM_MIN_,
        ZS_STATUS_ENUM_MAX_,
        ZS_FLOAT32,
        ZS_BFLOAT16,
        ZS_FLOAT16,
        ZS_UINT8,
        ZS_DTYPE_ENUM_MIN_,
        ZS_DTYPE_ENUM_MAX_,
        ZS_DEVICE_CPU,
        ZS_DEVICE_CUDA,
        ZS_DEVICE_TYPE_ENUM_MIN_,
        ZS_DEVICE_TYPE_ENUM_MAX_,
        ZS_SUM,
        ZS_AVG,
        ZS_MAX,
        ZS_MIN,
        ZS_REDUCE_OP_ENUM_MIN_,
        ZS_REDUCE_OP_ENUM_MAX_,
        ZS_PARAM_NOT_AVAILABLE,
        ZS_PARAM_INFLIGHT,
        ZS_PARAM_AVAILABLE,
        ZS_PARAM_STATUS_ENUM_MIN_,
        ZS_PARAM_STATUS_ENUM_MAX_,
        ZS_INIT_ZEROS,
        ZS_INIT_FROM_RANK,
        ZS_INIT_FROM_ALL,
        ZS_INIT_NORMAL,
        ZS_INIT_UNIFORM,
        ZS_INIT_ENUM_MIN_,
        ZS_INIT_ENUM_MAX_,
        ZS_GROUP_WORLD,
        ZS_GROUP_PARTITION,
        ZS_GROUP_MICS_SHARD,
        ZS_GROUP_MICS_REPLICA,
        ZS_GROUP_HPZ,
        ZS_GROUP_MICS_INTER,
        ZS_GROUP_MICS_INTRA,
        ZS_GROUP_KIND_ENUM_MIN_,
        ZS_GROUP_KIND_ENUM_MAX_,
        ZS_MEM_SHARDS,
        ZS_MEM_MASTERS,
        ZS_MEM_OPTIMIZER_STATE,
        ZS_MEM_GRADS,
        ZS_MEM_GATHERED,
        ZS_MEM_HPZ_SECONDARY,
        ZS_MEM_REDUCE_BUCKETS,
        ZS_MEM_COMM_STAGING,
        ZS_MEM_SCRATCH,
        ZS_MEM_IO_STAGING,
        ZS_MEM_UNTAGGED,
        ZS_MEM_PEER_COPIES,
        ZS_MEM_INBOXES,
        ZS_MEM_KIND_COUNT,
        ZS_MEM_KIND_ENUM_MIN_,
        ZS_MEM_KIND_ENUM_MAX_,
        ZS_PHASE_NOW,
        ZS_PHASE_CONSTRUCTION,
        ZS_PHASE_FORWARD,
        ZS_PHASE_BACKWARD,
        ZS_PHASE_STEP,
        ZS_PHASE_CHECKPOINT,
        ZS_PHASE_COUNT,
        ZS_PHASE_ENUM_MIN_,
        ZS_PHASE_ENUM_MAX_,
        ZS_HEAL_RANK_STATE,
        ZS_HEAL_SHARED_STATE,
        ZS_HEAL_DONOR_STATE,
        ZS_HEAL_STATE_KIND_ENUM_MIN_,
        ZS_HEAL_STATE_KIND_ENUM_MAX_,
        ZS_COPY_GRAD_INTO_BUCKET,
        ZS_COPY_BUCKET_COMPACTION,
        ZS_COPY_GRAD_ONTO_DEVICE,
        ZS_COPY_INTO_GRAD_SHARD,
        ZS_COPY_WIRE_WIDEN,
        ZS_COPY_MICS_REPLICA,
        ZS_COPY_MASTER_REFRESH,
        ZS_COPY_PARAM_CAST,
        ZS_COPY_GRAD_SPILL,
        ZS_COPY_GROUP_OF_ONE,
        ZS_COPY_GATHER_STAGING,
        ZS_COPY_COMM_STAGING,
        ZS_COPY_OTHER,
        ZS_COPY_KIND_COUNT,
        ZS_COPY_KIND_ENUM_MIN_,
        ZS_COPY_KIND_ENUM_MAX_,
        ZS_COPIES_TOTAL,
        ZS_COPIES_LAST_STEP,
        ZS_COPY_SPAN_ENUM_MIN_,
        ZS_COPY_SPAN_ENUM_MAX_,
        ZS_OPTIM_ADAMW,
        ZS_OPTIM_ADAM,
        ZS_OPTIM_SGD,
        ZS_OPTIM_EXTERNAL,
        ZS_OPTIM_MUON,
        ZS_OPTIM_KIND_ENUM_MIN_,
        ZS_OPTIM_KIND_ENUM_MAX_,
    );
    (structs, enums)
}

// ---------------------------------------------------------------- the header

fn header_path() -> PathBuf {
    PathBuf::from(env!("ZEROSHARD_INCLUDE")).join("zeroshard/zeroshard.h")
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".to_string())
}

/// The header after the preprocessor: no comments, macros expanded.
fn preprocessed() -> String {
    let out = Command::new(cc())
        .args(["-E", "-P", "-DZS_API=", "-x", "c"])
        .arg(header_path())
        .output()
        .expect("running the C compiler (set CC)");
    assert!(
        out.status.success(),
        "cc -E failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    // Only what follows the system headers' contents.
    let start = text
        .find("const char* zs_version")
        .expect("zs_version not in the header");
    let start = text[..start].rfind(';').map_or(0, |i| i + 1).min(start);
    text[start..].to_string()
}

fn squash(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

struct Header {
    /// struct -> field names in order
    structs: Vec<(String, Vec<String>)>,
    /// enum constant names
    enum_constants: Vec<String>,
    /// function -> (return type, [(arg type, arg name)])
    functions: BTreeMap<String, (String, Vec<(String, String)>)>,
}

fn parse_header(text: &str) -> Header {
    let mut structs = Vec::new();
    let mut enum_constants = Vec::new();
    let mut functions = BTreeMap::new();
    let mut rest = text;
    while let Some(i) = rest.find("typedef ") {
        rest = &rest[i + "typedef ".len()..];
        let Some(open) = rest.find('{') else { break };
        let semi = rest.find(';').unwrap();
        if semi < open {
            continue; // typedef struct zs_context_s* zs_context;
        }
        let close = rest.find('}').unwrap();
        let body = &rest[open + 1..close];
        if rest.starts_with("struct ") {
            let name = rest["struct ".len()..open].trim().to_string();
            let mut fields = Vec::new();
            for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
                // "const char* name", "int64_t shape[8]", "double beta1, beta2, eps":
                // the first name follows the type's last space or star.
                let mut parts = decl.split(',');
                let head = parts.next().unwrap();
                let cut = head.rfind([' ', '*']).unwrap();
                for n in std::iter::once(&head[cut + 1..]).chain(parts) {
                    fields.push(n.split('[').next().unwrap().trim().to_string());
                }
            }
            structs.push((name, fields));
        } else if rest.starts_with("enum ") {
            for item in body.split(',').map(str::trim).filter(|d| !d.is_empty()) {
                enum_constants.push(item.split('=').next().unwrap().trim().to_string());
            }
        }
        rest = &rest[close..];
    }
    for decl in text.split(';').map(squash) {
        let decl = decl.trim_start_matches('}').trim().to_string();
        let Some(paren) = decl.find('(') else {
            continue;
        };
        if decl.starts_with("typedef") || !decl.ends_with(')') {
            continue;
        }
        let head = &decl[..paren];
        let Some(name_at) = head
            .find("zs_")
            .filter(|_| head.contains(" zs_") || head.contains("*zs_"))
        else {
            continue;
        };
        let name_at = head.rfind([' ', '*']).map_or(name_at, |i| i + 1);
        let name = head[name_at..].to_string();
        let ret = head[..name_at].trim().to_string();
        let args_text = &decl[paren + 1..decl.len() - 1];
        let mut args = Vec::new();
        if args_text.trim() != "void" {
            for a in args_text.split(',') {
                let a = a.trim();
                let cut = a.rfind([' ', '*']).unwrap();
                args.push((squash(&a[..cut + 1]), a[cut + 1..].to_string()));
            }
        }
        functions.insert(name, (ret, args));
    }
    Header {
        structs,
        enum_constants,
        functions,
    }
}

/// The Rust type this crate must use for a C type of the header.
fn rust_type_of(c: &str) -> String {
    let c = c.replace(" *", "*").replace("struct ", "");
    // "const char* const*": the base type, then what follows each star; a
    // `const` there makes the next pointer out a `*const` (the one after the
    // last star qualifies the outermost pointer itself, which Rust ignores).
    let segments: Vec<&str> = c.trim().split('*').collect();
    let stars = segments.len() - 1;
    let is_const = |seg: &str| seg.split_whitespace().any(|w| w == "const");
    let base = segments[0]
        .split_whitespace()
        .filter(|w| *w != "const")
        .collect::<Vec<_>>()
        .join(" ");
    let base = match base.as_str() {
        "int" => "c_int",
        "size_t" => "usize",
        "double" => "f64",
        "float" => "f32",
        "char" => "c_char",
        "void" => "c_void",
        "int64_t" => "i64",
        "uint64_t" => "u64",
        other => other,
    };
    let mut t = base.to_string();
    for level in 0..stars {
        let pointee_const = is_const(segments[level]);
        t = format!("{}{}", if pointee_const { "*const " } else { "*mut " }, t);
    }
    t
}

/// The `pub fn zs_...(a: T, ...) -> R;` declarations of src/lib.rs's extern block.
fn rust_functions() -> BTreeMap<String, (String, Vec<String>)> {
    let src =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let block = &src[src.find("extern \"C\" {").expect("no extern block")..];
    let code: String = block
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join(" ");
    let mut out = BTreeMap::new();
    // One declaration per `;`, however rustfmt wrapped it.
    for decl in code.split(';').map(squash) {
        let Some(at) = decl.find("pub fn zs_") else {
            continue;
        };
        let line = &decl[at..];
        let name = line["pub fn ".len()..line.find('(').unwrap()].to_string();
        let args_text = &line[line.find('(').unwrap() + 1..line.rfind(')').unwrap()];
        let args = args_text
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| a.split_once(':').unwrap().1.trim().to_string())
            .collect();
        let ret = line.rsplit_once("->").map_or("()".to_string(), |(_, r)| {
            r.trim_end_matches(';').trim().to_string()
        });
        out.insert(name, (ret, args));
    }
    out
}

/// Runs a C program printing the C compiler's view of every struct and enum.
fn c_view(h: &Header) -> BTreeMap<String, i64> {
    let mut prog = String::from(
        "#include <stdalign.h>\n#include <stddef.h>\n#include <stdio.h>\n#include <zeroshard/zeroshard.h>\n\
         #define FSIZE(T, f) sizeof(((T*)0)->f)\nint main(void) {\n",
    );
    for (s, fields) in &h.structs {
        prog += &format!("  printf(\"{s} %zu %zu\\n\", sizeof({s}), alignof({s}));\n");
        for f in fields {
            prog += &format!(
                "  printf(\"{s}.{f} %zu %zu\\n\", offsetof({s}, {f}), FSIZE({s}, {f}));\n"
            );
        }
    }
    for e in &h.enum_constants {
        prog += &format!("  printf(\"{e} %lld %zu\\n\", (long long){e}, sizeof({e}));\n");
    }
    prog += "  return 0;\n}\n";
    let dir = std::env::temp_dir().join(format!("zeroshard-systest-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("layout.c");
    let exe = dir.join("layout");
    std::fs::write(&src, prog).unwrap();
    let include = PathBuf::from(env!("ZEROSHARD_INCLUDE"));
    let cc_out = Command::new(cc())
        .args(["-std=c11", "-Wall", "-Werror", "-I"])
        .arg(&include)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(
        cc_out.status.success(),
        "compiling the layout program: {}",
        String::from_utf8_lossy(&cc_out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success());
    let _ = std::fs::remove_dir_all(&dir);
    let mut view = BTreeMap::new();
    for line in String::from_utf8(run.stdout).unwrap().lines() {
        let mut it = line.split_whitespace();
        let key = it.next().unwrap().to_string();
        let a: i64 = it.next().unwrap().parse().unwrap();
        let b: i64 = it.next().unwrap().parse().unwrap();
        view.insert(format!("{key} #0"), a);
        view.insert(format!("{key} #1"), b);
    }
    view
}

#[test]
fn structs_and_enums_match_the_c_compiler() {
    let header = parse_header(&preprocessed());
    assert!(
        header.structs.len() >= 8 && header.enum_constants.len() >= 40,
        "header parse found too little"
    );
    let c = c_view(&header);
    let (structs, enums) = rust_view();
    let mut errors = Vec::new();

    let rust_names: BTreeSet<&str> = structs.iter().map(|s| s.0.as_str()).collect();
    for (s, fields) in &header.structs {
        let Some((_, size, align, rfields)) = structs.iter().find(|r| &r.0 == s) else {
            errors.push(format!(
                "struct {s} is in the header but not in zeroshard-sys"
            ));
            continue;
        };
        if c[&format!("{s} #0")] != *size as i64 || c[&format!("{s} #1")] != *align as i64 {
            errors.push(format!(
                "{s}: C size/align {}/{}, Rust {size}/{align}",
                c[&format!("{s} #0")],
                c[&format!("{s} #1")]
            ));
        }
        let rnames: Vec<&str> = rfields.iter().map(|f| f.0.as_str()).collect();
        if rnames != fields.iter().map(String::as_str).collect::<Vec<_>>() {
            errors.push(format!("{s}: header fields {fields:?}, Rust {rnames:?}"));
        }
        for (f, off, fsize) in rfields {
            let key = format!("{s}.{f}");
            match (c.get(&format!("{key} #0")), c.get(&format!("{key} #1"))) {
                (Some(&co), Some(&cs)) if co == *off as i64 && cs == *fsize as i64 => {}
                (Some(co), Some(cs)) => errors.push(format!(
                    "{key}: C offset/size {co}/{cs}, Rust {off}/{fsize}"
                )),
                _ => errors.push(format!("{key}: not in the header")),
            }
        }
    }
    for s in rust_names {
        if !header.structs.iter().any(|(n, _)| n == s) {
            errors.push(format!(
                "struct {s} is in zeroshard-sys but not in the header"
            ));
        }
    }
    for e in &header.enum_constants {
        match enums.get(e) {
            None => errors.push(format!(
                "enum constant {e} is in the header but not in zeroshard-sys"
            )),
            Some(&(v, size)) => {
                if c[&format!("{e} #0")] != v || c[&format!("{e} #1")] != size as i64 {
                    errors.push(format!(
                        "{e}: C value {} (size {}), Rust {v} (size {size})",
                        c[&format!("{e} #0")],
                        c[&format!("{e} #1")]
                    ));
                }
            }
        }
    }
    for e in enums.keys() {
        if !header.enum_constants.contains(e) {
            errors.push(format!(
                "enum constant {e} is in zeroshard-sys but not in the header"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "zeroshard-sys differs from the header:\n  {}",
        errors.join("\n  ")
    );
    println!(
        "{} structs ({} fields), {} enum constants match",
        header.structs.len(),
        header.structs.iter().map(|s| s.1.len()).sum::<usize>(),
        header.enum_constants.len()
    );
}

#[test]
fn functions_match_the_header() {
    let header = parse_header(&preprocessed());
    let rust = rust_functions();
    assert!(
        header.functions.len() >= 70,
        "found only {} functions in the header",
        header.functions.len()
    );
    let mut errors = Vec::new();
    for (name, (ret, args)) in &header.functions {
        let Some((rret, rargs)) = rust.get(name) else {
            errors.push(format!(
                "{name} is declared in the header but not in zeroshard-sys"
            ));
            continue;
        };
        if rust_type_of(ret) != *rret {
            errors.push(format!(
                "{name}: returns {ret} in C, so {} in Rust, not {rret}",
                rust_type_of(ret)
            ));
        }
        if args.len() != rargs.len() {
            errors.push(format!(
                "{name}: {} arguments in C, {} in Rust",
                args.len(),
                rargs.len()
            ));
            continue;
        }
        for (i, ((cty, cname), rty)) in args.iter().zip(rargs).enumerate() {
            if rust_type_of(cty) != *rty {
                errors.push(format!(
                    "{name}: argument {i} ({cname}) is {cty} in C, so {} in Rust, not {rty}",
                    rust_type_of(cty)
                ));
            }
        }
    }
    for name in rust.keys() {
        if !header.functions.contains_key(name) {
            errors.push(format!(
                "{name} is declared in zeroshard-sys but not in the header"
            ));
        }
    }
    assert!(
        errors.is_empty(),
        "zeroshard-sys differs from the header:\n  {}",
        errors.join("\n  ")
    );
    println!("{} functions match", header.functions.len());
}

#[test]
fn type_mapping_is_what_the_check_assumes() {
    // The mapping the function check relies on, on the shapes the header uses.
    assert_eq!(rust_type_of("const char*"), "*const c_char");
    assert_eq!(rust_type_of("const char**"), "*mut *const c_char");
    assert_eq!(rust_type_of("const char* const*"), "*const *const c_char");
    assert_eq!(rust_type_of("zs_progress_fn"), "zs_progress_fn");
    assert_eq!(rust_type_of("zs_context*"), "*mut zs_context");
    assert_eq!(rust_type_of("const zs_param*"), "*const zs_param");
    assert_eq!(
        rust_type_of("struct DLManagedTensor**"),
        "*mut *mut DLManagedTensor"
    );
    assert_eq!(rust_type_of("size_t"), "usize");
}

#[test]
fn init_functions_give_the_macros_values() {
    // Spot checks against the header's macros (the C side of this is
    // tests/abi_sizes_test.cpp): the library fills `size` and the defaults.
    let o = zs_context_options::new();
    assert_eq!(o.size, size_of::<zs_context_options>());
    assert_eq!(
        (o.rank, o.world_size, o.store_port, o.timeout_ms),
        (-1, -1, -1, 0)
    );
    let h = zs_optim_hparams::new();
    assert_eq!(
        (h.lr, h.beta1, h.beta2, h.eps, h.bias_correction),
        (1e-3, 0.9, 0.999, 1e-8, 1)
    );
    let r = zs_step_result::new();
    assert_eq!(r.loss_scale, 1.0);
    let s = zs_checkpoint_save_options::new();
    assert_eq!(s.size, size_of::<zs_checkpoint_save_options>());
    assert_eq!((s.overwrite, s.update_latest, s.async_save), (0, 1, 0));
    assert!(s.tag.is_null() && s.names.is_null() && s.progress.is_none());
    assert_eq!(zs_checkpoint_load_options::new().strict, 1);
    let l = zs_safetensors_load_options::new();
    assert_eq!((l.strict, l.from_rank0), (1, 0));
}
