//! `lockstep push`: a live weight update of one or many running servers from a checkpoint
//! directory ([`push_checkpoint`]) or from tensors in memory ([`push_tensors`], what a trainer
//! calls after an optimizer step).
//!
//! Steps: read each server's checksum (its tensor names tell the slot formats), open a
//! session everywhere, stream buckets (gate/up pairs together) to every server at once while
//! the next bucket is prepared, pause generation if asked, end each session with the tensor
//! count and the checksum the server must reach, and verify each server's checksum and
//! version afterwards. Any failure before the commit aborts the session on every server, so
//! they all keep the old weights.

pub mod args;
pub mod body;
pub mod bucket;
pub mod client;
pub mod prepare;
pub mod report;

use std::collections::VecDeque;
use std::time::Instant;

use futures_util::future::join_all;
use safetensors::tensor::TensorView;
use serde_json::json;

use self::client::{RetryPolicy, Server};
use self::prepare::{prepare_bucket, PrepareOptions, PreparedBucket, ServerLayout};
pub use self::report::{PushReport, ServerReport};
use crate::checkpoint::Checkpoint;
use crate::engine::PauseMode;
use crate::model::checksum::{self, WeightsChecksum};
use crate::quant::Recipe;

#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("server {url}: {reason}")]
    Server { url: String, reason: String },
    #[error("{0}")]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error("recipe: {0}")]
    Recipe(String),
    #[error("--{flag}: {reason}")]
    Arg { flag: &'static str, reason: String },
    /// Some servers committed and others did not: they now serve different versions.
    #[error("the update committed on {committed:?} but failed on {failed}")]
    PartialCommit {
        committed: Vec<String>,
        failed: String,
    },
}

/// How a push runs. Defaults are defined once, in [`args::PushArgs`].
#[derive(Clone, Debug)]
pub struct PushOptions {
    pub servers: Vec<String>,
    pub api_key: Option<String>,
    pub bucket_bytes: usize,
    /// None: the next version after the first server's (`7` -> `8`, `default` -> `1`).
    pub weight_version: Option<String>,
    /// The servers' recipe, needed when the client quantizes (or must predict the server's
    /// quantization for the checksum). None: the checkpoint's recorded recipe, else the
    /// built-in recipe of the servers' recipe name when its hash matches.
    pub recipe: Option<Recipe>,
    pub quantize_on_client: bool,
    /// Pause generation around the commit (None: commit between two steps, no pause).
    pub pause_mode: Option<PauseMode>,
    pub retry: RetryPolicy,
    pub progress: bool,
}

/// Pushes every tensor of the checkpoint in `dir` (memory-mapped, read bucket by bucket).
pub async fn push_checkpoint(
    opts: &PushOptions,
    dir: &std::path::Path,
) -> Result<PushReport, PushError> {
    let ckpt = Checkpoint::open(dir)?;
    let mut opts = opts.clone();
    let recorded = ckpt.dir.join("lockstep_recipe.yaml");
    if opts.recipe.is_none() && recorded.exists() {
        opts.recipe = Some(
            Recipe::from_file(&recorded)
                .map_err(|e| PushError::Recipe(format!("{}: {e}", recorded.display())))?,
        );
    }
    let names: Vec<&str> = ckpt.names().collect();
    let views = names
        .iter()
        .map(|n| Ok((n.to_string(), ckpt.tensor(n)?)))
        .collect::<Result<Vec<_>, PushError>>()?;
    push_from(&opts, views, Some(&ckpt)).await
}

/// What each server holds before the update.
struct Before {
    server: Server,
    checksum: WeightsChecksum,
    version: String,
    recipe_name: String,
    recipe_hash: String,
}

async fn read_server(server: Server) -> Result<Before, PushError> {
    let fail = |e: client::CallError| PushError::Server {
        url: server.url.clone(),
        reason: e.to_string(),
    };
    let sum = server.get("/weights_checksum").await.map_err(fail)?;
    let info = server.get("/get_model_info").await.map_err(fail)?;
    let tensors = sum["tensors"]
        .as_object()
        .ok_or_else(|| PushError::Server {
            url: server.url.clone(),
            reason: "GET /weights_checksum gave no `tensors` (is it a lockstep server?)".into(),
        })?
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_str().and_then(checksum::parse_hex).unwrap_or(0),
            )
        })
        .collect();
    Ok(Before {
        checksum: WeightsChecksum { tensors },
        version: sum["weight_version"]
            .as_str()
            .unwrap_or("default")
            .to_string(),
        recipe_name: info["recipe"].as_str().unwrap_or_default().to_string(),
        recipe_hash: info["recipe_hash"].as_str().unwrap_or_default().to_string(),
        server: server.clone(),
    })
}

