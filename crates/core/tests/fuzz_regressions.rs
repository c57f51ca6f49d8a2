//! Inputs found by the fuzz targets in fuzz/ (scripts/fuzz.sh) that once
//! crashed or misbehaved, kept as ordinary tests so they stay fixed. Each
//! test names its target and what went wrong.

use lily_core::config::{mlx_quantization, production, to_config_json, ShapeClass};
use lily_core::ModelConfig;
use serde_json::Value;

fn prod_json() -> Value {
    let mut cfg = production();
    cfg.quantization = Some(mlx_quantization(&cfg));
    to_config_json(&cfg)
}

fn refused(v: &Value) -> String {
    match ModelConfig::from_json_str(&v.to_string()) {
        Ok(cfg) => panic!("accepted: {cfg:?}"),
        Err(e) => e.to_string(),
    }
}

/// config_json: `2 * linear_num_key_heads` overflowed (a panic with debug
/// assertions, a wrong comparison without).
#[test]
fn huge_linear_key_heads_is_an_error_not_an_overflow() {
    let mut v = prod_json();
    v["text_config"]["linear_num_key_heads"] = 15_926_174_613_139_095_348u64.into();
    let err = refused(&v);
    assert!(err.contains("linear_num_value_heads"), "{err}");

    let mut v = prod_json();
    v["text_config"]["num_key_value_heads"] = u64::MAX.into();
    let err = refused(&v);
    assert!(err.contains("num_attention_heads"), "{err}");
}

/// config_json: rms_norm_eps 9.3e79 became inf as f32, was accepted, and
/// `to_config_json` wrote it as null.
#[test]
fn rms_norm_eps_must_fit_f32_and_be_positive() {
    for eps in [Value::from(9.301706296574047e79), Value::from(0), Value::from(-1e-6)] {
        let mut v = prod_json();
        v["text_config"]["rms_norm_eps"] = eps.clone();
        let err = refused(&v);
        assert!(err.contains("rms_norm_eps"), "{eps}: {err}");
    }
}

#[test]
fn rope_theta_must_be_positive() {
    // A test shape (production rope_theta is pinned separately).
    let mut v: Value = serde_json::from_str(include_str!("../../../tests/fixtures/tiny/mlx-q4/config.json")).unwrap();
    v["text_config"]["rope_parameters"]["rope_theta"] = (-5.0).into();
    let err = refused(&v);
    assert!(err.contains("rope_theta"), "{err}");
}

/// Test shapes were bounded only in hidden size and experts, so a
/// config.json with 2^62 layers or a 2^40 vocabulary was accepted and every
/// size derived from it (tensor shapes, layer loops) could overflow or run
/// for ever. No dimension may exceed the real model's now.
#[test]
fn no_dimension_may_exceed_the_real_model() {
    let tiny: Value = serde_json::from_str(include_str!("../../../tests/fixtures/tiny/mlx-q4/config.json")).unwrap();
    assert_eq!(ModelConfig::from_json_str(&tiny.to_string()).unwrap().shape_class, ShapeClass::Test);
    for (field, value) in [
        ("num_hidden_layers", 1u64 << 62),
        ("vocab_size", 1 << 40),
        ("head_dim", 1 << 40),
        ("max_position_embeddings", u64::MAX),
        ("moe_intermediate_size", 1 << 33),
    ] {
        let mut v = tiny.clone();
        v["text_config"][field] = value.into();
        if field == "num_hidden_layers" {
            v["text_config"]["layer_types"] = Value::Null;
        }
        if field == "moe_intermediate_size" {
            v["text_config"]["shared_expert_intermediate_size"] = value.into();
        }
        let err = refused(&v);
        assert!(err.contains(field), "{field}: {err}");
    }
}

/// An EOS id past u32 was truncated into some other token id.
#[test]
fn eos_ids_past_u32_are_refused() {
    let mut v = prod_json();
    v["eos_token_id"] = ((1u64 << 32) + 248_046).into();
    assert!(refused(&v).contains("eos_token_id"));
    let mut v = prod_json();
    v["text_config"]["eos_token_id"] = serde_json::json!([248_046, 1u64 << 40]);
    assert!(refused(&v).contains("eos_token_id"));
}
