//! Tests and examples of this crate find libzeroshard.so where
//! zeroshard-sys found it (DEP_ZEROSHARD_LIB_DIR), without LD_LIBRARY_PATH.
fn main() {
    // zeroshard-sys's build script always sets it (or fails the build).
    if let Ok(dir) = std::env::var("DEP_ZEROSHARD_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        // zsrun beside the library's build tree (build/lib -> build/bin),
        // for the multi-rank tests; ZSRUN overrides it at run time.
        println!("cargo:rustc-env=ZEROSHARD_BUILD_LIB_DIR={dir}");
    }
}
