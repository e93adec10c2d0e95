//! The `lockstep` command line: parse, build a config, call into the library.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use lockstep::quant::{ErrorMetric, FourOverSix, Recipe};
use lockstep::quantize::{QuantFormat, QuantizeOptions};

#[derive(Parser)]
#[command(
    name = "lockstep",
    version,
    about = "MoE serving for RL rollouts and a trainer that share one low-precision contract"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model over HTTP (SGLang-native /generate and the OpenAI API).
    Serve(Box<lockstep::serve::ServeArgs>),
    /// Load-test a server (lockstep, SGLang or vLLM) with bench_serving's metrics.
    Bench(Box<lockstep::bench::BenchArgs>),
    /// Quantize every 2-D tensor of a safetensors file under one format (the contract as a tool).
    Quantize(QuantizeArgs),
    /// Convert a Hugging Face checkpoint (BF16 or block FP8) to MXFP8/NVFP4 following a recipe.
    Convert(ConvertArgs),
    /// Push a checkpoint to running servers as a live weight update (verified by checksum).
    Push(Box<lockstep::push::args::PushArgs>),
    /// GRPO on a verifiable task against running servers, pushing weights after every step.
    Train(Box<lockstep::train::TrainArgs>),
}

#[derive(clap::Args)]
struct QuantizeArgs {
    #[arg(long, value_enum)]
    format: QuantFormat,
    /// NVFP4: per block, keep the better of max->6 and max->4.
    #[arg(long)]
    four_over_six: bool,
    /// Four-over-six: the E4M3 range the global scale targets.
    #[arg(long, default_value_t = 256.0, value_parser = parse_fos_range)]
    four_over_six_range: f32,
    /// Four-over-six: compare squared instead of absolute errors.
    #[arg(long)]
    four_over_six_squared: bool,
    /// MXFP8: 32x1 blocks along dim 0 instead of 1x32 along the last dim.
    #[arg(long)]
    columnwise: bool,
    #[arg(long)]
    input: PathBuf,
    #[arg(long)]
    output: PathBuf,
}

#[derive(clap::Args)]
struct ConvertArgs {
    /// Hugging Face checkpoint directory (config.json + safetensors, single or sharded).
    #[arg(long)]
    input: PathBuf,
    /// Output directory (must not exist or be empty).
    #[arg(long)]
    output: PathBuf,
    /// Precision recipe YAML, e.g. configs/nvfp4.yaml or configs/mxfp8.yaml.
    #[arg(long)]
    recipe: PathBuf,
    /// Largest output shard in MiB.
    #[arg(long, default_value_t = 4096)]
    max_shard_mb: usize,
}

fn parse_fos_range(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(v) if v == 256.0 || v == 448.0 => Ok(v),
        _ => Err(format!("`{s}`: expected 256 or 448")),
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Bench(a) => {
            let report = lockstep::bench::run_blocking(*a)?;
            lockstep::bench::print_report(&report);
        }
        Command::Serve(a) => {
            init_logging(&a.log_level);
            if let Some(n) = a.threads {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build_global()
                    .context("--threads")?;
            }
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            runtime.block_on(lockstep::serve::run(*a))?;
        }
        Command::Quantize(a) => {
            let four_over_six = a.four_over_six.then_some(FourOverSix {
                e4m3_range: a.four_over_six_range,
                metric: if a.four_over_six_squared {
                    ErrorMetric::Squared
                } else {
                    ErrorMetric::Absolute
                },
            });
            let opts = QuantizeOptions {
                format: a.format,
                four_over_six,
                columnwise: a.columnwise,
            };
            let n = lockstep::quantize::quantize_file(&a.input, &a.output, &opts)
                .with_context(|| format!("quantizing {}", a.input.display()))?;
            eprintln!("quantized {n} tensors -> {}", a.output.display());
        }
        Command::Push(a) => {
            init_logging("warn");
            let opts = a.options()?;
            let report = lockstep::push::run_blocking(&opts, &a.checkpoint)
                .with_context(|| format!("pushing {}", a.checkpoint.display()))?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            }
            eprint!("{}", report.render());
        }
        Command::Train(a) => {
            let mut trainer = lockstep::train::Trainer::new(*a)?;
            let steps = trainer.run(true)?;
            eprintln!(
                "trained {} steps; metrics in {}",
                steps.len(),
                trainer.args.metrics.display()
            );
        }
        Command::Convert(a) => {
            let recipe = Recipe::from_file(&a.recipe)?;
            let opts = lockstep::convert::ConvertOptions {
                input: &a.input,
                output: &a.output,
                recipe: &recipe,
                max_shard_bytes: a.max_shard_mb << 20,
                progress: true,
            };
            let report = lockstep::convert::convert(&opts)
                .with_context(|| format!("converting {}", a.input.display()))?;
            eprintln!(
                "converted {} -> {} tensors ({:.1} MiB) into {}; linear weights by format: {:?}",
                report.tensors_in,
                report.tensors_out,
                report.bytes_out as f64 / (1 << 20) as f64,
                a.output.display(),
                report.weights_by_format
            );
        }
    }
    Ok(())
}

fn init_logging(level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(format!("lockstep={level},tower_http={level}"))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .init();
}
