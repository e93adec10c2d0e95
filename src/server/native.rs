//! SGLang's native `/generate`: single or batch prompts (text or token ids), per-item
//! sampling params, n samples, logprobs, routed experts, and SSE streaming with cumulative
//! text as SGLang sends it.

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::errors::ApiError;
use super::extract::ApiJson;
use super::generation::{self, Sample};
use super::validate::{self, PromptInput, RequestOptions};
use super::AppState;
use crate::engine::{EngineEvent, FinishInfo, GenerateRequest, TokenOut};
use crate::sampling::SamplingParams;

/// A value or a per-item list of values (SGLang batch fields).
#[derive(Debug)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

/// Hand-written so a bad inner field is named (an untagged enum would only say "did not match
/// any variant").
impl<'de, T: serde::de::DeserializeOwned> Deserialize<'de> for OneOrMany<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let parse = |v: Value| {
            serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
                match e.path().to_string().as_str() {
                    "." => D::Error::custom(e.inner()),
                    path => D::Error::custom(format!("{path}: {}", e.inner())),
                }
            })
        };
        match Value::deserialize(d)? {
            Value::Array(items) => Ok(OneOrMany::Many(
                items.into_iter().map(parse).collect::<Result<_, _>>()?,
            )),
            other => Ok(OneOrMany::One(parse(other)?)),
        }
    }
}

