//! Variants of the Qwen3.6-35B-A3B checkpoint found on the hub, and what the
//! loader does with each: conversions that keep the multi-token-prediction
//! head load (the head is reported, not read, not counted); quantisation
//! entries for modules Lily does not load are ignored, those for modules it
//! loads must be what it runs; settings that change the model's math and that
//! Lily does not implement are refused naming field and value; the RMSNorm
//! convention follows the layout whatever the values look like; and a
//! checkpoint without `generation_config.json` still stops at `<|im_end|>`.
//!
//! Every case writes a small checkpoint (`support`) and loads it with
//! `Weights::load`, the path a downloaded checkpoint takes.

mod support;

use std::path::Path;

use lily_core::config::{to_config_json, Format, ModelConfig, QuantSpec};
use lily_core::tensors::DType;
use lily_core::tokenizer::{ENDOFTEXT_ID, IM_END_ID};
use lily_core::weights::{norm_values_warning, NormConvention, UnusedGroup, UnusedKind, Weights};
use serde_json::{json, Value};
use support::{fill_norms, small_config, valid_tensors, write_checkpoint, Raw};

const L: &str = "language_model.model.layers";

/// A bf16 tensor of `n` zeros.
fn zeros(n: usize) -> Raw {
    Raw { dtype: DType::BF16, shape: vec![n], data: vec![0; 2 * n] }
}

/// Writes a valid small checkpoint, then rewrites its config.json with `edit`.
fn dir_with_config(format: Format, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small_config(format);
    write_checkpoint(dir.path(), &cfg, &valid_tensors(&cfg));
    let mut v = to_config_json(&cfg);
    edit(&mut v);
    std::fs::write(dir.path().join("config.json"), v.to_string()).expect("config");
    dir
}

fn load_err(dir: &Path) -> String {
    match Weights::load(dir) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

// ------------------------------------------------ multi-token prediction

#[test]
fn mtp_tensors_under_each_prefix_load_and_are_reported_not_counted() {
    for format in [Format::MlxQ4, Format::HfBf16] {
        let cfg = small_config(format);
        let plain = tempfile::tempdir().expect("tempdir");
        write_checkpoint(plain.path(), &cfg, &valid_tensors(&cfg));
        let base = Weights::load(plain.path()).expect("without MTP");
        assert!(base.unused.is_empty(), "{format:?}: {:?}", base.unused);

        for prefix in ["mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."] {
            let mut tensors = valid_tensors(&cfg);
            let extra = [(format!("{prefix}fc.weight"), 64), (format!("{prefix}layers.0.mlp.gate.weight"), 32), (format!("{prefix}norm.weight"), 16)];
            for (name, n) in &extra {
                tensors.insert(name.clone(), zeros(*n));
            }
            let dir = tempfile::tempdir().expect("tempdir");
            write_checkpoint(dir.path(), &cfg, &tensors);
            let w = Weights::load(dir.path()).unwrap_or_else(|e| panic!("{format:?} with {prefix}*: {e}"));
            assert_eq!(w.unused, vec![UnusedGroup { kind: UnusedKind::Mtp, tensors: 3, bytes: 2 * (64 + 32 + 16) }], "{format:?} {prefix}");
            // Not counted: the model's bytes are those of the checkpoint
            // without the head, though the files hold more.
            assert_eq!(w.model_bytes, base.model_bytes, "{format:?} {prefix}");
            assert_eq!(w.store.data_bytes() as u64, base.model_bytes + 2 * (64 + 32 + 16));
            assert_eq!(w.unused[0].kind.to_string(), "multi-token-prediction (MTP) head");
        }
    }
}

#[test]
fn model_bytes_is_the_tensors_the_model_reads() {
    let cfg = small_config(Format::MlxQ4);
    let tensors = valid_tensors(&cfg);
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg, &tensors);
    let w = Weights::load(dir.path()).expect("loads");
    let want: usize = tensors.values().map(|t| t.data.len()).sum();
    assert_eq!(w.model_bytes, want as u64);
}

#[test]
fn vision_tower_and_mtp_are_reported_separately() {
    let cfg = small_config(Format::MlxQ4);
    let mut tensors = valid_tensors(&cfg);
    tensors.insert("vision_tower.blocks.0.attn.qkv.weight".into(), zeros(8));
    tensors.insert("vision_tower.blocks.0.attn.proj.weight".into(), zeros(8));
    tensors.insert("language_model.mtp.fc.weight".into(), zeros(4));
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg, &tensors);
    let w = Weights::load(dir.path()).expect("loads");
    assert_eq!(
        w.unused,
        vec![UnusedGroup { kind: UnusedKind::VisionTower, tensors: 2, bytes: 32 }, UnusedGroup { kind: UnusedKind::Mtp, tensors: 1, bytes: 8 },]
    );
}

