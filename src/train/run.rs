//! The GRPO loop: warm up on task answers, push, then per step sample groups from the servers,
//! score them, take one AdamW step on the clipped policy-gradient loss and push the new weights.

use std::collections::BTreeMap;
use std::time::Instant;

use safetensors::tensor::TensorView;

use super::args::TrainArgs;
use super::client::{RolloutRequest, Sample, Server};
use super::grpo::{self, PgConfig};
use super::metrics::{MetricsWriter, StepMetrics};
use super::optim::{exp_avg_name, exp_avg_sq_name, AdamW, AdamWConfig};
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
        let mut opt = AdamW::new(
            AdamWConfig {
                lr: args.lr,
                weight_decay: args.weight_decay,
                max_grad_norm: args.max_grad_norm,
                ..AdamWConfig::default()
            },
            &params,
        );
        if let Some(path) = &args.resume {
            load_optimizer(&mut opt, path)?;
        }
        let servers = args
            .servers
            .iter()
            .map(|s| Server::new(s, args.admin_api_key.clone()))
            .collect();
        if args.updates_per_batch == 0 {
            return Err(TrainError::Arg {
                flag: "updates-per-batch",
                reason: "must be at least 1".into(),
            });
        }
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
            save_checkpoint(&self.params, &self.opt, path)?;
        }
        if let Some(dir) = &self.args.plots {
            write_plots(dir, &all)?;
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
        let replay = self.args.routing_replay;
        // The rollouts' policy is the model built before any update: the mismatch is measured
        // against it on the whole batch.
        let first = policy::forward(&model, &seqs, KV_DTYPE, replay);
        let mismatch = grpo::mismatch(&first.logprobs, &rollout_lp);
        let mismatch_bf16_forward = if self.args.report_bf16_mismatch {
            let plain = self
                .params
                .serving_model(&Recipe::bf16(), ServingPrecision::Bf16)?;
            let lp = policy::forward(&plain, &seqs, KV_DTYPE, replay).logprobs;
            Some(grpo::mismatch(&lp, &rollout_lp))
        } else {
            None
        };
        let reference = self
            .reference
            .as_ref()
            .map(|r| policy::forward(r, &seqs, KV_DTYPE, replay).logprobs);
        let pg = PgConfig {
            clip_eps: self.args.clip_eps,
            kl_coef: self.args.kl_coef,
        };
        // `--updates-per-batch` optimizer steps, each on the next contiguous mini-batch, each
        // against the rollout logprobs: after the first, the policy has moved, the importance
        // ratios differ from 1 and the clip acts.
        let updates = self.args.updates_per_batch;
        let per = seqs.len().div_ceil(updates).max(1);
        let (mut loss_sum, mut clipped, mut tokens, mut grad_norm) = (0f64, 0f64, 0usize, 0f64);
        let mut first = Some(first);
        for (u, range) in (0..seqs.len())
            .step_by(per)
            .map(|a| a..(a + per).min(seqs.len()))
            .enumerate()
        {
            let built;
            let (model, fwd) = if updates == 1 {
                (&model, first.take().expect("one update"))
            } else {
                let _ = first.take();
                built = if u == 0 {
                    None
                } else {
                    Some(
                        self.params
                            .serving_model(&self.recipe, ServingPrecision::Bf16)?,
                    )
                };
                let m = built.as_ref().unwrap_or(&model);
                (
                    m,
                    policy::forward(m, &seqs[range.clone()], KV_DTYPE, replay),
                )
            };
            let loss = grpo::policy_gradient(
                &fwd.logprobs,
                &rollout_lp[range.clone()],
                reference.as_ref().map(|r| &r[range.clone()]),
                &adv[range.clone()],
                &pg,
            );
            let n: usize = fwd.logprobs.iter().map(Vec::len).sum();
            loss_sum += loss.loss * n as f64;
            clipped += loss.clip_fraction * n as f64;
            tokens += n;
            let mut grads = fwd.backward(
                model,
                &self.params.bf16_values(),
                self.args.backward_mode,
                &loss.d_logprob,
            );
            grad_norm = self.opt.step(&mut self.params, &mut grads);
        }
        let loss = grpo::TokenLoss {
            loss: loss_sum / tokens.max(1) as f64,
            d_logprob: Vec::new(),
            clip_fraction: clipped / tokens.max(1) as f64,
        };
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

/// `reward.png` (mean reward) and `mismatch.png` (mean and max |Δlogprob|) of the GRPO steps.
fn write_plots(dir: &std::path::Path, steps: &[StepMetrics]) -> Result<(), TrainError> {
    std::fs::create_dir_all(dir).map_err(|e| TrainError::Io {
        path: dir.display().to_string(),
        reason: e.to_string(),
    })?;
    let grpo: Vec<&StepMetrics> = steps.iter().filter(|m| m.phase == "grpo").collect();
    let curve = |f: fn(&StepMetrics) -> f64| grpo.iter().map(|m| f(m)).collect::<Vec<f64>>();
    super::plot::curves_png(
        &dir.join("reward.png"),
        (800, 450),
        &[("reward", curve(|m| m.reward_mean))],
    )?;
    super::plot::curves_png(
        &dir.join("mismatch.png"),
        (800, 450),
        &[
            ("mean |Δlogprob|", curve(|m| m.mismatch.mean_abs)),
            ("max |Δlogprob|", curve(|m| m.mismatch.max_abs)),
        ],
    )
}

/// Metadata key of the AdamW step count in a trainer checkpoint.
const ADAMW_STEP_KEY: &str = "adamw_step";

/// The f32 master weights under their names, AdamW's moments under
/// `optimizer.exp_avg[_sq].<name>` and its step count in the metadata.
fn save_checkpoint(params: &Params, opt: &AdamW, path: &std::path::Path) -> Result<(), TrainError> {
    let mut tensors: BTreeMap<String, OwnedTensor> = BTreeMap::new();
    for (n, p) in &params.tensors {
        tensors.insert(n.clone(), OwnedTensor::f32(p.shape.clone(), &p.value));
        if let Some((m, v)) = opt.moments(n) {
            tensors.insert(exp_avg_name(n), OwnedTensor::f32(p.shape.clone(), m));
            tensors.insert(exp_avg_sq_name(n), OwnedTensor::f32(p.shape.clone(), v));
        }
    }
    let meta = [(ADAMW_STEP_KEY.to_string(), opt.steps().to_string())].into();
    crate::checkpoint::write_file(path, &tensors, Some(meta)).map_err(|e| TrainError::Io {
        path: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Restores AdamW's state from a checkpoint [`save_checkpoint`] wrote. A file of master
/// weights only (no step count) leaves the optimizer fresh.
fn load_optimizer(opt: &mut AdamW, path: &std::path::Path) -> Result<(), TrainError> {
    let io = |reason: String| TrainError::Io {
        path: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| io(e.to_string()))?;
    let Some(step) = meta.metadata().as_ref().and_then(|m| m.get(ADAMW_STEP_KEY)) else {
        tracing::warn!(
            "{}: no AdamW state ({ADAMW_STEP_KEY}); the optimizer starts fresh",
            path.display()
        );
        return Ok(());
    };
    let step: i32 = step
        .parse()
        .map_err(|_| io(format!("{ADAMW_STEP_KEY}: `{step}` is not a step count")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| io(e.to_string()))?;
    opt.restore(step, |key| {
        let t = st.tensor(key).map_err(|e| format!("{key}: {e}"))?;
        crate::checkpoint::to_f32(key, &t).map_err(|e| e.to_string())
    })
    .map_err(io)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn trainer(extra: &[&str]) -> Trainer {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            train: TrainArgs,
        }
        // Warm-up steps need no server: nothing here is pushed or sampled.
        let mut argv = vec![
            "lockstep",
            "--server",
            "http://127.0.0.1:9",
            "--warmup-batch",
            "4",
            "--lr",
            "1e-2",
        ];
        argv.extend_from_slice(extra);
        Trainer::new(Cli::parse_from(argv).train).unwrap()
    }

    fn bits(p: &Params) -> Vec<(String, Vec<u32>)> {
        p.tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.value.iter().map(|x| x.to_bits()).collect()))
            .collect()
    }

    /// k steps, save, resume, one more step: the same weights, moments and step count, bit for
    /// bit, as k + 1 steps in one run (with a fresh optimizer the weights would differ).
    #[test]
    fn resume_after_k_steps_then_one_more_equals_k_plus_one_steps() {
        let k = 3;
        let mut whole = trainer(&[]);
        for s in 0..=k {
            whole.warmup_step(s).unwrap();
        }
        let mut first = trainer(&[]);
        for s in 0..k {
            first.warmup_step(s).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        save_checkpoint(&first.params, &first.opt, &path).unwrap();
        let mut resumed = trainer(&["--resume", path.to_str().unwrap()]);
        assert_eq!(resumed.opt.steps(), k as i32);
        resumed.warmup_step(k).unwrap();

        assert_eq!(resumed.opt.steps(), whole.opt.steps());
        assert!(
            bits(&resumed.params) == bits(&whole.params),
            "weights differ"
        );
        for name in whole.params.tensors.keys() {
            let (a, b) = (whole.opt.moments(name), resumed.opt.moments(name));
            let to_bits = |m: Option<(&[f32], &[f32])>| {
                let (m, v) = m.unwrap();
                (
                    m.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    v.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                )
            };
            assert!(to_bits(a) == to_bits(b), "moments of {name} differ");
        }

        // The optimizer state matters: the same master weights with a fresh AdamW diverge.
        let mut fresh = trainer(&["--resume", path.to_str().unwrap()]);
        fresh.opt = AdamW::new(fresh.opt.config, &fresh.params);
        fresh.warmup_step(k).unwrap();
        assert!(bits(&fresh.params) != bits(&whole.params));
    }

    /// A checkpoint whose step count is present but a moment is missing is refused, naming it.
    #[test]
    fn a_checkpoint_missing_a_moment_is_refused_by_name() {
        let t = trainer(&[]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        save_checkpoint(&t.params, &t.opt, &path).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let victim = exp_avg_sq_name(t.params.tensors.keys().next().unwrap());
        let kept: BTreeMap<String, OwnedTensor> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| *n != victim)
            .map(|(n, v)| {
                (
                    n,
                    OwnedTensor::new(v.dtype(), v.shape().to_vec(), v.data().to_vec()),
                )
            })
            .collect();
        crate::checkpoint::write_file(&path, &kept, meta.metadata().clone()).unwrap();
        let mut opt = AdamW::new(t.opt.config, &t.params);
        let err = load_optimizer(&mut opt, &path).unwrap_err().to_string();
        assert!(err.contains(&victim), "{err}");
    }
}