impl<T: Clone> OneOrMany<T> {
    /// The value for item `i` of a batch of `n` (a single value applies to all).
    fn item(&self, i: usize, n: usize, field: &str) -> Result<T, ApiError> {
        match self {
            OneOrMany::One(v) => Ok(v.clone()),
            OneOrMany::Many(v) if v.len() == n => Ok(v[i].clone()),
            OneOrMany::Many(v) => Err(ApiError::invalid(
                field,
                format!(
                    "{field} has {} entries but the batch has {n} prompts",
                    v.len()
                ),
            )),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum IdsInput {
    Single(Vec<i64>),
    Batch(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
pub struct GenerateBody {
    #[serde(default)]
    text: Option<OneOrMany<String>>,
    #[serde(default)]
    input_ids: Option<IdsInput>,
    #[serde(default)]
    rid: Option<OneOrMany<String>>,
    #[serde(default)]
    sampling_params: Option<OneOrMany<SamplingParams>>,
    #[serde(default)]
    return_logprob: Option<OneOrMany<bool>>,
    #[serde(default)]
    logprob_start_len: Option<OneOrMany<i64>>,
    #[serde(default)]
    top_logprobs_num: Option<OneOrMany<i64>>,
    #[serde(default)]
    return_text_in_logprobs: bool,
    #[serde(default)]
    return_routed_experts: bool,
    #[serde(default)]
    stream: bool,
}

/// The body parsed into engine requests (n samples per prompt expanded), plus how to answer.
struct ValidGenerate {
    reqs: Vec<GenerateRequest>,
    batch: bool,
    return_text_in_logprobs: bool,
    stream: bool,
}

async fn parse(state: &AppState, body: GenerateBody) -> Result<ValidGenerate, ApiError> {
    // A list input gets a list answer, even with one prompt (as SGLang does).
    let batch = matches!(body.text, Some(OneOrMany::Many(_)))
        || matches!(body.input_ids, Some(IdsInput::Batch(_)));
    let prompts: Vec<PromptInput> = match (body.text, body.input_ids) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "text",
                "give exactly one of `text` or `input_ids`, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "text",
                "missing prompt: give `text` or `input_ids`",
            ))
        }
        (Some(OneOrMany::One(t)), None) => vec![PromptInput::Text(t)],
        (Some(OneOrMany::Many(ts)), None) => ts.into_iter().map(PromptInput::Text).collect(),
        (None, Some(IdsInput::Single(ids))) => vec![PromptInput::Ids(ids)],
        (None, Some(IdsInput::Batch(b))) => b.into_iter().map(PromptInput::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("text", "the batch is empty"));
    }
    let n_items = prompts.len();
    let mut reqs = Vec::new();
    for (i, prompt) in prompts.into_iter().enumerate() {
        let params = match &body.sampling_params {
            Some(p) => p.item(i, n_items, "sampling_params")?,
            None => SamplingParams::default(),
        };
        let opts = RequestOptions {
            return_logprob: body
                .return_logprob
                .as_ref()
                .map(|v| v.item(i, n_items, "return_logprob"))
                .transpose()?
                .unwrap_or(false),
            logprob_start_len: body
                .logprob_start_len
                .as_ref()
                .map(|v| v.item(i, n_items, "logprob_start_len"))
                .transpose()?
                .unwrap_or(-1),
            top_logprobs_num: body
                .top_logprobs_num
                .as_ref()
                .map(|v| v.item(i, n_items, "top_logprobs_num"))
                .transpose()?
                .unwrap_or(0),
            return_routed_experts: body.return_routed_experts,
            add_special_tokens: true,
        };
        let rid = match &body.rid {
            Some(r) => r.item(i, n_items, "rid")?,
            None => validate::new_rid(),
        };
        reqs.extend(validate::build_requests(state, rid, prompt, &params, &opts).await?);
    }
    let batch = batch || reqs.len() > 1;
    Ok(ValidGenerate {
        reqs,
        batch,
        return_text_in_logprobs: body.return_text_in_logprobs,
        stream: body.stream,
    })
}

pub async fn generate(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<GenerateBody>,
) -> Result<Response, ApiError> {
    let v = parse(&state, body).await?;
    if v.stream {
        return stream(state, v);
    }
    let samples = generation::collect(&state, v.reqs.clone(), "generate").await?;
    let outs: Vec<Value> = samples
        .iter()
        .zip(&v.reqs)
        .map(|(s, r)| sample_json(&state, r, s, v.return_text_in_logprobs))
        .collect();
    Ok(if v.batch {
        Json(Value::Array(outs)).into_response()
    } else {
        Json(outs.into_iter().next().expect("one sample")).into_response()
    })
}

fn stream(state: AppState, v: ValidGenerate) -> Result<Response, ApiError> {
    let events = generation::stream_events(&state, v.reqs.clone(), "generate")?;
    let reqs = v.reqs;
    let batch = v.batch;
    let text_in_lp = v.return_text_in_logprobs;
    // Per sample: tokens so far (SGLang frames carry cumulative text and ids).
    let mut progress: Vec<Vec<TokenOut>> = vec![Vec::new(); reqs.len()];
    let mut open = reqs.len();
    let frames = events
        .map(move |(i, ev, elapsed)| {
            let frame = match ev {
                EngineEvent::Token(t) => {
                    progress[i].push(t);
                    let text: String = progress[i].iter().map(|t| t.text.as_str()).collect();
                    let mut obj = json!({"text": text, "output_ids": progress[i].iter().map(|t| t.id).collect::<Vec<_>>(), "meta_info": partial_meta(&state, &reqs[i], &progress[i], elapsed, text_in_lp)});
                    if batch {
                        obj["index"] = json!(i);
                    }
                    obj
                }
                EngineEvent::Finished(f) => {
                    open -= 1;
                    let sample = Sample { tokens: std::mem::take(&mut progress[i]), finish: *f, e2e_latency: elapsed };
                    let mut obj = sample_json(&state, &reqs[i], &sample, text_in_lp);
                    if batch {
                        obj["index"] = json!(i);
                    }
                    obj
                }
                EngineEvent::Error(e) => {
                    open -= 1;
                    ApiError::from(e).body()
                }
            };
            let mut out = vec![Ok::<_, std::convert::Infallible>(Event::default().data(frame.to_string()))];
            if open == 0 {
                out.push(Ok(Event::default().data("[DONE]")));
            }
            futures_util::stream::iter(out)
        })
        .flatten();
    Ok(Sse::new(frames).into_response())
}

/// `[logprob, token_id, text|null]` as SGLang writes logprob entries.
fn lp_entry(state: &AppState, lp: Option<f32>, id: u32, with_text: bool) -> Value {
    let text = if with_text {
        Value::String(
            state
                .engine
                .info
                .tokenizer
                .decode(&[id], false)
                .unwrap_or_default(),
        )
    } else {
        Value::Null
    };
    json!([lp, id, text])
}

fn top_entries(state: &AppState, top: &[(u32, f32)], with_text: bool) -> Value {
    Value::Array(
        top.iter()
            .map(|&(id, lp)| lp_entry(state, Some(lp), id, with_text))
            .collect(),
    )
}

fn partial_meta(
    state: &AppState,
    req: &GenerateRequest,
    tokens: &[TokenOut],
    elapsed: f64,
    text_in_lp: bool,
) -> Value {
    let mut m = json!({
        "id": req.rid,
        "finish_reason": null,
        "prompt_tokens": req.input_ids.len(),
        "completion_tokens": tokens.len(),
        "cached_tokens": 0,
        "weight_version": tokens.last().map(|t| t.weight_version.clone()).unwrap_or_else(|| state.engine.weight_version()),
        "e2e_latency": elapsed,
    });
    if req.return_logprob {
        m["output_token_logprobs"] = Value::Array(
            tokens
                .iter()
                .map(|t| lp_entry(state, t.logprob, t.id, text_in_lp))
                .collect(),
        );
        if req.top_logprobs_num > 0 {
            m["output_top_logprobs"] = Value::Array(
                tokens
                    .iter()
                    .map(|t| top_entries(state, &t.top_logprobs, text_in_lp))
                    .collect(),
            );
        }
    }
    m
}

/// The full SGLang response object of one finished sample.
pub fn sample_json(state: &AppState, req: &GenerateRequest, s: &Sample, text_in_lp: bool) -> Value {
    let f: &FinishInfo = &s.finish;
    let mut meta = partial_meta(state, req, &s.tokens, s.e2e_latency, text_in_lp);
    meta["finish_reason"] = serde_json::to_value(&f.reason).expect("finish serializes");
    meta["cached_tokens"] = json!(f.cached_tokens);
    meta["completion_tokens"] = json!(f.output_ids.len());
    if let Some(last) = f.weight_versions.last() {
        meta["weight_version"] = json!(last.version);
    }
    if f.weight_versions.len() > 1 {
        meta["weight_versions"] =
            serde_json::to_value(&f.weight_versions).expect("spans serialize");
    }
    if let Some(input) = &f.input_logprobs {
        meta["input_token_logprobs"] = Value::Array(
            input
                .iter()
                .map(|l| lp_entry(state, l.logprob, l.token, text_in_lp))
                .collect(),
        );
        if req.top_logprobs_num > 0 {
            meta["input_top_logprobs"] = Value::Array(
                input
                    .iter()
                    .map(|l| {
                        if l.logprob.is_none() {
                            Value::Null
                        } else {
                            top_entries(state, &l.top, text_in_lp)
                        }
                    })
                    .collect(),
            );
        }
    }
    if let Some(routed) = &f.routed_experts {
        meta["routed_experts"] = json!(generation::routed_experts_base64(routed));
        meta["routed_experts_shape"] = json!([
            routed.len() / (f.moe_layers * f.top_k).max(1),
            f.moe_layers,
            f.top_k
        ]);
    }
    json!({"text": f.text, "output_ids": f.output_ids, "meta_info": meta})
}