#[test]
fn a_tensor_merely_named_like_mtp_inside_the_model_is_still_unused() {
    // Only the prefixes count: `mtp` deeper in a name is no MTP head.
    let cfg = small_config(Format::MlxQ4);
    let mut tensors = valid_tensors(&cfg);
    let name = format!("{L}.0.mtp.fc.weight");
    tensors.insert(name.clone(), zeros(4));
    let dir = tempfile::tempdir().expect("tempdir");
    write_checkpoint(dir.path(), &cfg, &tensors);
    let err = load_err(dir.path());
    assert!(err.contains(&name) && err.contains("not used"), "{err}");
}

// ------------------------------------------------- quantisation overrides

#[test]
fn overrides_for_modules_lily_does_not_load_are_ignored() {
    for entry in [
        json!(false),
        json!({"bits": 8, "group_size": 32}),
        json!({"bits": 3, "group_size": 128}),
        json!({"bits": 6, "group_size": 0}),
        json!({"bits": "eight"}),
    ] {
        let dir = dir_with_config(Format::MlxQ4, |v| {
            for block in ["quantization", "quantization_config"] {
                v[block]["vision_tower.blocks.0.attn.qkv"] = entry.clone();
                v[block]["vision_tower.merger.mlp.0"] = entry.clone();
                v[block]["language_model.mtp.fc"] = entry.clone();
            }
        });
        let w = Weights::load(dir.path()).unwrap_or_else(|e| panic!("{entry}: {e}"));
        assert_eq!(w.layers.len(), 4);
    }
}

#[test]
fn overrides_for_loaded_modules_must_be_what_lily_runs() {
    let cases: [(&str, Value, &str); 6] = [
        (
            "language_model.model.layers.0.mlp.gate",
            json!({"bits": 4, "group_size": 64}),
            "config: field `quantization.language_model.model.layers.0.mlp.gate`: expected bits 8 \
             with group_size 64 (what Lily runs for this module), found bits 4, group_size 64",
        ),
        (
            "language_model.model.layers.3.self_attn.q_proj",
            json!({"bits": 8, "group_size": 32}),
            "config: field `quantization.language_model.model.layers.3.self_attn.q_proj`: expected \
             bits 4 with group_size 64 (what Lily runs for this module), found bits 8, group_size 32",
        ),
        (
            "language_model.model.layers.1.mlp.shared_expert_gate",
            json!({"bits": 8, "group_size": 128}),
            "config: field `quantization.language_model.model.layers.1.mlp.shared_expert_gate`: \
             expected bits 8 with group_size 64 (what Lily runs for this module), found bits 8, \
             group_size 128",
        ),
        (
            "language_model.model.embed_tokens",
            json!({"bits": 6, "group_size": 64}),
            "config: field `quantization.language_model.model.embed_tokens`: expected bits 4 with \
             group_size 64 (what Lily runs for this module), found bits 6, group_size 64",
        ),
        (
            "language_model.model.layers.2.linear_attn.in_proj_z",
            json!(false),
            "config: field `quantization.language_model.model.layers.2.linear_attn.in_proj_z`: \
             expected bits 4 with group_size 64 (what Lily runs for this module), found no \
             quantisation (`false`, or an entry without integer bits and group_size)",
        ),
        (
            "language_model.lm_head",
            json!({"bits": "4", "group_size": 64}),
            "config: field `quantization.language_model.lm_head`: expected bits 4 with group_size \
             64 (what Lily runs for this module), found no quantisation (`false`, or an entry \
             without integer bits and group_size)",
        ),
    ];
    for (module, entry, want) in cases {
        let dir = dir_with_config(Format::MlxQ4, |v| {
            for block in ["quantization", "quantization_config"] {
                v[block][module] = entry.clone();
            }
        });
        assert_eq!(load_err(dir.path()), want);
    }
}

