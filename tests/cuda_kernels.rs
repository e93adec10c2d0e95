//! Every CUDA kernel source compiles with NVRTC for Hopper (sm_90a), Blackwell (sm_100a) and the
//! generic target of every other GPU (sm_80), and every kernel's declared parameters
//! (`Kernel::params`, what each launch is checked against) are the ones its PTX `.entry` takes. Runs on machines without a GPU: NVRTC alone is enough
//! (scripts/test.sh installs it from PyPI), so a kernel that stops compiling, or whose
//! parameters change in the .cu but not in the registry, fails CI even though CI never runs it.

use lockstep::backend::cuda::kernels::{
    compile, nvrtc_available, ptx_entry_params, signature_mismatch, Kernel, Param, Source,
};

#[test]
fn every_kernel_compiles_for_every_target_with_its_declared_parameters() {
    assert!(
        nvrtc_available(),
        "libnvrtc not found: install `nvidia-cuda-nvrtc` (scripts/test.sh does) and put its lib \
         directory on LD_LIBRARY_PATH"
    );
    let mut mismatches = Vec::new();
    // sm_80: what every GPU but Hopper and Blackwell gets (`kernels::arch_for`), where a block's
    // static shared memory stops at 48 KB (the arch-specific targets take more).
    for arch in ["sm_90a", "sm_100a", "sm_80"] {
        for source in Source::ALL {
            let ptx = compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                ptx.contains(&format!(".target {arch}")),
                "{source:?}: PTX for {arch}"
            );
            for &k in Kernel::ALL.iter().filter(|k| k.source() == source) {
                let params = ptx_entry_params(&ptx, k.symbol()).unwrap_or_else(|| {
                    panic!(
                        "{k:?}: `{}` missing from the PTX of {}",
                        k.symbol(),
                        source.file_name()
                    )
                });
                if let Some(m) = signature_mismatch(k, k.params(), &params) {
                    mismatches.push(format!("{arch}: {m}"));
                }
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "kernel parameters declared in src/backend/cuda/kernels.rs differ from the kernels:\n{}",
        mismatches.join("\n")
    );
}

#[test]
fn a_changed_signature_is_reported_with_the_kernel_name() {
    let (k, declared) = (Kernel::AddInplace, &[Param::Ptr, Param::Ptr, Param::U64]);
    assert_eq!(
        signature_mismatch(k, declared, &[".u64", ".u64", ".u64"]),
        None
    );
    let extra = signature_mismatch(k, declared, &[".u64", ".u64", ".u64", ".u32"]).unwrap();
    assert!(
        extra.contains("AddInplace") && extra.contains("add_inplace"),
        "{extra}"
    );
    let kind = signature_mismatch(k, declared, &[".u64", ".u64", ".f32"]).unwrap();
    assert!(kind.contains("parameter 2"), "{kind}");
}
