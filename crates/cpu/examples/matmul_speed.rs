//! Times the fast products on packed 4-bit codes at the model's shapes,
//! without a checkpoint: writes one random MLX-quantised matrix per shape to
//! a temp file, maps it, and reports weight bytes read per second for a
//! decode-sized (n = 1) and a prefill-sized (n = 64) call.
//!
//! `cargo run --release -p lily-cpu --example matmul_speed`

use std::time::Instant;

use lily_core::config::QuantSpec;
use lily_core::tensors::{DType, TensorStore};
use lily_core::weights::{Linear, QuantLinear};
use lily_cpu::fast::matmul::Mat;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("lily-matmul-speed-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    // (rows, cols, label): an expert's gate/up, in_proj_qkv, and lm_head.
    let shapes = [(512usize, 2048usize, "expert gate 512x2048"), (8192, 2048, "in_proj_qkv 8192x2048"), (248_320, 2048, "lm_head 248320x2048")];
    for (rows, cols, label) in shapes {
        let path = dir.join("m.safetensors");
        let words = rows * cols / 8;
        let groups = rows * cols / 64;
        // Pseudo-random codes and plausible scales; values do not matter for speed.
        let mut state = 0x9e3779b97f4a7c15u64;
        let codes: Vec<u8> = (0..words)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state as u32).to_le_bytes()
            })
            .collect();
        let half: Vec<u8> = (0..groups).flat_map(|i| half::bf16::from_f32(0.01 + (i % 7) as f32 * 1e-3).to_le_bytes()).collect();
        let views = vec![
            ("m.weight".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::U32, vec![rows, cols / 8], &codes)?),
            ("m.scales".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![rows, cols / 64], &half)?),
            ("m.biases".to_string(), safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![rows, cols / 64], &half)?),
        ];
        safetensors::serialize_to_file(views, None, &path)?;
        let store = TensorStore::open_files(std::slice::from_ref(&path))?;
        let lin = Linear::Quant(QuantLinear {
            spec: QuantSpec { bits: 4, group_size: 64 },
            experts: 1,
            rows,
            cols,
            codes: store.take("m.weight", &[DType::U32], &[rows, cols / 8])?,
            scales: store.take("m.scales", &[DType::BF16], &[rows, cols / 64])?,
            biases: store.take("m.biases", &[DType::BF16], &[rows, cols / 64])?,
        });
        let mat = Mat::new(&lin)?;
        let bytes = (words * 4 + groups * 4) as f64;
        for n in [1usize, 4, 64] {
            let x: Vec<f32> = (0..n * cols).map(|i| ((i % 17) as f32 - 8.0) * 0.1).collect();
            let mut y = vec![0f32; n * rows];
            mat.matmul(0, &x, n, &mut y); // warm-up (page in the file)
            let reps = ((2e9 / bytes) as usize).clamp(2, 2000) / n.max(1) + 1;
            let t = Instant::now();
            for _ in 0..reps {
                mat.matmul(0, &x, n, &mut y);
            }
            let dt = t.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{label:28} n={n:3}: {:8.3} ms/call, {:6.2} GB/s of weights, {:7.2} GFLOP/s",
                dt * 1e3,
                bytes / dt / 1e9,
                2.0 * (rows * cols * n) as f64 / dt / 1e9
            );
        }
        drop(store);
        std::fs::remove_file(&path)?;
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
