//! Where libzeroshard.so is: $ZEROSHARD_LIB_DIR, else what
//! `pkg-config --libs zeroshard` says (an installed zeroshard). The folder
//! is passed on to dependents as DEP_ZEROSHARD_LIB_DIR (for their rpath),
//! and the header's folder as DEP_ZEROSHARD_INCLUDE (for the layout test).
use std::env;
use std::path::PathBuf;
use std::process::Command;

fn pkg_config(arg: &str) -> Option<String> {
    let out = Command::new("pkg-config")
        .args([arg, "zeroshard"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=ZEROSHARD_LIB_DIR");
    println!("cargo:rerun-if-env-changed=ZEROSHARD_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let source_include = manifest.join("../../../include");

    let (lib_dir, include) = if let Ok(dir) = env::var("ZEROSHARD_LIB_DIR") {
        let include = env::var("ZEROSHARD_INCLUDE_DIR")
            .map(PathBuf::from)
            .unwrap_or(source_include);
        (PathBuf::from(dir), include)
    } else if let Some(libs) = pkg_config("--libs") {
        let dir = libs
            .split_whitespace()
            .find_map(|f| f.strip_prefix("-L"))
            .map(PathBuf::from)
            .unwrap_or_else(|| panic!("pkg-config --libs zeroshard gave no -L folder: '{libs}'"));
        let cflags = pkg_config("--cflags").unwrap_or_default();
        let include = cflags
            .split_whitespace()
            .find_map(|f| f.strip_prefix("-I"))
            .map(PathBuf::from)
            .unwrap_or(source_include);
        (dir, include)
    } else {
        panic!(
            "libzeroshard not found: set ZEROSHARD_LIB_DIR to the folder of libzeroshard.so \
             (a build tree's build/lib), or install zeroshard where pkg-config finds zeroshard.pc"
        );
    };
    if !lib_dir.join("libzeroshard.so").exists() {
        panic!(
            "{} has no libzeroshard.so (ZEROSHARD_LIB_DIR or pkg-config)",
            lib_dir.display()
        );
    }
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=zeroshard");
    println!("cargo:lib_dir={}", lib_dir.display());
    println!("cargo:include={}", include.display());
    // This crate's own tests load the library too.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    println!("cargo:rustc-env=ZEROSHARD_INCLUDE={}", include.display());
}
