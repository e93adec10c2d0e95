//! Every CUDA kernel source compiles with NVRTC for Hopper (sm_90a) and Blackwell (sm_100a).
//! Runs on machines without a GPU: NVRTC alone is enough (scripts/test.sh installs it from
//! PyPI), so a kernel that stops compiling fails CI even though CI never runs it.

use lockstep::backend::cuda::kernels::{compile, nvrtc_available, Kernel, Source};

#[test]
fn every_kernel_compiles_for_hopper_and_blackwell() {
    assert!(
        nvrtc_available(),
        "libnvrtc not found: install `nvidia-cuda-nvrtc` (scripts/test.sh does) and put its lib \
         directory on LD_LIBRARY_PATH"
    );
    for arch in ["sm_90a", "sm_100a"] {
        for source in Source::ALL {
            let ptx = compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{source:?}: PTX for {arch}"
            );
            for k in Kernel::ALL.iter().filter(|k| k.source() == source) {
                assert!(
                    ptx.contains(&format!(".entry {}(", k.symbol())),
                    "{k:?}: `{}` missing from the PTX of {}",
                    k.symbol(),
                    source.file_name()
                );
            }
        }
    }
}