#[test]
fn a_router_left_at_the_default_bits_is_refused() {
    let dir = dir_with_config(Format::MlxQ4, |v| {
        for block in ["quantization", "quantization_config"] {
            let obj = v[block].as_object_mut().expect("block");
            obj.retain(|k, _| !k.ends_with(".mlp.gate"));
        }
    });
    assert_eq!(
        load_err(dir.path()),
        "config: field `quantization.language_model.model.layers.0.mlp.gate`: expected bits 8 with \
         group_size 64 (what Lily runs for this module), found bits 4, group_size 64 (the block's \
         default)"
    );
}

#[test]
fn overrides_round_trip_through_config_json_untouched() {
    // Ignored entries are kept as written (so a converter writing the config
    // back does not drop them), just never checked.
    let mut cfg = small_config(Format::MlxQ4);
    let q = cfg.quantization.as_mut().expect("mlx");
    q.overrides.insert("vision_tower.patch_embed".into(), None);
    q.overrides.insert("vision_tower.blocks.0.mlp.fc1".into(), Some(QuantSpec { bits: 8, group_size: 32 }));
    let back = ModelConfig::from_json_str(&to_config_json(&cfg).to_string()).expect("parses");
    assert_eq!(back.quantization, cfg.quantization);
}

// ----------------------------------------------- settings Lily does not run

/// A change to `text_config`.
type Edit = fn(&mut Value);

#[test]
fn settings_that_change_the_math_are_refused_naming_field_and_value() {
    let cases: Vec<(Edit, &str)> = vec![
        (
            |t| t["rope_parameters"]["rope_type"] = "yarn".into(),
            "config: field `text_config.rope_parameters.rope_type`: expected \"default\" (Lily \
             implements no rope scaling), found \"yarn\"",
        ),
        (
            |t| t["rope_parameters"]["rope_type"] = "linear".into(),
            "config: field `text_config.rope_parameters.rope_type`: expected \"default\" (Lily \
             implements no rope scaling), found \"linear\"",
        ),
        (
            |t| t["rope_scaling"] = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}),
            "config: field `text_config.rope_scaling.type`: expected \"default\" (Lily implements \
             no rope scaling), found \"yarn\"",
        ),
        (
            |t| t["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0}),
            "config: field `text_config.rope_scaling.rope_type`: expected \"default\" (Lily \
             implements no rope scaling), found \"dynamic\"",
        ),
        (
            |t| t["rope_scaling"] = json!({"factor": 4.0}),
            "config: field `text_config.rope_scaling.factor`: expected no factor (Lily implements \
             no rope scaling), found 4.0",
        ),
        (|t| t["rope_scaling"] = json!("yarn"), "config: field `text_config.rope_scaling`: expected an object or null, found \"yarn\""),
        (
            |t| t["attn_output_gate"] = false.into(),
            "config: field `text_config.attn_output_gate`: expected true (Lily's attention always \
             applies the sigmoid output gate), found false",
        ),
        (
            |t| t["norm_topk_prob"] = false.into(),
            "config: field `text_config.norm_topk_prob`: expected true (Lily always renormalises \
             the top-k routing weights), found false",
        ),
        (
            |t| t["attention_bias"] = true.into(),
            "config: field `text_config.attention_bias`: expected false (Lily's attention \
             projections have no bias), found true",
        ),
        (
            |t| t["hidden_act"] = "gelu".into(),
            "config: field `text_config.hidden_act`: expected \"silu\" (the experts' SwiGLU), \
             found \"gelu\"",
        ),
        (
            |t| t["full_attention_interval"] = 2.into(),
            "config: field `text_config.full_attention_interval`: expected 4 (layer i is attention \
             when i % 4 == 3), found 2",
        ),
        (
            |t| t["mlp_only_layers"] = json!([0]),
            "config: field `text_config.mlp_only_layers`: expected [] (every layer ends in the \
             MoE), found [0]",
        ),
        (
            |t| t["decoder_sparse_step"] = 2.into(),
            "config: field `text_config.decoder_sparse_step`: expected 1 (every layer ends in the \
             MoE), found 2",
        ),
    ];
    for (edit, want) in cases {
        for format in [Format::MlxQ4, Format::HfBf16] {
            let dir = dir_with_config(format, |v| edit(&mut v["text_config"]));
            assert_eq!(load_err(dir.path()), want, "{format:?}");
        }
    }
}