/// Pushes named tensors in checkpoint layout (BF16/F16/F32, or pre-quantized parts) to every
/// server as one update. `tensors` may be any subset of the served tensors (only what changed).
pub async fn push_tensors(
    opts: &PushOptions,
    tensors: Vec<(String, TensorView<'_>)>,
) -> Result<PushReport, PushError> {
    push_from(opts, tensors, None).await
}

/// [`push_tensors`]; `source` is the checkpoint the views are of, whose map the bytes sent as
/// they are then share.
async fn push_from(
    opts: &PushOptions,
    tensors: Vec<(String, TensorView<'_>)>,
    source: Option<&Checkpoint>,
) -> Result<PushReport, PushError> {
    if opts.servers.is_empty() {
        return Err(PushError::Arg {
            flag: "server",
            reason: "give at least one server".into(),
        });
    }
    if tensors.is_empty() {
        return Err(PushError::Arg {
            flag: "checkpoint",
            reason: "no tensors to push".into(),
        });
    }
    let started = Instant::now();
    let servers = opts
        .servers
        .iter()
        .map(|u| Server::new(u, opts.api_key.clone(), opts.retry))
        .collect::<Result<Vec<_>, _>>()?;
    let before = join_all(servers.iter().cloned().map(read_server))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let layout = ServerLayout::from_names(before[0].checksum.tensors.keys());
    for b in &before[1..] {
        if ServerLayout::from_names(b.checksum.tensors.keys()) != layout {
            return Err(PushError::Server {
                url: b.server.url.clone(),
                reason: format!(
                    "serves other tensors than {} (a different model or recipe)",
                    before[0].server.url
                ),
            });
        }
    }
    let recipe = resolve_recipe(opts, &before[0])?;
    let version = opts
        .weight_version
        .clone()
        .unwrap_or_else(|| crate::server::weights::next_version(&before[0].version));

    // Bucket plan: checked against the servers' names before anything is sent.
    let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(unknown) = names.iter().find(|n| !layout.tensors.contains(**n)) {
        return Err(PushError::Tensor {
            name: unknown.to_string(),
            reason: format!(
                "not a tensor of the served model ({})",
                before[0].server.url
            ),
        });
    }
    let sizes: Vec<usize> = tensors.iter().map(|(_, t)| t.data().len()).collect();
    let plan = bucket::buckets(&names, &sizes, opts.bucket_bytes);
    let total_bytes: usize = sizes.iter().sum();

    let mut begin = json!({"weight_version": version});
    if let Some(r) = &recipe {
        begin["recipe_hash"] = json!(r.hash());
    }
    let opened = join_all(
        before
            .iter()
            .map(|b| b.server.post("/begin_weight_update", &begin, true)),
    )
    .await;
    let mut sessions = Vec::new();
    let mut first_error = None;
    for (b, r) in before.iter().zip(opened) {
        match r.map(|v| v["session"].as_str().map(str::to_string)) {
            Ok(Some(s)) => sessions.push(Some(s)),
            Ok(None) => {
                sessions.push(None);
                first_error.get_or_insert(server_err(
                    &b.server,
                    "begin_weight_update",
                    "no session in the answer",
                ));
            }
            Err(e) => {
                sessions.push(None);
                first_error.get_or_insert(server_err(&b.server, "begin_weight_update", e));
            }
        }
    }
    if let Some(e) = first_error {
        abort_all(&before, &sessions).await;
        return Err(e);
    }
    let sessions: Vec<String> = sessions
        .into_iter()
        .map(|s| s.expect("all opened"))
        .collect();

    let bar = progress_bar(total_bytes as u64, opts.progress);
    let prep = PrepareOptions {
        layout: &layout,
        recipe: recipe.as_ref(),
        quantize_on_client: opts.quantize_on_client,
        source,
    };
    let sent = stream_buckets(&before, &sessions, &tensors, &plan, &prep, &sizes, &bar).await;
    bar.finish_and_clear();
    let (pushed, staged, wire_bytes, prepare_s) = match sent {
        Ok(v) => v,
        Err(e) => {
            abort_all(
                &before,
                &sessions.iter().cloned().map(Some).collect::<Vec<_>>(),
            )
            .await;
            return Err(e);
        }
    };
    let transfer_s = started.elapsed().as_secs_f64();

    // Commit: every server's own expected checksum (their untouched tensors may differ).
    let expected: Vec<WeightsChecksum> = before
        .iter()
        .map(|b| b.checksum.overlaid(&pushed))
        .collect();
    if let Some(mode) = opts.pause_mode {
        let body = json!({"mode": mode});
        let r = join_all(
            before
                .iter()
                .map(|b| b.server.post("/pause_generation", &body, true)),
        )
        .await;
        if let Some((b, e)) = before
            .iter()
            .zip(r)
            .find_map(|(b, r)| r.err().map(|e| (b, e)))
        {
            resume_all(&before).await;
            abort_all(
                &before,
                &sessions.iter().cloned().map(Some).collect::<Vec<_>>(),
            )
            .await;
            return Err(server_err(&b.server, "pause_generation", e));
        }
    }
    let commit_started = Instant::now();
    let ends = join_all(before.iter().zip(&sessions).zip(&expected).map(|((b, s), want)| {
        let body = json!({"session": s, "expected_tensors": staged, "checksum": checksum::hex(want.overall())});
        async move {
            let t = Instant::now();
            let r = b.server.post("/end_weight_update", &body, false).await;
            (r, t.elapsed())
        }
    }))
    .await;
    let commit_s = commit_started.elapsed().as_secs_f64();
    if opts.pause_mode.is_some() {
        resume_all(&before).await;
    }
    let failed: Vec<String> = before
        .iter()
        .zip(&ends)
        .filter_map(|(b, (r, _))| r.as_ref().err().map(|e| format!("{}: {e}", b.server.url)))
        .collect();
    if !failed.is_empty() {
        let committed: Vec<String> = before
            .iter()
            .zip(&ends)
            .filter(|(_, (r, _))| r.is_ok())
            .map(|(b, _)| b.server.url.clone())
            .collect();
        return Err(if committed.is_empty() {
            PushError::Server {
                url: failed.join("; "),
                reason: "end_weight_update failed; nothing changed".into(),
            }
        } else {
            PushError::PartialCommit {
                committed,
                failed: failed.join("; "),
            }
        });
    }

    let mut reports = Vec::new();
    for ((b, want), (r, took)) in before.iter().zip(&expected).zip(&ends) {
        let answer = r.as_ref().expect("checked above");
        let verified = verify(&b.server, want, &version).await?;
        reports.push(ServerReport {
            url: b.server.url.clone(),
            checksum: checksum::hex(verified),
            end_s: took.as_secs_f64(),
            commit_pause_s: answer["commit_pause_s"].as_f64(),
            mode: answer["mode"].as_str().map(String::from),
        });
    }
    Ok(PushReport {
        weight_version: version,
        tensors: tensors.len(),
        staged_tensors: staged,
        buckets: plan.len(),
        source_bytes: total_bytes,
        wire_bytes_per_server: wire_bytes,
        transfer_s,
        prepare_s,
        commit_s,
        total_s: started.elapsed().as_secs_f64(),
        servers: reports,
    })
}

fn server_err(server: &Server, what: &str, e: impl std::fmt::Display) -> PushError {
    PushError::Server {
        url: server.url.clone(),
        reason: format!("{what}: {e}"),
    }
}

/// The recipe the client quantizes with: given, or the built-in one the servers name.
fn resolve_recipe(opts: &PushOptions, first: &Before) -> Result<Option<Recipe>, PushError> {
    if let Some(r) = &opts.recipe {
        if !first.recipe_hash.is_empty() && r.hash() != first.recipe_hash {
            return Err(PushError::Recipe(format!(
                "recipe `{}` (hash {}) is not the servers' `{}` (hash {})",
                r.name,
                r.hash(),
                first.recipe_name,
                first.recipe_hash
            )));
        }
        return Ok(Some(r.clone()));
    }
    Ok(Recipe::builtin(&first.recipe_name).filter(|r| r.hash() == first.recipe_hash))
}

/// Sends every bucket to every server, preparing the next bucket while the current one is on
/// the wire. Returns the expected hashes of everything pushed, the staged tensor count and
/// the bytes each server received.
async fn stream_buckets(
    before: &[Before],
    sessions: &[String],
    tensors: &[(String, TensorView<'_>)],
    plan: &[Vec<usize>],
    prep: &PrepareOptions<'_>,
    sizes: &[usize],
    bar: &indicatif::ProgressBar,
) -> Result<(WeightsChecksum, usize, usize, f64), PushError> {
    let preparing = std::cell::Cell::new(0.0);
    let prepare = |i: usize| {
        let started = Instant::now();
        let members: Vec<(&str, &TensorView<'_>)> = plan[i]
            .iter()
            .map(|&j| (tensors[j].0.as_str(), &tensors[j].1))
            .collect();
        // Quantizing is CPU work: keep it off the runtime's other tasks (the sends in flight)
        // where the runtime allows it (a current-thread runtime runs the sends afterwards).
        let multi = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        let bucket = if multi {
            tokio::task::block_in_place(|| prepare_bucket(&members, prep))
        } else {
            prepare_bucket(&members, prep)
        };
        preparing.set(preparing.get() + started.elapsed().as_secs_f64());
        bucket
    };
    let mut expected = WeightsChecksum::default();
    let (mut staged, mut wire) = (0, 0);
    // The next bucket is prepared and sent while the earlier ones are on the wire or being
    // written by the servers (each server takes a session's buckets one at a time).
    let mut in_flight: VecDeque<InFlight> = VecDeque::new();
    for i in 0..plan.len() {
        let bucket = match prepare(i) {
            Ok(b) => b,
            Err(e) => {
                in_flight.iter().for_each(InFlight::abort);
                return Err(e);
            }
        };
        let sends = before
            .iter()
            .zip(sessions)
            .map(|(b, s)| {
                let (server, session, body) = (b.server.clone(), s.clone(), bucket.body.clone());
                tokio::spawn(async move { server.put_bucket(&session, body).await })
            })
            .collect();
        in_flight.push_back(InFlight {
            index: i,
            bucket,
            sends,
        });
        while in_flight.len() >= BUCKETS_IN_FLIGHT || (i + 1 == plan.len() && !in_flight.is_empty())
        {
            let mut done = in_flight.pop_front().expect("not empty");
            if let Err(e) = done.finish(before, plan.len()).await {
                in_flight.iter().for_each(InFlight::abort);
                return Err(e);
            }
            expected.tensors.append(&mut done.bucket.expected.tensors);
            staged += done.bucket.tensors;
            wire += done.bucket.body.len();
            bar.inc(plan[done.index].iter().map(|&j| sizes[j] as u64).sum());
        }
    }
    Ok((expected, staged, wire, preparing.get()))
}

/// Buckets a push keeps on the wire at once per server: the next one travels while a server
/// writes the last (client memory: this many bodies plus the one being prepared).
const BUCKETS_IN_FLIGHT: usize = 2;

/// A bucket sent to every server, its answers not yet read.
struct InFlight {
    index: usize,
    bucket: PreparedBucket,
    sends: Vec<tokio::task::JoinHandle<Result<serde_json::Value, client::CallError>>>,
}

impl InFlight {
    /// Waits for every server's answer; the first failure, named by server and bucket.
    async fn finish(&mut self, before: &[Before], buckets: usize) -> Result<(), PushError> {
        let answers = join_all(self.sends.drain(..)).await;
        for (b, h) in before.iter().zip(answers) {
            match h {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let what = format!("bucket {} of {buckets}", self.index + 1);
                    return Err(server_err(&b.server, &what, e));
                }
                Err(e) => return Err(server_err(&b.server, "bucket task", e)),
            }
        }
        Ok(())
    }

    /// Stops its sends (the session is aborted next).
    fn abort(&self) {
        self.sends.iter().for_each(|h| h.abort());
    }
}

async fn abort_all(before: &[Before], sessions: &[Option<String>]) {
    let calls = before.iter().zip(sessions).filter_map(|(b, s)| {
        s.as_ref().map(|s| async move {
            if let Err(e) = b
                .server
                .post("/abort_weight_update", &json!({"session": s}), true)
                .await
            {
                tracing::warn!("{}: abort_weight_update: {e}", b.server.url);
            }
        })
    });
    join_all(calls).await;
}

async fn resume_all(before: &[Before]) {
    join_all(before.iter().map(|b| async move {
        if let Err(e) = b
            .server
            .post("/continue_generation", &json!({}), true)
            .await
        {
            tracing::warn!("{}: continue_generation: {e}", b.server.url);
        }
    }))
    .await;
}

/// Checks the server now reports the expected checksum and version; returns its checksum.
async fn verify(server: &Server, want: &WeightsChecksum, version: &str) -> Result<u64, PushError> {
    let fail = |reason: String| PushError::Server {
        url: server.url.clone(),
        reason,
    };
    let sum = server
        .get("/weights_checksum")
        .await
        .map_err(|e| fail(format!("weights_checksum: {e}")))?;
    let got = sum["overall"].as_str().and_then(checksum::parse_hex);
    if got != Some(want.overall()) {
        return Err(fail(format!(
            "after the update its checksum is {} but {} was expected",
            sum["overall"],
            checksum::hex(want.overall())
        )));
    }
    let v = server
        .get("/get_weight_version")
        .await
        .map_err(|e| fail(format!("get_weight_version: {e}")))?;
    if v["weight_version"].as_str() != Some(version) {
        return Err(fail(format!(
            "after the update its version is {} instead of {version}",
            v["weight_version"]
        )));
    }
    Ok(want.overall())
}

fn progress_bar(total: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(total),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "pushing [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {elapsed}",
        )
        .expect("valid template"),
    );
    bar
}

/// The runtime `lockstep push` runs on (multi-threaded: bucket preparation blocks a worker).
pub fn run_blocking(opts: &PushOptions, dir: &std::path::Path) -> Result<PushReport, PushError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| PushError::Arg {
            flag: "checkpoint",
            reason: format!("tokio runtime: {e}"),
        })?;
    rt.block_on(push_checkpoint(opts, dir))
}
