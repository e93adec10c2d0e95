//! The GRPO loop: warm up on task answers, push, then per step sample groups from the servers,
//! score them, take one AdamW step on the clipped policy-gradient loss and push the new weights.

use std::collections::BTreeMap;
use std::time::Instant;

use safetensors::tensor::TensorView;

use super::args::TrainArgs;
use super::client::{RolloutRequest, Sample, Server};
use super::grpo::{self, PgConfig};
use super::metrics::{MetricsWriter, StepMetrics};
use super::optim::{AdamW, AdamWConfig};
use super::params::{Params, ServingPrecision};
use super::policy::{self, Sequence};
use super::tasks::Problem;
use super::TrainError;
use crate::backend::cpu::attention::KvDtype;
use crate::checkpoint::OwnedTensor;
use crate::model::loader::serving_recipe;
use crate::model::ModelConfig;
use crate::push::client::RetryPolicy;
use crate::push::PushOptions;
use crate::quant::Recipe;

/// The embedded model's KV cache dtype on the server (`--kv-cache-dtype auto`, BF16 weights).
const KV_DTYPE: KvDtype = KvDtype::Bf16;

fn seed_of(seed: u64, step: usize, prompt: usize, sample: usize) -> u64 {
    // Small enough for any JSON reader; distinct per (step, prompt, sample).
    (seed.wrapping_mul(1_000_003) ^ ((step as u64) << 32 | (prompt as u64) << 16 | sample as u64))
        % (1 << 52)
}

