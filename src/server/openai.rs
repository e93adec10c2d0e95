//! The OpenAI API: `/v1/completions`, `/v1/chat/completions` (with SSE streaming and
//! `stream_options.include_usage`), `/v1/models`, logprobs in the OpenAI shapes, and the
//! SGLang extensions (top_k, min_p, stop_token_ids, ignore_eos, return_routed_experts...).

use std::time::{SystemTime, UNIX_EPOCH};

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
use super::native::{IdsInput, OneOrMany};
use super::validate::{self, PromptInput, RequestOptions};
use super::AppState;
use crate::engine::{EngineEvent, GenerateRequest, TokenOut};
use crate::sampling::{Finish, SamplingParams};
use crate::tokenizer::{ChatMessage, TemplateArgs};

/// Fields shared by both endpoints (OpenAI names plus SGLang extensions).
#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct CommonParams {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    n: Option<i64>,
    stop: Option<OneOrMany<String>>,
    stop_token_ids: Option<Vec<i64>>,
    seed: Option<u64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    min_tokens: Option<i64>,
    ignore_eos: bool,
    skip_special_tokens: Option<bool>,
    no_stop_trim: bool,
    stream: bool,
    stream_options: Option<StreamOptions>,
    return_routed_experts: bool,
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

impl CommonParams {
    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    fn sampling(&self, default_max_tokens: i64) -> SamplingParams {
        let d = SamplingParams::default();
        SamplingParams {
            max_new_tokens: Some(
                self.max_completion_tokens
                    .or(self.max_tokens)
                    .unwrap_or(default_max_tokens),
            ),
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(-1),
            min_p: self.min_p.unwrap_or(0.0),
            n: self.n.unwrap_or(1),
            stop: match &self.stop {
                None => vec![],
                Some(OneOrMany::One(s)) => vec![s.clone()],
                Some(OneOrMany::Many(v)) => v.clone(),
            },
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            sampling_seed: self.seed,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            min_new_tokens: self.min_tokens.unwrap_or(0),
            ignore_eos: self.ignore_eos,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            no_stop_trim: self.no_stop_trim,
            ..d
        }
    }

    fn check_model(&self, state: &AppState) -> Result<String, ApiError> {
        // Like SGLang, any model name is accepted and answered with the served name.
        Ok(self
            .model
            .clone()
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| state.served_model_name.to_string()))
    }
}

#[derive(Debug, Deserialize)]
pub struct CompletionBody {
    #[serde(default)]
    prompt: Option<CompletionPrompt>,
    #[serde(default)]
    logprobs: Option<i64>,
    #[serde(default)]
    echo: bool,
    /// Filled from the same JSON object by [`parse_body`].
    #[serde(skip)]
    common: CommonParams,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum CompletionPrompt {
    Text(String),
    Texts(Vec<String>),
    Ids(IdsInput),
}

#[derive(Debug, Deserialize)]
pub struct ChatBody {
    messages: Vec<ChatMessage>,
    #[serde(default)]
    logprobs: bool,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(skip)]
    common: CommonParams,
}

/// Bodies that share [`CommonParams`]: both parts are read from the same object with the
/// field path kept, so a wrong type is reported as e.g. `max_tokens: invalid type ...`
/// (`#[serde(flatten)]` would lose the path).
trait WithCommon: serde::de::DeserializeOwned {
    fn set_common(&mut self, c: CommonParams);
}

impl WithCommon for CompletionBody {
    fn set_common(&mut self, c: CommonParams) {
        self.common = c;
    }
}

impl WithCommon for ChatBody {
    fn set_common(&mut self, c: CommonParams) {
        self.common = c;
    }
}

fn from_value_named<T: serde::de::DeserializeOwned>(v: Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let path = e.path().to_string();
        let field = path
            .split(['.', '['])
            .next()
            .unwrap_or_default()
            .to_string();
        ApiError::Invalid {
            message: format!("{path}: {}", e.inner()),
            param: Some(field),
        }
    })
}

fn parse_body<T: WithCommon>(v: Value) -> Result<T, ApiError> {
    if !v.is_object() {
        return Err(ApiError::Invalid {
            param: None,
            message: "the request body must be a JSON object".into(),
        });
    }
    let common: CommonParams = from_value_named(v.clone())?;
    let mut body: T = from_value_named(v)?;
    body.set_common(common);
    Ok(body)
}

