//! The trainer's rollout side: batched `/generate` calls and their parsed samples. Weight
//! pushes go through the `lockstep push` library ([`crate::push::push_tensors`]).

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{header, Method, Request};
use serde_json::{json, Value};

use super::TrainError;

type Http = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    Full<Bytes>,
>;

/// One rollout server.
#[derive(Clone)]
pub struct Server {
    pub base: String,
    pub admin_api_key: Option<String>,
    http: Http,
}

/// One sampled completion as the server reported it.
#[derive(Clone, Debug)]
pub struct Sample {
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<f32>,
    /// `[prompt + output - 1, moe_layers, top_k]`, when asked for.
    pub routed_experts: Option<Vec<i32>>,
    pub weight_version: String,
}

/// One prompt to sample, with its seed.
pub struct RolloutRequest<'a> {
    pub prompt: &'a [u32],
    pub max_new_tokens: usize,
    pub sampling_seed: u64,
}

impl Server {
    pub fn new(base: &str, admin_api_key: Option<String>) -> Server {
        Server {
            base: base.trim_end_matches('/').to_string(),
            admin_api_key,
            http: hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http(),
        }
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        json_body: bool,
    ) -> Result<Value, TrainError> {
        let url = format!("{}{path}", self.base);
        let mut b = Request::builder().method(method).uri(&url);
        if let Some(k) = &self.admin_api_key {
            b = b.header(header::AUTHORIZATION, format!("Bearer {k}"));
        }
        if json_body {
            b = b.header(header::CONTENT_TYPE, "application/json");
        }
        let req = b.body(Full::new(body)).map_err(|e| TrainError::Http {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        let resp = self.http.request(req).await.map_err(|e| TrainError::Http {
            url: url.clone(),
            reason: e.to_string(),
        })?;
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| TrainError::Http {
                url: url.clone(),
                reason: e.to_string(),
            })?
            .to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if !status.is_success() {
            return Err(TrainError::Http {
                url,
                reason: format!("{status}: {}", String::from_utf8_lossy(&bytes)),
            });
        }
        Ok(v)
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, TrainError> {
        self.call(Method::POST, path, Bytes::from(body.to_string()), true)
            .await
    }

    /// The server's current weight version.
    pub async fn weight_version(&self) -> Result<String, TrainError> {
        let v = self
            .call(Method::GET, "/get_weight_version", Bytes::new(), false)
            .await?;
        Ok(v["weight_version"].as_str().unwrap_or_default().to_string())
    }

    /// Samples every request once (temperature 1, no truncation, so the reported logprobs
    /// are the policy's own) in one batched `/generate` call.
    pub async fn generate(
        &self,
        reqs: &[RolloutRequest<'_>],
        routed_experts: bool,
    ) -> Result<Vec<Sample>, TrainError> {
        let body = json!({
            "input_ids": reqs.iter().map(|r| json!(r.prompt)).collect::<Vec<_>>(),
            "sampling_params": reqs.iter().map(|r| json!({
                "max_new_tokens": r.max_new_tokens,
                "temperature": 1.0,
                "sampling_seed": r.sampling_seed,
            })).collect::<Vec<_>>(),
            "return_logprob": true,
            "return_routed_experts": routed_experts,
        });
        let v = self.post("/generate", &body).await?;
        let items = match &v {
            Value::Array(a) => a.clone(),
            one => vec![one.clone()],
        };
        let bad = |what: &str| TrainError::Http {
            url: format!("{}/generate", self.base),
            reason: format!("response without {what}"),
        };
        items
            .iter()
            .map(|item| {
                let m = &item["meta_info"];
                let output_ids = item["output_ids"]
                    .as_array()
                    .ok_or_else(|| bad("output_ids"))?
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .map(|x| x as u32)
                            .ok_or_else(|| bad("integer output_ids"))
                    })
                    .collect::<Result<Vec<u32>, _>>()?;
                let logprobs = m["output_token_logprobs"]
                    .as_array()
                    .ok_or_else(|| bad("output_token_logprobs"))?
                    .iter()
                    .map(|e| {
                        e[0].as_f64()
                            .map(|x| x as f32)
                            .ok_or_else(|| bad("a logprob"))
                    })
                    .collect::<Result<Vec<f32>, _>>()?;
                let routed_experts = match m["routed_experts"].as_str() {
                    Some(b64) => {
                        let bytes = base64::engine::general_purpose::STANDARD
                            .decode(b64)
                            .map_err(|_| bad("base64 routed_experts"))?;
                        Some(
                            bytes
                                .chunks_exact(4)
                                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                                .collect(),
                        )
                    }
                    None => None,
                };
                Ok(Sample {
                    output_ids,
                    logprobs,
                    routed_experts,
                    weight_version: m["weight_version"].as_str().unwrap_or_default().to_string(),
                })
            })
            .collect()
    }
}