fn mean_std(x: &[f32]) -> (f64, f64) {
    let n = x.len().max(1) as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// The trainer's state across steps.
pub struct Trainer {
    pub args: TrainArgs,
    pub recipe: Recipe,
    pub params: Params,
    opt: AdamW,
    servers: Vec<Server>,
    rt: tokio::runtime::Runtime,
    reference: Option<crate::model::Model>,
    version: u64,
    push_opts: PushOptions,
}

impl Trainer {
    pub fn new(args: TrainArgs) -> Result<Trainer, TrainError> {
        let recipe_file = args.recipe.as_deref().map(Recipe::from_file).transpose()?;
        let recipe = serving_recipe(Some(args.quantization), None, recipe_file)?;
        let cfg = ModelConfig::from_json(
            serde_json::from_str(crate::serve::EMBEDDED_CONFIG).expect("embedded config"),
        )
        .map_err(crate::model::loader::LoadError::from)?;
        let params = match &args.resume {
            Some(path) => load_master(cfg, path)?,
            None => Params::dummy(cfg, args.init_seed)?,
        };
        let opt = AdamW::new(
            AdamWConfig {
                lr: args.lr,
                weight_decay: args.weight_decay,
                max_grad_norm: args.max_grad_norm,
                ..AdamWConfig::default()
            },
            &params,
        );
        let servers = args
            .servers
            .iter()
            .map(|s| Server::new(s, args.admin_api_key.clone()))
            .collect();
        if args.push_bucket_mb == 0 {
            return Err(TrainError::Arg {
                flag: "push-bucket-mb",
                reason: "must be at least 1".into(),
            });
        }
        // Quantized here with the serving recipe: each server receives exactly the bytes it
        // will hold, and the push checks its checksum against what was sent.
        let push_opts = PushOptions {
            servers: args.servers.clone(),
            api_key: args.admin_api_key.clone(),
            bucket_bytes: args.push_bucket_mb << 20,
            weight_version: None,
            recipe: Some(recipe.clone()),
            quantize_on_client: true,
            pause_mode: args.pause_mode.mode(),
            retry: RetryPolicy::default(),
            progress: false,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| TrainError::Io {
                path: "tokio runtime".into(),
                reason: e.to_string(),
            })?;
        Ok(Trainer {
            args,
            recipe,
            params,
            opt,
            servers,
            rt,
            reference: None,
            version: 0,
            push_opts,
        })
    }

    /// Runs warm-up and every GRPO step, writing metrics as it goes; with `progress`, a
    /// progress bar and one line per step on stderr.
    pub fn run(&mut self, progress: bool) -> Result<Vec<StepMetrics>, TrainError> {
        let bar = if progress {
            let bar = indicatif::ProgressBar::new(self.args.steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} GRPO [{bar:30}] {pos}/{len} steps {msg} {elapsed}",
                )
                .expect("valid template"),
            );
            bar
        } else {
            indicatif::ProgressBar::hidden()
        };
        let mut writer = MetricsWriter::create(&self.args.metrics, &self.args)?;
        let mut all = Vec::new();
        for step in 0..self.args.warmup_steps {
            let m = self.warmup_step(step)?;
            writer.write(&m)?;
            all.push(m);
        }
        // The servers start from the trainer's weights, whatever they served before.
        self.push()?;
        if self.args.kl_coef != 0.0 {
            self.reference = Some(
                self.params
                    .serving_model(&self.recipe, ServingPrecision::Bf16)?,
            );
        }
        for step in 0..self.args.steps {
            let m = self.grpo_step(step)?;
            let line = format!(
                "step {step:>4}  reward {:.3} ± {:.3}  loss {:+.4}  |Δlp| mean {:.2e} max {:.2e}  k3 {:.2e}  grad {:.3}  (rollout {:.2}s train {:.2}s push {:.2}s)",
                m.reward_mean, m.reward_std, m.loss, m.mismatch.mean_abs, m.mismatch.max_abs,
                m.mismatch.k3, m.grad_norm, m.rollout_s, m.train_s, m.push_s
            );
            // Not a terminal: indicatif draws nothing, so the lines go to stderr as they are.
            if progress && bar.is_hidden() {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
            bar.set_message(format!("reward {:.3}", m.reward_mean));
            bar.inc(1);
            writer.write(&m)?;
            all.push(m);
        }
        bar.finish_and_clear();
        if let Some(path) = &self.args.save {
            save_master(&self.params, path)?;
        }
        Ok(all)
    }

    fn warmup_step(&mut self, step: usize) -> Result<StepMetrics, TrainError> {
        let t = Instant::now();
        let seqs: Vec<Sequence> = (0..self.args.warmup_batch)
            .map(|i| {
                let p = self.args.task.problem(
                    self.args.seed ^ 0x5f7_a11,
                    (step * self.args.warmup_batch + i) as u64,
                );
                Sequence {
                    prompt: p.prompt,
                    completion: p.answer,
                    routing: None,
                }
            })
            .collect();
        let model = self
            .params
            .serving_model(&self.recipe, ServingPrecision::Bf16)?;
        let fwd = policy::forward(&model, &seqs, KV_DTYPE, false);
        let loss = grpo::sft_loss(&fwd.logprobs);
        let mut grads = fwd.backward(
            &model,
            &self.params.bf16_values(),
            self.args.backward_mode,
            &loss.d_logprob,
        );
        let grad_norm = self.opt.step(&mut self.params, &mut grads);
        Ok(StepMetrics {
            phase: "warmup".into(),
            step,
            loss: loss.loss,
            grad_norm,
            completion_tokens: seqs.iter().map(|s| s.completion.len()).sum(),
            train_s: t.elapsed().as_secs_f64(),
            ..StepMetrics::default()
        })
    }

    fn rollouts(&self, problems: &[Problem], step: usize) -> Result<Vec<Sample>, TrainError> {
        let n = self.args.samples_per_prompt;
        let reqs: Vec<RolloutRequest<'_>> = problems
            .iter()
            .enumerate()
            .flat_map(|(i, p)| {
                (0..n).map(move |j| RolloutRequest {
                    prompt: &p.prompt,
                    max_new_tokens: p.max_new_tokens(),
                    sampling_seed: seed_of(self.args.seed, step, i, j),
                })
            })
            .collect();
        // Whole groups round-robin over the servers, all servers at once.
        let k = self.servers.len();
        let mut shares: Vec<Vec<usize>> = vec![Vec::new(); k];
        for (g, chunk) in (0..reqs.len()).collect::<Vec<_>>().chunks(n).enumerate() {
            shares[g % k].extend_from_slice(chunk);
        }
        let replay = self.args.routing_replay;
        let results = self.rt.block_on(futures_util::future::join_all(
            self.servers.iter().zip(&shares).map(|(srv, idx)| {
                let mine: Vec<RolloutRequest<'_>> = idx
                    .iter()
                    .map(|&i| RolloutRequest {
                        prompt: reqs[i].prompt,
                        max_new_tokens: reqs[i].max_new_tokens,
                        sampling_seed: reqs[i].sampling_seed,
                    })
                    .collect();
                async move {
                    if mine.is_empty() {
                        Ok(Vec::new())
                    } else {
                        srv.generate(&mine, replay).await
                    }
                }
            }),
        ));
        let mut out: Vec<Option<Sample>> = vec![None; reqs.len()];
        for (idx, res) in shares.iter().zip(results) {
            for (&i, s) in idx.iter().zip(res?) {
                out[i] = Some(s);
            }
        }
        Ok(out
            .into_iter()
            .map(|s| s.expect("every request answered"))
            .collect())
    }

    fn grpo_step(&mut self, step: usize) -> Result<StepMetrics, TrainError> {
        let n = self.args.samples_per_prompt;
        let problems: Vec<Problem> = (0..self.args.prompts_per_step)
            .map(|i| {
                self.args.task.problem(
                    self.args.seed,
                    (step * self.args.prompts_per_step + i) as u64,
                )
            })
            .collect();
        // The model the servers hold now (pushed last), built the way they build it.
        let model = self
            .params
            .serving_model(&self.recipe, ServingPrecision::Bf16)?;
        let t = Instant::now();
        let samples = self.rollouts(&problems, step)?;
        let rollout_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let rewards: Vec<f32> = samples
            .iter()
            .enumerate()
            .map(|(i, s)| problems[i / n].reward(&s.output_ids))
            .collect();
        let advantages = grpo::group_advantages(&rewards, n);
        // Samples with no tokens carry no gradient (their reward still shaped the group).
        let kept: Vec<usize> = (0..samples.len())
            .filter(|&i| !samples[i].output_ids.is_empty())
            .collect();
        let seqs: Vec<Sequence> = kept
            .iter()
            .map(|&i| Sequence {
                prompt: problems[i / n].prompt.clone(),
                completion: samples[i].output_ids.clone(),
                routing: samples[i].routed_experts.clone(),
            })
            .collect();
        let rollout_lp: Vec<Vec<f32>> = kept.iter().map(|&i| samples[i].logprobs.clone()).collect();
        let adv: Vec<f32> = kept.iter().map(|&i| advantages[i]).collect();
        let fwd = policy::forward(&model, &seqs, KV_DTYPE, self.args.routing_replay);
        let mismatch = grpo::mismatch(&fwd.logprobs, &rollout_lp);
        let mismatch_bf16_forward = if self.args.report_bf16_mismatch {
            let plain = self
                .params
                .serving_model(&Recipe::bf16(), ServingPrecision::Bf16)?;
            let lp = policy::forward(&plain, &seqs, KV_DTYPE, self.args.routing_replay).logprobs;
            Some(grpo::mismatch(&lp, &rollout_lp))
        } else {
            None
        };
        let reference = self
            .reference
            .as_ref()
            .map(|r| policy::forward(r, &seqs, KV_DTYPE, self.args.routing_replay).logprobs);
        let loss = grpo::policy_gradient(
            &fwd.logprobs,
            &rollout_lp,
            reference.as_deref(),
            &adv,
            &PgConfig {
                clip_eps: self.args.clip_eps,
                kl_coef: self.args.kl_coef,
            },
        );
        let mut grads = fwd.backward(
            &model,
            &self.params.bf16_values(),
            self.args.backward_mode,
            &loss.d_logprob,
        );
        let grad_norm = self.opt.step(&mut self.params, &mut grads);
        let train_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let (pushed_version, pushed_checksum) = self.push()?;
        let (reward_mean, reward_std) = mean_std(&rewards);
        let mut versions: Vec<String> = samples.iter().map(|s| s.weight_version.clone()).collect();
        versions.sort();
        versions.dedup();
        Ok(StepMetrics {
            phase: "grpo".into(),
            step,
            loss: loss.loss,
            reward_mean,
            reward_std,
            mismatch,
            mismatch_bf16_forward,
            grad_norm,
            clip_fraction: loss.clip_fraction,
            completion_tokens: mismatch.tokens,
            rollout_weight_versions: versions,
            pushed_version,
            pushed_checksum,
            rollout_s,
            train_s,
            push_s: t.elapsed().as_secs_f64(),
        })
    }

    /// Pushes the current weights to every server as the next version; returns the version
    /// and the overall checksum the servers hold (verified by the push).
    fn push(&mut self) -> Result<(String, String), TrainError> {
        self.version += 1;
        let version = format!("train-{}", self.version);
        let tensors = self.params.to_bf16_tensors();
        let views = tensors
            .iter()
            .map(|(n, t)| {
                TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .map(|v| (n.clone(), v))
                    .map_err(|e| crate::push::PushError::Tensor {
                        name: n.clone(),
                        reason: e.to_string(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut opts = self.push_opts.clone();
        opts.weight_version = Some(version.clone());
        let report = self.rt.block_on(crate::push::push_tensors(&opts, views))?;
        let checksum = report
            .servers
            .first()
            .map(|s| s.checksum.clone())
            .unwrap_or_default();
        Ok((version, checksum))
    }

    /// The overall checksum of the serving model built from the current master weights, the
    /// way the trainer's forward builds it (what every server must hold after a push).
    pub fn serving_checksum(&self) -> Result<String, TrainError> {
        let mut model = self
            .params
            .serving_model(&self.recipe, ServingPrecision::Bf16)?;
        Ok(crate::model::checksum::hex(
            model.weights_checksum().overall(),
        ))
    }
}

fn save_master(params: &Params, path: &std::path::Path) -> Result<(), TrainError> {
    let tensors: BTreeMap<String, OwnedTensor> = params
        .tensors
        .iter()
        .map(|(n, p)| (n.clone(), OwnedTensor::f32(p.shape.clone(), &p.value)))
        .collect();
    crate::checkpoint::write_file(path, &tensors, None).map_err(|e| TrainError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

fn load_master(cfg: ModelConfig, path: &std::path::Path) -> Result<Params, TrainError> {
    let mut params = Params::dummy(cfg, 0)?;
    let io = |reason: String| TrainError::Io {
        path: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| io(e.to_string()))?;
    for (name, p) in params.tensors.iter_mut() {
        let t = st.tensor(name).map_err(|e| io(format!("{name}: {e}")))?;
        if t.shape() != p.shape.as_slice() {
            return Err(io(format!(
                "{name}: shape {:?}, expected {:?}",
                t.shape(),
                p.shape
            )));
        }
        p.value = crate::checkpoint::to_f32(name, &t).map_err(|e| io(e.to_string()))?;
    }
    Ok(params)
}
