//! CI gate: every kernel family compiles with NVRTC for sm_90a, for the
//! production shape and for the test shapes (the tiny fixture and the tiny
//! synth preset), with no GPU. NVRTC comes from the machine (CUDA toolkit)
//! or from the pip wheel `nvidia-cuda-nvrtc`; when it is missing the test
//! fails and says how to install it.

use lily_core::config::{production, Format};
use lily_core::ModelConfig;
use lily_cuda::dims::Dims;
use lily_cuda::kernels::{compile_family, Family, FAMILIES};
use lily_cuda::nvrtc;

fn fixture_config() -> ModelConfig {
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny/mlx-q4");
    let dir = if built.is_dir() { built } else { std::path::PathBuf::from("tests/fixtures/tiny/mlx-q4") };
    ModelConfig::from_dir(&dir).expect("tiny fixture config")
}

fn shapes() -> Vec<(&'static str, Dims)> {
    let prod = Dims::from_config(&production()).expect("production dims");
    let tiny_fixture = Dims::from_config(&fixture_config()).expect("fixture dims");
    let tiny_synth = Dims::from_config(&lily_synth::preset_config(lily_synth::Preset::Tiny, None, Format::MlxQ4).expect("preset")).expect("synth tiny dims");
    vec![("production", prod), ("tiny fixture", tiny_fixture), ("tiny synth preset", tiny_synth)]
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if let Err(e) = nvrtc::ensure_nvrtc() {
        panic!("{e}");
    }
    let (major, minor) = nvrtc::version().expect("nvrtc version");
    eprintln!("NVRTC {major}.{minor}, target {}", nvrtc::ARCH);
    let mut failures = Vec::new();
    for (label, dims) in shapes() {
        for f in FAMILIES {
            match compile_family(f, &dims, &[]) {
                Ok(c) => {
                    assert!(!c.cubin.is_empty(), "{}: empty cubin", f.name);
                    if !c.log.trim().is_empty() {
                        eprintln!("{label} {}.cu log:\n{}", f.name, c.log);
                    }
                }
                Err(e) => failures.push(format!("{label}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "kernel compile failures:\n{}", failures.join("\n"));
}

#[test]
fn kernels_spill_no_registers_at_the_production_shape() {
    nvrtc::ensure_nvrtc().expect("NVRTC");
    let dims = Dims::from_config(&production()).expect("dims");
    let mut spills = Vec::new();
    for f in FAMILIES {
        let c = compile_family(f, &dims, &["--ptxas-options=-v".to_string()]).expect("compiles");
        let mut kernel = String::new();
        for line in c.log.lines() {
            if let Some(i) = line.find("Compiling entry function '") {
                kernel = line[i + 26..].split('\'').next().unwrap_or("").to_string();
            }
            if line.contains("bytes spill stores") && !line.contains(" 0 bytes spill stores") {
                spills.push(format!("{}.cu {kernel}: {}", f.name, line.trim()));
            }
        }
    }
    assert!(spills.is_empty(), "register spills:\n{}", spills.join("\n"));
}

#[test]
fn shapes_the_kernels_cannot_run_are_refused_by_name() {
    let mut cfg = fixture_config();
    cfg.linear_key_head_dim = 48;
    cfg.linear_value_head_dim = 48;
    let err = Dims::from_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("linear_key_head_dim") && err.contains("48"), "{err}");
    let mut cfg = fixture_config();
    cfg.moe_intermediate_size = 96;
    cfg.shared_expert_intermediate_size = 96;
    let err = Dims::from_config(&cfg).unwrap_err().to_string();
    assert!(err.contains("moe_intermediate_size"), "{err}");
}

#[test]
fn defines_carry_every_dimension_once() {
    let dims = Dims::from_config(&production()).expect("dims");
    let defs = dims.defines();
    for name in
        ["HIDDEN", "VOCAB", "GK_HEADS", "GV_HEADS", "GK_DIM", "A_HEADS", "A_HEAD_DIM", "ROT_DIM", "N_EXPERTS", "TOPK", "MOE_INTER", "KV_BLOCK", "RMS_EPS"]
    {
        let n = defs.iter().filter(|d| d.starts_with(&format!("-D{name}="))).count();
        assert_eq!(n, 1, "{name} defined {n} times in {defs:?}");
    }
    for name in ["SAMPLE_THREADS", "SAMPLE_TOP_MAX", "SAMPLE_ROW_BYTES", "SAMPLE_PARAMS_BYTES"] {
        let n = defs.iter().filter(|d| d.starts_with(&format!("-D{name}="))).count();
        assert_eq!(n, 1, "{name} defined {n} times in {defs:?}");
    }
    assert!(defs.contains(&"-DHIDDEN=2048".to_string()));
    assert!(defs.contains(&"-DROT_DIM=64".to_string()));
}

#[test]
fn a_drifted_sampler_layout_fails_to_compile() {
    // Two fields of SampleRow swapped in the kernel only: same size, other
    // offsets, which the static_asserts against sampling::defines() catch.
    nvrtc::ensure_nvrtc().expect("NVRTC");
    let dims = Dims::from_config(&production()).expect("dims");
    let f = FAMILIES.iter().find(|f| f.name == "sampling").expect("sampling family");
    let swapped = f.source.replace("    float top_p;\n    float min_p;\n", "    float min_p;\n    float top_p;\n");
    assert_ne!(swapped, f.source, "test setup: SampleRow's fields not found");
    let drifted = Family { name: f.name, source: Box::leak(swapped.into_boxed_str()), kernels: f.kernels };
    match compile_family(&drifted, &dims, &[]) {
        Ok(_) => panic!("a SampleRow with swapped fields compiled"),
        Err(e) => assert!(e.to_string().contains("SampleRow.top_p"), "{e}"),
    }
}

#[test]
fn a_drifted_feed_layout_fails_to_compile() {
    // Two pointers of FeedStageParams swapped in the kernel only.
    nvrtc::ensure_nvrtc().expect("NVRTC");
    let dims = Dims::from_config(&production()).expect("dims");
    let f = FAMILIES.iter().find(|f| f.name == "feed").expect("feed family");
    let swapped = f
        .source
        .replacen("    const int* in_pos;", "    const int* in_slot_;", 1)
        .replacen("    const int* in_slot;", "    const int* in_pos;", 1)
        .replacen("in_slot_;", "in_slot;", 1);
    assert_ne!(swapped, f.source, "test setup: FeedStageParams's fields not found");
    let drifted = Family { name: f.name, source: Box::leak(swapped.into_boxed_str()), kernels: f.kernels };
    match compile_family(&drifted, &dims, &[]) {
        Ok(_) => panic!("a FeedStageParams with swapped fields compiled"),
        Err(e) => assert!(e.to_string().contains("FeedStageParams.in_"), "{e}"),
    }
}

#[test]
fn a_router_layout_past_router_smem_fails_to_compile() {
    // The plan's selection bitmap grown in the kernel only: qmm.rs
    // router_smem (ROUTER_SMEM) no longer covers it, which the static_assert
    // next to the router catches.
    nvrtc::ensure_nvrtc().expect("NVRTC");
    let dims = Dims::from_config(&production()).expect("dims");
    let f = FAMILIES.iter().find(|f| f.name == "qmm").expect("qmm family");
    let grown = f.source.replacen("#define ROUTER_SEL_WORDS ((QMM_MAX_TOK * TOPK + 31) / 32)", "#define ROUTER_SEL_WORDS (8 * QMM_MAX_TOK * TOPK / 32)", 1);
    assert_ne!(grown, f.source, "test setup: ROUTER_SEL_WORDS not found");
    let drifted = Family { name: f.name, source: Box::leak(grown.into_boxed_str()), kernels: f.kernels };
    match compile_family(&drifted, &dims, &[]) {
        Ok(_) => panic!("a router layout larger than router_smem compiled"),
        Err(e) => assert!(e.to_string().contains("router_smem"), "{e}"),
    }
}