/// Errors from the shared validation name SGLang's fields; an OpenAI client sent OpenAI ones.
/// `top_field` is how the endpoint calls the top-logprobs count (`logprobs` or `top_logprobs`).
fn openai_names(e: ApiError, top_field: &str) -> ApiError {
    match e {
        ApiError::Invalid { param, message } => {
            let rename = |f: &str| match f.trim_start_matches("sampling_params.") {
                "max_new_tokens" => "max_tokens".to_string(),
                "input_ids" | "text" => "prompt".to_string(),
                "min_new_tokens" => "min_tokens".to_string(),
                "sampling_seed" => "seed".to_string(),
                "top_logprobs_num" => top_field.to_string(),
                other => other.to_string(),
            };
            let new_param = param.as_deref().map(rename);
            let mut message = message;
            if let (Some(old), Some(new)) = (&param, &new_param) {
                message = message
                    .replace(old.as_str(), new)
                    .replace(old.trim_start_matches("sampling_params."), new);
            }
            ApiError::Invalid {
                param: new_param,
                message,
            }
        }
        other => other,
    }
}

const CHAT_ROLES: &[&str] = &[
    "system",
    "user",
    "assistant",
    "tool",
    "developer",
    "function",
];

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Stop { .. } => "stop",
        Finish::Length { .. } => "length",
        Finish::Abort { .. } => "abort",
    }
}

fn matched_stop(f: &Finish) -> Value {
    match f {
        Finish::Stop { matched } => serde_json::to_value(matched).unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

fn usage(samples: &[&Sample]) -> Value {
    let prompt: usize = samples
        .iter()
        .map(|s| s.finish.prompt_tokens)
        .max()
        .unwrap_or(0);
    let completion: usize = samples.iter().map(|s| s.finish.output_ids.len()).sum();
    let cached: usize = samples
        .iter()
        .map(|s| s.finish.cached_tokens)
        .max()
        .unwrap_or(0);
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}})
}

/// A token's text; a token that is only part of a UTF-8 character is named by its vocabulary
/// entry instead, so distinct tokens never collapse into the same U+FFFD key.
fn token_text(state: &AppState, id: u32) -> String {
    let tok = &state.engine.info.tokenizer;
    match tok.decode(&[id], false) {
        Ok(t) if !t.contains(char::REPLACEMENT_CHARACTER) => t,
        _ => tok
            .id_to_token(id)
            .unwrap_or_else(|| format!("<token {id}>")),
    }
}