#[test]
fn the_values_lily_implements_are_accepted() {
    let cases: Vec<Edit> = vec![
        |t| t["rope_parameters"]["rope_type"] = "default".into(),
        |t| t["rope_parameters"]["rope_type"] = "mrope".into(),
        |t| t["rope_scaling"] = Value::Null,
        |t| t["rope_scaling"] = json!({"type": "mrope", "mrope_section": [11, 11, 10]}),
        |t| t["rope_scaling"] = json!({"rope_type": "default", "factor": 1.0}),
        |t| {
            t.as_object_mut().expect("text_config").remove("rope_parameters");
        },
        |t| t["attn_output_gate"] = true.into(),
        |t| t["norm_topk_prob"] = true.into(),
        |t| t["attention_bias"] = false.into(),
        |t| t["mlp_only_layers"] = json!([]),
        |t| t["decoder_sparse_step"] = 1.into(),
        |t| {
            let obj = t.as_object_mut().expect("text_config");
            for k in ["attn_output_gate", "hidden_act", "full_attention_interval"] {
                obj.remove(k);
            }
        },
    ];
    for (i, edit) in cases.iter().enumerate() {
        let dir = dir_with_config(Format::MlxQ4, |v| edit(&mut v["text_config"]));
        Weights::load(dir.path()).unwrap_or_else(|e| panic!("case {i}: {e}"));
    }
}

// --------------------------------------------------------- RMSNorm layout

#[test]
fn the_norm_convention_comes_from_the_layout_not_the_values() {
    // Values that look like the other layout's: the layout still decides.
    for (format, stored, want, gain) in [
        (Format::MlxQ4, 0.0f32, NormConvention::Gain, 0.0f32),
        (Format::MlxQ4, 1.0, NormConvention::Gain, 1.0),
        (Format::HfBf16, 1.0, NormConvention::OnePlus, 2.0),
        (Format::HfBf16, 0.0, NormConvention::OnePlus, 1.0),
        (Format::HfBf16, 0.75, NormConvention::OnePlus, 1.75),
    ] {
        let cfg = small_config(format);
        let mut tensors = valid_tensors(&cfg);
        fill_norms(&cfg, &mut tensors, stored);
        let dir = tempfile::tempdir().expect("tempdir");
        write_checkpoint(dir.path(), &cfg, &tensors);
        let w = Weights::load(dir.path()).expect("loads");
        assert_eq!(w.norm_convention, want, "{format:?} stored {stored}");
        assert_eq!(NormConvention::of_layout(format), want);
        for l in &w.layers {
            assert!(l.input_norm.iter().chain(&l.post_norm).all(|&g| g == gain), "{format:?} {stored}");
        }
        assert!(w.final_norm.iter().all(|&g| g == gain));
    }
}

#[test]
fn values_that_disagree_with_the_layout_give_a_warning() {
    assert_eq!(norm_values_warning(Format::MlxQ4, 1.02), None);
    assert_eq!(norm_values_warning(Format::HfBf16, 0.01), None);
    let w = norm_values_warning(Format::MlxQ4, 0.02).expect("MLX values around 0");
    assert!(w.contains("MlxQ4") && w.contains("0.020") && w.contains("using the layout's"), "{w}");
    let w = norm_values_warning(Format::HfBf16, 0.98).expect("BF16 values around 1");
    assert!(w.contains("HfBf16") && w.contains("0.980") && w.contains("OnePlus"), "{w}");
}

// ----------------------------------------------------------------- EOS ids

#[test]
fn without_generation_config_chat_still_stops_at_im_end() {
    // The original release: text_config names only <|endoftext|>, the top
    // level nothing, and there is no generation_config.json.
    let dir = dir_with_config(Format::HfBf16, |v| {
        v.as_object_mut().expect("root").remove("eos_token_id");
        v["text_config"]["eos_token_id"] = ENDOFTEXT_ID.into();
    });
    assert!(!dir.path().join("generation_config.json").exists());
    let w = Weights::load(dir.path()).expect("loads");
    assert!(w.config.eos_token_ids.contains(&IM_END_ID), "{:?}", w.config.eos_token_ids);
    assert!(w.config.eos_token_ids.contains(&ENDOFTEXT_ID), "{:?}", w.config.eos_token_ids);
    assert_eq!(w.config.eos_token_ids.len(), 2);

    // With a generation_config.json naming other ids, <|im_end|> stays.
    std::fs::write(dir.path().join("generation_config.json"), json!({"eos_token_id": [7]}).to_string()).expect("write");
    let cfg = ModelConfig::from_dir(dir.path()).expect("config");
    let mut ids = cfg.eos_token_ids.clone();
    ids.sort_unstable();
    assert_eq!(ids, vec![7, ENDOFTEXT_ID, IM_END_ID]);
}