/// The legacy completions logprobs object.
fn completion_logprobs(state: &AppState, tokens: &[TokenOut], text_offset_start: usize) -> Value {
    let mut offset = text_offset_start;
    let mut offsets = Vec::new();
    for t in tokens {
        offsets.push(offset);
        offset += t.text.len();
    }
    json!({
        "tokens": tokens.iter().map(|t| token_text(state, t.id)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top_logprobs.iter().map(|&(id, lp)| (token_text(state, id), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// The chat logprobs object: `content[{token, bytes, logprob, top_logprobs}]`.
fn chat_logprobs(state: &AppState, tokens: &[TokenOut]) -> Value {
    let tok = &state.engine.info.tokenizer;
    let entry = |id: u32, lp: f32| {
        let t = token_text(state, id);
        // The token's own bytes (OpenAI's meaning), so tokens that split a UTF-8 character
        // reassemble into it; the text is only a fallback for ids the vocabulary lacks.
        let bytes = tok.token_bytes(id).unwrap_or_else(|| t.as_bytes().to_vec());
        json!({"token": t, "bytes": bytes, "logprob": lp})
    };
    json!({"content": tokens.iter().map(|t| {
        let mut e = entry(t.id, t.logprob.unwrap_or(0.0));
        e["top_logprobs"] = Value::Array(t.top_logprobs.iter().map(|&(id, lp)| entry(id, lp)).collect());
        e
    }).collect::<Vec<_>>()})
}

fn routed(sample: &Sample) -> Option<Value> {
    sample
        .finish
        .routed_experts
        .as_deref()
        .map(|r| json!(generation::routed_experts_base64(r)))
}

pub async fn completions(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let body: CompletionBody = parse_body(body)?;
    let model = body.common.check_model(&state)?;
    let prompts: Vec<PromptInput> = match body.prompt {
        None => return Err(ApiError::invalid("prompt", "missing `prompt`")),
        Some(CompletionPrompt::Text(t)) => vec![PromptInput::Text(t)],
        Some(CompletionPrompt::Texts(v)) => v.into_iter().map(PromptInput::Text).collect(),
        Some(CompletionPrompt::Ids(IdsInput::Single(ids))) => vec![PromptInput::Ids(ids)],
        Some(CompletionPrompt::Ids(IdsInput::Batch(b))) => {
            b.into_iter().map(PromptInput::Ids).collect()
        }
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` is an empty list"));
    }
    let top = body.logprobs.unwrap_or(0);
    if body.logprobs.is_some_and(|l| l < 0) {
        return Err(ApiError::invalid("logprobs", "logprobs must be >= 0"));
    }
    let opts = RequestOptions {
        return_logprob: body.logprobs.is_some(),
        logprob_start_len: -1,
        top_logprobs_num: top,
        return_routed_experts: body.common.return_routed_experts,
        add_special_tokens: true,
    };
    let params = body.common.sampling(16);
    let id = format!("cmpl-{}", validate::new_rid());
    let mut reqs = Vec::new();
    let mut prompt_texts = Vec::new();
    for prompt in prompts {
        let text = match &prompt {
            PromptInput::Text(t) => t.clone(),
            PromptInput::Ids(ids) => state
                .engine
                .info
                .tokenizer
                .decode(
                    &ids.iter().map(|&i| i.max(0) as u32).collect::<Vec<_>>(),
                    false,
                )
                .unwrap_or_default(),
        };
        let rs = validate::build_requests(&state, id.clone(), prompt, &params, &opts)
            .await
            .map_err(|e| openai_names(e, "logprobs"))?;
        prompt_texts.extend(std::iter::repeat_n(text, rs.len()));
        reqs.extend(rs);
    }
    let echo = body.echo;
    if body.common.stream {
        let include_usage = body.common.include_usage();
        return stream_openai(
            state,
            reqs,
            Kind::Completion {
                echo_prompts: echo.then_some(prompt_texts),
                with_logprobs: body.logprobs.is_some(),
            },
            id,
            model,
            include_usage,
        );
    }
    let samples = generation::collect(&state, reqs, "completions").await?;
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let prefix = if echo { prompt_texts[i].as_str() } else { "" };
            let mut c = json!({"index": i, "text": format!("{prefix}{}", s.finish.text), "logprobs": null, "finish_reason": finish_reason(&s.finish.reason), "matched_stop": matched_stop(&s.finish.reason)});
            if body.logprobs.is_some() {
                c["logprobs"] = completion_logprobs(&state, &s.tokens, prefix.len());
            }
            if let Some(r) = routed(s) {
                c["routed_experts"] = r;
            }
            c
        })
        .collect();
    Ok(Json(json!({"id": id, "object": "text_completion", "created": now(), "model": model, "choices": choices, "usage": usage(&samples.iter().collect::<Vec<_>>())})).into_response())
}

pub async fn chat_completions(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    let body: ChatBody = parse_body(body)?;
    let model = body.common.check_model(&state)?;
    if body.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must not be empty",
        ));
    }
    if let Some((i, m)) = body
        .messages
        .iter()
        .enumerate()
        .find(|(_, m)| !CHAT_ROLES.contains(&m.role.as_str()))
    {
        return Err(ApiError::invalid(
            "role",
            format!(
                "messages[{i}].role `{}` is not one of {}",
                m.role,
                CHAT_ROLES.join(", ")
            ),
        ));
    }
    let tokenizer = state.engine.info.tokenizer.clone();
    let args = TemplateArgs {
        add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
        tools: body.tools.clone(),
        kwargs: body.chat_template_kwargs.clone().unwrap_or_default(),
    };
    let messages = body.messages;
    let text = tokio::task::spawn_blocking(move || tokenizer.apply_chat_template(&messages, &args))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?
        .map_err(|e| ApiError::invalid("messages", format!("chat template: {e}")))?;
    let top = body.top_logprobs.unwrap_or(0);
    if body.top_logprobs.is_some() && !body.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    // The template already wrote any BOS it wants.
    let opts = RequestOptions {
        return_logprob: body.logprobs,
        logprob_start_len: -1,
        top_logprobs_num: top,
        return_routed_experts: body.common.return_routed_experts,
        add_special_tokens: false,
    };
    let mut params = body.common.sampling(0);
    if body.common.max_tokens.is_none() && body.common.max_completion_tokens.is_none() {
        // Chat without a limit may use what the context leaves (as vLLM and SGLang do).
        params.max_new_tokens = None;
    }
    let id = format!("chatcmpl-{}", validate::new_rid());
    let reqs =
        validate::build_requests(&state, id.clone(), PromptInput::Text(text), &params, &opts)
            .await
            .map_err(|e| openai_names(e, "top_logprobs"))?;
    if body.common.stream {
        let include_usage = body.common.include_usage();
        return stream_openai(
            state,
            reqs,
            Kind::Chat {
                with_logprobs: body.logprobs,
            },
            id,
            model,
            include_usage,
        );
    }
    let samples = generation::collect(&state, reqs, "chat_completions").await?;
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut c = json!({"index": i, "message": {"role": "assistant", "content": s.finish.text}, "logprobs": null, "finish_reason": finish_reason(&s.finish.reason), "matched_stop": matched_stop(&s.finish.reason)});
            if body.logprobs {
                c["logprobs"] = chat_logprobs(&state, &s.tokens);
            }
            if let Some(r) = routed(s) {
                c["routed_experts"] = r;
            }
            c
        })
        .collect();
    Ok(Json(json!({"id": id, "object": "chat.completion", "created": now(), "model": model, "choices": choices, "usage": usage(&samples.iter().collect::<Vec<_>>())})).into_response())
}

enum Kind {
    Completion {
        echo_prompts: Option<Vec<String>>,
        with_logprobs: bool,
    },
    Chat {
        with_logprobs: bool,
    },
}

fn stream_openai(
    state: AppState,
    reqs: Vec<GenerateRequest>,
    kind: Kind,
    id: String,
    model: String,
    include_usage: bool,
) -> Result<Response, ApiError> {
    let n = reqs.len();
    let prompt_tokens = reqs.first().map_or(0, |r| r.input_ids.len());
    let events = generation::stream_events(&state, reqs, "stream")?;
    let created = now();
    let (object, chat) = match &kind {
        Kind::Completion { .. } => ("text_completion", false),
        Kind::Chat { .. } => ("chat.completion.chunk", true),
    };
    let chunk = move |choices: Vec<Value>, usage: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": choices, "usage": usage});
    let mut completion_tokens = 0usize;
    let mut open = n;
    let mut started = vec![false; n];
    let mut offsets = vec![0usize; n];
    // Generated text sent per choice, so the finish chunk can carry what the detokenizer
    // flushed only at the end (bytes it held back waiting for a complete character).
    let mut sent = vec![String::new(); n];
    let frames = events.map(move |(i, ev, _)| {
        let mut out = Vec::new();
        match ev {
            EngineEvent::Token(t) => {
                completion_tokens += 1;
                let mut prefix = String::new();
                if !started[i] {
                    started[i] = true;
                    if chat {
                        out.push(chunk(vec![json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})], Value::Null));
                    } else if let Kind::Completion { echo_prompts: Some(p), .. } = &kind {
                        prefix = p[i].clone();
                    }
                }
                let text = format!("{prefix}{}", t.text);
                let (with_lp, c) = match &kind {
                    Kind::Chat { with_logprobs } => (*with_logprobs, json!({"index": i, "delta": {"content": text}, "logprobs": null, "finish_reason": null})),
                    Kind::Completion { with_logprobs, .. } => (*with_logprobs, json!({"index": i, "text": text, "logprobs": null, "finish_reason": null})),
                };
                let mut c = c;
                if with_lp {
                    c["logprobs"] = if chat { chat_logprobs(&state, std::slice::from_ref(&t)) } else { completion_logprobs(&state, std::slice::from_ref(&t), offsets[i] + prefix.len()) };
                }
                offsets[i] += text.len();
                sent[i].push_str(&t.text);
                out.push(chunk(vec![c], Value::Null));
            }
            EngineEvent::Finished(f) => {
                open -= 1;
                let rest = f.text.strip_prefix(sent[i].as_str()).unwrap_or_default();
                let mut c = match (chat, rest.is_empty()) {
                    (true, true) => json!({"index": i, "delta": {}, "logprobs": null}),
                    (true, false) => json!({"index": i, "delta": {"content": rest}, "logprobs": null}),
                    (false, _) => json!({"index": i, "text": rest, "logprobs": null}),
                };
                c["finish_reason"] = json!(finish_reason(&f.reason));
                c["matched_stop"] = matched_stop(&f.reason);
                if let Some(r) = &f.routed_experts {
                    c["routed_experts"] = json!(generation::routed_experts_base64(r));
                }
                out.push(chunk(vec![c], Value::Null));
                if open == 0 && include_usage {
                    out.push(chunk(vec![], json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens})));
                }
            }
            EngineEvent::Error(e) => {
                open -= 1;
                out.push(ApiError::from(e).body());
            }
        }
        let mut events: Vec<Result<Event, std::convert::Infallible>> = out.into_iter().map(|v| Ok(Event::default().data(v.to_string()))).collect();
        if open == 0 {
            events.push(Ok(Event::default().data("[DONE]")));
        }
        futures_util::stream::iter(events)
    });
    Ok(Sse::new(frames.flatten()).into_response())
}

pub async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": state.served_model_name.to_string(), "object": "model", "created": now(), "owned_by": "lockstep", "root": state.engine.info.model_path, "max_model_len": state.limits.context_len}]}),
    )
}
